"""Comparison helpers: flowexec against eager PyTorch."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


def assert_close_rel(a: Any, b: Any, tol: float = 1e-5, what: str = "", floor: float = 0.0) -> None:
    """``a`` within relative error ``tol`` of ``b``; where ``b``'s norm is below ``floor`` (a value
    that is zero up to rounding, such as the gradient of a convolution's bias before batch norm,
    whose relative error is noise over noise) their difference must be below ``floor`` instead."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape, f"{what}: shape {a.shape} vs {b.shape}"
        if a.dtype.is_floating_point and floor and b.detach().double().norm() < floor:
            diff = (a.detach().double() - b.detach().double()).norm().item()
            assert diff < floor, f"{what}: {diff:.3g} apart (both at rounding level)"
        elif a.dtype.is_floating_point:
            e = rel_err(a, b)
            assert e <= tol, f"{what}: relative error {e:.3g} > {tol}"
        else:
            assert torch.equal(a, b), f"{what}: values differ"
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_rel(x, y, tol, f"{what}[{i}]", floor)
    else:
        assert a == b, f"{what}: {a} vs {b}"


def assert_same_state(m1: torch.nn.Module, m2: torch.nn.Module, tol: float = 1e-5) -> None:
    """Parameters, their grads and buffers of two models agree."""
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert_close_rel(p1, p2, tol, f"param {n}")
        if p2.grad is not None:
            assert p1.grad is not None, f"grad {n} missing"
            assert_close_rel(p1.grad, p2.grad, tol, f"grad {n}", floor=1e-6)
    for (n, b1), (_, b2) in zip(m1.named_buffers(), m2.named_buffers()):
        assert_close_rel(b1, b2, tol, f"buffer {n}")


def twin(model: torch.nn.Module, make_opt: Callable[[Any], torch.optim.Optimizer]):
    """Two identical (model, optimizer) pairs."""
    m2 = copy.deepcopy(model)
    return (model, make_opt(model.parameters())), (m2, make_opt(m2.parameters()))


def block_adam_twins(batches: int):
    """On CUDA: two identical transformer blocks with foreach, capturable Adam (eager then
    computes bias corrections on the device, as a captured program does), their training
    steps, ``batches`` batches of token ids, and one eager step of each taken on the first
    batch (Adam's state exists before capture): ``(m1, m2, step1, step2, data)``."""
    device = "cuda"
    from flowexec.models import Block, lm_loss, make_step

    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(Block().to(device), lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True, capturable=True))
    s1, s2 = make_step(m1, o1, lm_loss), make_step(m2, o2, lm_loss)
    data = [(torch.randint(0, 50, (2, 16), device=device), torch.randint(0, 50, (2, 16), device=device))
            for _ in range(batches)]
    s1(*data[0]), s2(*data[0])
    return m1, m2, s1, s2, data


def record_graph_programs(monkeypatch: Any) -> list[tuple[Any, list[str], list[Any]]]:
    """Every backend GraphProgram made from now on (with monkeypatch): (program, placeholder
    names, output node names) of the AOT graph it was built from."""
    import flowexec.backend as backend

    made: list[tuple[Any, list[str], list[Any]]] = []
    init = backend.GraphProgram.__init__

    def record(self: Any, gm: Any, *args: Any, **kwargs: Any) -> None:
        init(self, gm, *args, **kwargs)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        made.append((self, [n.name for n in gm.graph.nodes if n.op == "placeholder"],
                     [getattr(o, "name", None) for o in out]))

    monkeypatch.setattr(backend.GraphProgram, "__init__", record)
    return made


def play_jobs(runner: Any, order: str, xs: Any, gs: Any) -> tuple[dict, dict]:
    """Run a pipeline stage runner's jobs in ``order`` ("F0 F1 I1 B0 W1 ...": forward, whole
    backward, input-gradient and weight-gradient halves of micro-batch m); return the forward
    outputs and input gradients by micro-batch."""
    outs, gins = {}, {}
    for job in order.split():
        kind, m = job[0], int(job[1:])
        if kind == "F":
            outs[m] = runner.forward(m, xs[m])
        elif kind == "B":
            gins[m] = runner.backward(m, gs[m])
        elif kind == "I":
            gins[m] = runner.backward_input(m, gs[m])
        else:
            runner.backward_weight(m)
    return outs, gins


def eager_stage_grads(mod: torch.nn.Module, xs: Any, gs: Any) -> tuple[list, list, list]:
    """Eager reference for a pipeline stage: per micro-batch outputs and input gradients (each
    micro-batch's inputs a list of tensors, ``gs`` the output gradients), and the parameter
    gradients summed over the micro-batches."""
    outs, gins = [], []
    for x, g in zip(xs, gs):
        xr = [t.clone().requires_grad_(True) for t in x]
        y = mod(*xr)
        y = y if isinstance(y, tuple) else (y,)
        torch.autograd.backward(y, g)
        outs.append([t.detach() for t in y])
        gins.append([t.grad for t in xr])
    return outs, gins, [p.grad for p in mod.parameters()]


def sgd_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float = 0.1) -> list[float]:
    """The unsplit reference of a pipeline: ``steps`` SGD steps on the MSE of the whole batch;
    returns each step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def clipped_sgd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
                max_norm: float) -> list[torch.Tensor]:
    """The unsplit reference of a pipeline trained with ``max_grad_norm``: ``steps`` SGD steps on
    the MSE of the whole batch, each clipped by ``clip_grad_norm_``; returns each step's norm
    (checked to exceed ``max_norm``, so that the clip changes every step)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
    assert min(float(n) for n in norms) > 2 * max_norm, "the reference's gradients never needed the clip"
    return norms


def assert_stage_jobs_match_eager(runner: Any, stage: torch.nn.Module, ref: torch.nn.Module, order: str,
                                  xs: Any, gs: Any, tol: float = 1e-5) -> None:
    """Play ``order`` on a stage runner and check its outputs, input gradients and the
    parameters' gradients against eager autograd on ``ref`` (an untouched copy of ``stage``)."""
    outs, gins = play_jobs(runner, order, xs, gs)
    r_outs, r_gins, r_grads = eager_stage_grads(ref, xs, gs)
    for m in outs:
        assert_close_rel(list(outs[m]), list(r_outs[m]), tol, f"output of micro-batch {m}")
        assert_close_rel(list(gins[m]), list(r_gins[m]), tol, f"input grad of micro-batch {m}")
    for p, want in zip(stage.parameters(), r_grads):
        assert_close_rel(p.grad, want, tol, "weight grad")



def zero_first_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                    loss_fn: Callable[..., torch.Tensor] = lambda out: out.square().mean()) -> Callable[..., torch.Tensor]:
    """The benchmarks' step: ``zero_grad(set_to_none=True)`` first, forward, ``loss_fn(out, *rest)``,
    backward, optimizer step; returns the loss, detached. Called as ``step(x, *rest)``."""
    def step(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), *rest)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def state_heavy_step(device: str = "cuda") -> tuple[torch.nn.Module, Callable[..., torch.Tensor], torch.Tensor]:
    """(model, step, batch): eight 2048-wide layers with fused AdamW at batch 4, taken one step
    (state made), whose parameters and optimizer state outweigh its activations: what a
    capture holds beside them shows in its peak."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(4, 2048, device=device)
    step = zero_first_step(model, opt)
    step(x)
    return model, step, x


def assert_rnn_trains_like_eager(rnn: torch.nn.Module, device: str = "cpu", **options: Any) -> None:
    """A token model around ``rnn`` (batch_first, 8 features in, 16 out) on ``device`` trained by
    SGD with momentum, eager against ``flowexec.compile(step, **options)``: losses and state agree."""
    import torch.nn.functional as F

    import flowexec
    from flowexec.models import make_step

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e, self.rnn, self.o = torch.nn.Embedding(20, 8), rnn, torch.nn.Linear(16, 20)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o(self.rnn(self.e(x))[0])

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    (m1, o1), (m2, o2) = twin(Net().to(device), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    # A deep copy holds a cuDNN RNN's weights apart (torch warns they are compacted at every call,
    # and cuDNN then views no packed buffer); a user's model moved to the GPU has them in one.
    m2.rnn.flatten_parameters()
    eager, mine = make_step(m1, o1, loss_fn), make_step(m2, o2, loss_fn)
    data = [(x, x) for x in torch.randint(0, 20, (4, 3, 6), device=device)]
    eager(*data[0]), mine(*data[0])
    exe = flowexec.compile(mine, **options)
    for x, y in data[1:]:
        assert_close_rel(exe(x, y), eager(x, y), what="loss")
    assert_same_state(m1, m2)


def assert_seeded_calls_match(eager: Callable[..., Any], exe: Callable[..., Any], *args: Any, calls: int = 4) -> None:
    """Call ``k`` of ``exe`` equals eager's after the same ``torch.manual_seed(k)`` (random ops)."""
    for k in range(calls):
        torch.manual_seed(k)
        want = eager(*args)
        torch.manual_seed(k)
        assert_close_rel(exe(*args), want, what=f"call {k}")

