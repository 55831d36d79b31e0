"""Calling conventions: pytree and keyword arguments, container outputs, the lazy and decorator
forms of flowexec.compile, against eager PyTorch (trace mode; graph mode with stand-in graphs)."""
from __future__ import annotations

import copy
import dataclasses
import warnings
from collections import namedtuple

import pytest
import torch
from torch.utils import _pytree as pytree

import flowexec
from flowexec import CaptureError, InputError, OptionError, RecaptureWarning
from flowexec.executable import Executable, NotCapturedError
from helpers import assert_close_rel
from test_staging import stand_in_graphs  # noqa: F401  (a fixture: graph mode on CPU)

Out = namedtuple("Out", "loss logits")


def _mlp_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 4, generator=g) * 0.3, torch.zeros(8), torch.randn(3, 8, generator=g) * 0.3, torch.zeros(3)]


def _forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return torch.tanh(x @ w1.t() + b1) @ w2.t() + b2


# --- the table: each convention against eager ------------------------------------------

def _list_arg(params, x):
    return _forward(params, x).sum(1)


def _dict_arg(d, x):
    return (x * d["scale"] + d["shift"]).relu()


def _nested_tuple_arg(t, x):
    (a, (b, c)), k = t
    return a * x + b - c * k


def _keyword_arg(x, *, scale, bias=None):
    return x * scale if bias is None else x * scale + bias


def _dict_out(x):
    return {"double": x * 2, "sum": x.sum()}


def _namedtuple_out(params, x):
    logits = _forward(params, x)
    return Out(logits.square().mean(), logits)


def _nested_out(x):
    return [x + 1, {"t": (x * 2, None), "k": 3}]


CONVENTIONS = {
    "list argument": (_list_arg, lambda: ((_mlp_params(), torch.randn(5, 4)), {})),
    "dict argument": (_dict_arg, lambda: (({"scale": torch.randn(6), "shift": torch.randn(6)}, torch.randn(6)), {})),
    "nested tuple argument": (_nested_tuple_arg,
                              lambda: ((((torch.randn(3), (torch.randn(3), torch.randn(3))), 2.0), torch.randn(3)), {})),
    "keyword argument": (_keyword_arg, lambda: ((torch.randn(4),), {"scale": 3.0, "bias": torch.randn(4)})),
    "dict output": (_dict_out, lambda: ((torch.randn(5),), {})),
    "namedtuple output": (_namedtuple_out, lambda: ((_mlp_params(), torch.randn(2, 4)), {})),
    "nested output": (_nested_out, lambda: ((torch.randn(3),), {})),
}


def _same_tree(got, want) -> None:
    """Same container types all the way down, and leaves equal to eager's within 1e-5."""
    assert type(got) is type(want), f"{type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _same_tree(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _same_tree(a, b)
    else:
        assert_close_rel(got, want)


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_each_convention_matches_eager(name):
    fn, make = CONVENTIONS[name]
    args, kwargs = make()
    exe = flowexec.compile(fn, *args, example_kwargs=kwargs)
    for seed in range(2):  # the example call, then other tensors of the same signature
        torch.manual_seed(seed)
        args, kwargs = make()
        args = pytree.tree_map(lambda a: a + seed if isinstance(a, torch.Tensor) else a, args)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RecaptureWarning)
            _same_tree(exe(*args, **kwargs), fn(*args, **kwargs))


def test_dict_output_is_a_plain_dict_and_namedtuple_keeps_its_type():
    assert type(flowexec.compile(_dict_out, torch.ones(2))(torch.ones(2))) is dict
    got = flowexec.compile(_namedtuple_out, _mlp_params(), torch.ones(1, 4))(_mlp_params(), torch.ones(1, 4))
    assert type(got) is Out and got.logits.shape == (1, 3)


# --- a functional training step: params and optimizer state in lists, written in place --------

def _sgd_momentum_step(params: list[torch.Tensor], moms: list[torch.Tensor], x, y, *, lr: float, beta: float):
    for p in params:
        p.requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(_forward(params, x), y)
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        torch._foreach_mul_(moms, beta)
        torch._foreach_add_(moms, grads)
        torch._foreach_add_(params, moms, alpha=-lr)
    for p in params:
        p.requires_grad_(False)
    return {"loss": loss.detach()}


def _adam_step(state: dict, x, y):
    params, m, v = state["params"], state["m"], state["v"]
    for p in params:
        p.requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(_forward(params, x), y)
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        torch._foreach_lerp_(m, grads, 0.1)
        torch._foreach_mul_(v, 0.999)
        torch._foreach_addcmul_(v, grads, grads, value=0.001)
        denom = torch._foreach_add(torch._foreach_sqrt(v), 1e-8)
        torch._foreach_addcdiv_(params, m, denom, value=-1e-2)
    for p in params:
        p.requires_grad_(False)
    return loss.detach(), state["step"]


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def test_functional_sgd_momentum_over_lists_updates_the_callers_tensors():
    params, moms = _mlp_params(), [torch.zeros_like(p) for p in _mlp_params()]
    eparams, emoms = copy.deepcopy(params), copy.deepcopy(moms)
    data = _batches(3)
    exe = flowexec.compile(_sgd_momentum_step, params, moms, *data[0], example_kwargs={"lr": 0.1, "beta": 0.9})
    assert [torch.equal(a, b) for a, b in zip(params, eparams)] == [True] * 4  # capture leaves no trace
    ids = [id(p) for p in params]
    for x, y in data:
        got = exe(params, moms, x, y, lr=0.1, beta=0.9)
        want = _sgd_momentum_step(eparams, emoms, x, y, lr=0.1, beta=0.9)
        _same_tree(got, want)
    assert [id(p) for p in params] == ids
    assert_close_rel(params, eparams, what="params after 3 steps")
    assert_close_rel(moms, emoms, what="momentum after 3 steps")
    assert not torch.equal(params[0], _mlp_params()[0])  # the steps did move them


def test_functional_adam_over_a_dict_of_lists():
    def fresh():
        p = _mlp_params()
        return {"params": p, "m": [torch.zeros_like(t) for t in p], "v": [torch.zeros_like(t) for t in p], "step": 0}
    state, estate = fresh(), fresh()
    data = _batches(3)
    step = flowexec.compile(_adam_step)  # lazy: captures on the first call
    for x, y in data:
        (loss, k), (eloss, ek) = step(state, x, y), _adam_step(estate, x, y)
        assert_close_rel(loss, eloss)
        assert k == ek == 0
    for name in ("params", "m", "v"):
        assert_close_rel(state[name], estate[name], what=name)
    assert len(step._cache) == 1



@pytest.mark.parametrize("own", [True, False], ids=["the module's own parameters", "other tensors"])
def test_functional_call_over_parameters_in_a_list_trains_as_eager(own):
    """torch.func.functional_call swaps the tensors it is given into the module for the run and
    back after: no guard may hold the module to what was swapped in (a fake capture's stand-ins)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    twin = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]

    def step(net, params, x, y):
        loss = torch.nn.functional.cross_entropy(torch.func.functional_call(net, dict(zip(names, params)), (x,)), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-0.1)
        return loss.detach()

    params = list(model.parameters()) if own else [p.detach().clone().requires_grad_() for p in model.parameters()]
    eparams = list(twin.parameters()) if own else [p.detach().clone().requires_grad_() for p in twin.parameters()]
    exe = flowexec.compile(lambda params, x, y: step(model, params, x, y))
    for x, y in _batches(3):
        assert_close_rel(exe(params, x, y), step(twin, eparams, x, y))
    assert_close_rel(params, eparams, what="params after 3 steps")
    assert len(exe._cache) == 1

# --- signatures: structure and non-tensor leaves ------------------------------------------------

def test_a_new_structure_or_scalar_leaf_recaptures_with_a_warning():
    exe = flowexec.compile(lambda xs, k: sum(xs) * k, [torch.ones(2), torch.ones(2)], 2)
    with pytest.warns(RecaptureWarning, match=r"args\[0\]: list of 3, compiled for list of 2"):
        assert torch.equal(exe([torch.ones(2)] * 3, 2), torch.full((2,), 6.0))
    with pytest.warns(RecaptureWarning, match=r"args\[1\]: int 5, compiled for int 2"):
        assert torch.equal(exe([torch.ones(2)] * 2, 5), torch.full((2,), 10.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        assert torch.equal(exe([torch.ones(2)] * 3, 2), torch.full((2,), 6.0))  # compiled already
    d = flowexec.compile(lambda d: d["a"] * 2, {"a": torch.ones(1)})
    with pytest.warns(RecaptureWarning, match=r"args\[0\]: dict with keys \['a', 'b'\], compiled for dict with keys \['a'\]"):
        d({"a": torch.ones(1), "b": torch.ones(1)})


def test_keyword_arguments_in_any_order_are_one_signature():
    exe = flowexec.compile(lambda x, *, a, b: x * a - b, torch.ones(2), example_kwargs={"a": 2.0, "b": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        assert torch.equal(exe(torch.ones(2), b=1.0, a=2.0), torch.ones(2))
    with pytest.warns(RecaptureWarning, match=r"kwargs\['a'\]: float 3.0, compiled for float 2.0"):
        assert torch.equal(exe(torch.ones(2), a=3.0, b=1.0), torch.full((2,), 2.0))


def test_errors_name_the_leaf_path():
    fn = lambda state, x: state["w"] * x + state["opt"][0]  # noqa: E731
    exe = flowexec.compile(fn, {"w": torch.ones(2), "opt": [torch.ones(2), torch.ones(2), 1.0, torch.ones(2)]},
                           torch.ones(2))
    bad = {"w": torch.ones(2), "opt": [torch.ones(2), torch.ones(2), 1.0, "oops"]}
    with pytest.raises(InputError, match=r"args\[0\]\['opt'\]\[3\]: expected Tensor\(shape=\[2\].*got str 'oops'"):
        exe(bad, torch.ones(2))
    with pytest.raises(InputError, match=r"args\[0\]\['opt'\]\[1\]: flowexec.compile takes containers .* got object"):
        exe({"w": torch.ones(2), "opt": [torch.ones(2), object()]}, torch.ones(2))
    with pytest.raises(InputError, match=r"kwargs\['k'\]: .* got set"):
        flowexec.compile(lambda x, k: x, torch.ones(1), example_kwargs={"k": {1}})


def test_options_and_fn_keywords_are_told_apart():
    with pytest.raises(OptionError, match=r"unknown option\(s\) 'scale'.*exe\(x, name=value\).*example_kwargs"):
        flowexec.compile(_keyword_arg, torch.ones(2), scale=2.0)


def test_changing_the_containers_themselves_is_a_capture_error():
    def counts(state, x):
        state["step"] += 1  # a Python counter: a compiled call could not replay it
        return x * 2
    with pytest.raises(CaptureError, match=r"changed the containers it was passed \(at args\[0\]\['step'\]\)"):
        flowexec.compile(counts, {"step": 0}, torch.ones(2))


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda xs, _: Pair(*xs))


def test_registered_pytree_types_in_and_out():
    fn = lambda p: Pair(p.a + p.b, p.a * p.b)  # noqa: E731
    exe = flowexec.compile(fn, Pair(torch.ones(3), torch.full((3,), 2.0)))
    got = exe(Pair(torch.arange(3.0), torch.ones(3)))
    assert type(got) is Pair and torch.equal(got.a, torch.arange(3.0) + 1) and torch.equal(got.b, torch.arange(3.0))


def test_fetch_counts_outputs_in_flattened_order():
    fn = lambda x: {"y": x * 2, "loss": x.sum()}  # noqa: E731  (flat outputs: y, loss)
    exe = flowexec.compile(fn, torch.ones(3), fetch=[1])
    out = exe(torch.ones(3))
    assert isinstance(out["loss"], flowexec.Fetch) and out["loss"].result() == 3.0
    with pytest.raises(OptionError, match="output 0 is not a one-element"):
        flowexec.compile(fn, torch.ones(3), fetch=[0])


# --- the lazy and decorator forms ---------------------------------------------------------------

def test_lazy_form_captures_on_the_first_call_and_says_so_before():
    exe = flowexec.compile(lambda x, *, k: x.cumsum(0) * k)
    assert isinstance(exe, Executable)
    for attr in ("program", "plan", "build_seconds"):
        with pytest.raises(NotCapturedError, match=f"{attr}: nothing is captured yet"):
            getattr(exe, attr)
    assert torch.equal(exe(torch.ones(3), k=2), torch.tensor([2.0, 4.0, 6.0]))
    assert exe.plan.stats()["ops"] == 2


def test_decorator_forms():
    @flowexec.compile
    def plain(params, x):
        return _forward(params, x)

    @flowexec.compile(gc="none", cache_size=2)
    def configured(x, *, scale):
        return x * scale

    params, x = _mlp_params(), torch.randn(2, 4)
    assert_close_rel(plain(params, x), _forward(params, x))
    assert plain.__name__ == "plain" and isinstance(plain, Executable)
    assert torch.equal(configured(torch.ones(2), scale=3), torch.full((2,), 3.0))
    assert configured.gc == "none" and configured.cache_size == 2
    if not torch.cuda.is_available():  # the decorator with options checks them when it is applied
        with pytest.raises(OptionError, match="mode='graph' captures a CUDA graph, but this machine has no CUDA"):
            flowexec.compile(mode="graph")(lambda x: x)
    with pytest.raises(OptionError, match="unknown option"):
        flowexec.compile(mdoe="graph")


# --- graph mode with pytrees (stand-in graphs on CPU; tests/gpu runs the real ones) ------------

def test_graph_mode_list_state_is_read_in_place_and_matches_eager(stand_in_graphs):  # noqa: F811
    params, moms = _mlp_params(), [torch.zeros_like(p) for p in _mlp_params()]
    eparams, emoms = copy.deepcopy(params), copy.deepcopy(moms)
    data = _batches(3)
    exe = Executable(_sgd_momentum_step, "graph", "fast", {}).compile_for(params, moms, *data[0], lr=0.1, beta=0.9)
    for x, y in data:
        _same_tree(exe(params, moms, x, y, lr=0.1, beta=0.9), _sgd_momentum_step(eparams, emoms, x, y, lr=0.1, beta=0.9))
    assert_close_rel(params, eparams, what="params")
    assert_close_rel(moms, emoms, what="moms")
    runner = exe._last.runner
    assert runner.graph_count == 1
    assert runner.first._borrowed and len(runner.first._borrowed) == 8  # params and moms: written in place


def test_graph_mode_borrow_positions_are_flattened_leaves(stand_in_graphs):  # noqa: F811
    fn = lambda d, x: d["w"] * x  # noqa: E731  (leaves: d['w'] = 0, x = 1)
    w = torch.randn(4)
    exe = Executable(fn, "graph", "fast", {"borrow": (0,)}).compile_for({"w": w}, torch.ones(4))
    assert [i for i, _ in exe._last.runner.first._borrowed] == [0]
    x = torch.randn(4)
    assert torch.equal(exe({"w": w}, x), w * x)
    with pytest.raises(OptionError, match=r"borrow: 2 is not the position of a tensor argument \(positions count"):
        Executable(fn, "graph", "fast", {"borrow": (2,)}).compile_for({"w": w}, torch.ones(4))


# --- the guarded fast path: only what can change is checked per call --------------------------

def test_parameters_or_plain_tensors_and_alternating_shapes_stay_correct():
    fn = lambda ws, x: [w * x for w in ws]  # noqa: E731
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    exe = flowexec.compile(fn, params, torch.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)  # the class of a tensor is not its signature
        got = exe([p.detach().clone() for p in params], torch.full((3,), 2.0))
    assert_close_rel(got, [p.detach() * 2 for p in params])
    with pytest.warns(RecaptureWarning, match=r"args\[0\]\[0\]: Tensor\(shape=\[4\], .*compiled for Tensor\(shape=\[3\]"):
        exe([torch.ones(4), torch.ones(4)], torch.ones(4))
    for n in (3, 4, 3, 4):  # two signatures of one structure taking turns: each call its own
        ws, x = [torch.randn(n), torch.randn(n)], torch.randn(n)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RecaptureWarning)
            assert_close_rel(exe(ws, x), fn(ws, x))
    t = torch.randn(3, 3)
    strided = flowexec.compile(lambda a: a.reshape(-1) * 2, t)
    with pytest.warns(RecaptureWarning, match="stride"):  # same shape, transposed: the guard sees it
        assert_close_rel(strided(t.t()), t.t().reshape(-1) * 2)


def test_lazily_loaded_names_become_attributes_of_the_package():
    """`flowexec.fast_item(t)` in a loop must not run the package's __getattr__ hook each call
    (an import statement every time: a few µs against a 5 µs read)."""
    f = flowexec.fast_item
    assert vars(flowexec)["fast_item"] is f and f(torch.tensor(2.5)) == 2.5
    assert flowexec.FetchRing is vars(flowexec)["FetchRing"]


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_each_convention_in_graph_mode_with_stand_in_graphs(stand_in_graphs, name):  # noqa: F811
    fn, make = CONVENTIONS[name]
    args, kwargs = make()
    exe = Executable(fn, "graph", "fast", {}).compile_for(*args, **kwargs)
    for seed in range(2):
        torch.manual_seed(seed)
        args, kwargs = make()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RecaptureWarning)
            _same_tree(exe(*args, **kwargs), fn(*args, **kwargs))
    assert type(exe._last.runner).__name__ == "GraphVariants"
