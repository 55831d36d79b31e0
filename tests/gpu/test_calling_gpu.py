"""Calling conventions in graph mode on CUDA against eager: pytree arguments, keyword arguments,
container outputs, functional steps over lists (run on the lent GPU; skipped without CUDA)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import flowexec
from helpers import assert_close_rel
from test_calling import CONVENTIONS, _adam_step, _batches, _mlp_params, _same_tree, _sgd_momentum_step

torch.backends.cuda.matmul.allow_tf32 = False


def _cuda(tree):
    return pytree.tree_map(lambda a: a.cuda() if isinstance(a, torch.Tensor) else a, tree)


@pytest.mark.parametrize("name", list(CONVENTIONS))
@pytest.mark.parametrize("mode", ["trace", "graph"])
def test_each_convention_matches_eager_on_cuda(name, mode):
    fn, make = CONVENTIONS[name]
    args, kwargs = _cuda(make())
    exe = flowexec.compile(fn, *args, example_kwargs=kwargs, mode=mode)
    for seed in range(3):
        torch.manual_seed(seed)
        args, kwargs = _cuda(make())
        with warnings.catch_warnings():
            warnings.simplefilter("error", flowexec.RecaptureWarning)
            _same_tree(exe(*args, **kwargs), fn(*args, **kwargs))


@pytest.mark.parametrize("mode", ["trace", "graph"])
def test_functional_sgd_momentum_over_lists_on_cuda(mode):
    params = _cuda(_mlp_params())
    moms = [torch.zeros_like(p) for p in params]
    eparams, emoms = copy.deepcopy(params), copy.deepcopy(moms)
    data = _cuda(_batches(3))
    step = flowexec.compile(_sgd_momentum_step, mode=mode)  # the lazy form
    for x, y in data:
        _same_tree(step(params, moms, x, y, lr=0.1, beta=0.9), _sgd_momentum_step(eparams, emoms, x, y, lr=0.1, beta=0.9))
    assert_close_rel(params, eparams, what="params after 3 steps")
    assert_close_rel(moms, emoms, what="momentum after 3 steps")
    if mode == "graph":
        first = step._last.runner.first
        assert len(first._borrowed) == 8  # params and moms are read where they are, not copied in


def test_functional_adam_dict_of_lists_graph_decorator():
    @flowexec.compile(mode="graph")
    def step(state, x, y):
        return _adam_step(state, x, y)

    def fresh():
        p = _cuda(_mlp_params())
        return {"params": p, "m": [torch.zeros_like(t) for t in p], "v": [torch.zeros_like(t) for t in p], "step": 0}
    state, estate = fresh(), fresh()
    for x, y in _cuda(_batches(3)):
        (loss, k), (eloss, _) = step(state, x, y), _adam_step(estate, x, y)
        assert_close_rel(loss, eloss)
        assert k == 0
    for name in ("params", "m", "v"):
        assert_close_rel(state[name], estate[name], what=name)


def test_graph_mode_parameters_as_one_list_argument_are_borrowed():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    twin = copy.deepcopy(model)
    params = list(model.parameters())

    def step(params, x, y):
        loss = torch.func.functional_call(model, dict(zip([n for n, _ in model.named_parameters()], params)), (x,))
        loss = torch.nn.functional.cross_entropy(loss, y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-0.1)
        return loss.detach()

    def eager(x, y):
        loss = torch.nn.functional.cross_entropy(twin(x), y)
        grads = torch.autograd.grad(loss, list(twin.parameters()))
        with torch.no_grad():
            torch._foreach_add_(list(twin.parameters()), grads, alpha=-0.1)
        return loss.detach()

    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
    exe = flowexec.compile(step, params, x, y, mode="graph")
    for _ in range(3):
        assert_close_rel(exe(params, x, y), eager(x, y))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close_rel(p, q)
    assert len(exe._last.runner.first._borrowed) == len(params)
