"""In-graph staging of per-call inputs: the memcpy-node state machine and the runner's fallback,
on CPU with a recording stand-in for CUDA's runtime bindings (the GPU tests run the real thing)."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

import flowexec

from flowexec.runtime import cuda_graph as CG
from flowexec.runtime.staging import StagingNodes


class FakeRuntime:
    """Records the node updates StagingNodes asks for; ``fail`` makes them return an error."""

    class cudaMemcpyKind:
        cudaMemcpyDeviceToDevice = "d2d"

    class cudaError_t:
        cudaSuccess = 0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail = False

    def cudaGraphNodeSetEnabled(self, graph_exec: Any, node: Any, on: int) -> tuple[int]:
        self.calls.append(("enabled", node, on))
        return (700 if self.fail else 0,)

    def cudaGraphExecMemcpyNodeSetParams1D(self, graph_exec: Any, node: Any, dst: int, src: int, nbytes: int,
                                           kind: str) -> tuple[int]:
        self.calls.append(("source", node, src, nbytes))
        return (700 if self.fail else 0,)

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


def test_nodes_follow_addresses_buffers_and_strided_inputs():
    rt = FakeRuntime()
    static, example = torch.zeros(4), torch.ones(4)
    st = StagingNodes(rt, "exec", [(0, "n0", static, example.data_ptr())])
    st.point((example,))
    assert rt.take() == []  # the node already reads the example
    a = torch.randn(4)
    st.point((a,))
    assert rt.take() == [("source", "n0", a.data_ptr(), 16)]
    st.point((a,))
    assert rt.take() == []  # same address as last call: nothing to do
    st.point((static,))
    assert rt.take() == [("enabled", "n0", 0)]  # the caller filled the buffer itself
    st.point((static,))
    assert rt.take() == []
    b = torch.randn(4)
    st.point((b,))
    assert rt.take() == [("enabled", "n0", 1), ("source", "n0", b.data_ptr(), 16)]
    strided = torch.randn(8)[::2]
    st.point((strided,))
    assert rt.take() == [("enabled", "n0", 0)] and torch.equal(static, strided)
    strided.fill_(3.0)
    st.point((strided,))  # staged from Python on every call
    assert rt.take() == [] and torch.equal(static, torch.full((4,), 3.0))
    st.point((a,))
    assert rt.take() == [("enabled", "n0", 1), ("source", "n0", a.data_ptr(), 16)]


def test_a_failed_update_names_the_call():
    rt = FakeRuntime()
    st = StagingNodes(rt, "exec", [(0, "n0", torch.zeros(2), 0)])
    rt.fail = True
    with pytest.raises(RuntimeError, match="cudaGraphExecMemcpyNodeSetParams1D failed"):
        st.point((torch.ones(2),))


class FakeGraph:
    """Replays by running the captured body again, as the real graph would re-run its work."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()

    def pool(self) -> None:
        return None


def test_runner_stages_from_python_when_a_copy_is_no_memcpy_node(monkeypatch):
    captures: list[bool] = []

    def fake_capture(fn: Callable[[], Any], warmup: int = 3, pool: Any = None, keep_graph: bool = False):
        captures.append(keep_graph)
        return FakeGraph(fn), fn()
    monkeypatch.setattr(CG, "memcpy_runtime", lambda: FakeRuntime())
    monkeypatch.setattr(CG, "capture_graph", fake_capture)
    monkeypatch.setattr(StagingNodes, "from_graph", classmethod(lambda cls, rt, g, statics, ex: cls(rt, None, [])))
    out = torch.zeros(3)

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        out.copy_(x * 2)
        return [out]
    runner = CG.CudaGraphRunner(run, [torch.ones(3)], [], [False])
    # The graph that read the example in place was dropped: captured again without in-graph copies.
    assert captures == [True, False] and runner.staging is None
    assert torch.equal(runner((torch.full((3,), 5.0),))[0], torch.full((3,), 10.0))


# --- graph mode's borrowed inputs, on CPU tensors with stand-in graphs -------------------------

@pytest.fixture
def stand_in_graphs(monkeypatch) -> list[FakeGraph]:
    """Graph mode on CPU: 'capture' warms up and records a graph that re-runs the body on replay
    (as a CUDA graph re-runs its kernels on the same addresses); no in-graph staging nodes."""
    graphs: list[FakeGraph] = []

    class StandIn(FakeGraph):
        def __init__(self, fn: Callable[[], Any]) -> None:
            super().__init__(fn)
            self.outs = fn()

        def replay(self) -> None:  # a CUDA graph writes its outputs where capture put them
            for o, new in zip(self.outs, self.fn()):
                if isinstance(o, torch.Tensor) and o.data_ptr() != new.data_ptr():
                    o.copy_(new)

    def fake_capture(fn: Callable[[], Any], warmup: int = 3, pool: Any = None, keep_graph: bool = False):
        for _ in range(warmup):
            fn()
        graphs.append(StandIn(fn))
        return graphs[-1], graphs[-1].outs
    monkeypatch.setattr(CG, "memcpy_runtime", lambda: None)
    monkeypatch.setattr(CG, "capture_graph", fake_capture)
    return graphs


def _graph_exe(fn: Callable[..., Any], *args: Any) -> Any:
    from flowexec.executable import Executable

    return Executable(fn, "graph", "fast", {}).compile_for(*args)  # compile() itself wants CUDA


def _adam_like(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, ema: torch.Tensor) -> torch.Tensor:
    m.lerp_(g, 0.1)
    p.sub_(0.5 * m)
    ema.lerp_(p, 0.01)
    return (p * ema).sum()


def test_graph_mode_reads_the_inputs_it_writes_in_place(stand_in_graphs):
    torch.manual_seed(0)
    p, g, m, ema = (torch.randn(64) for _ in range(4))
    eager = [t.clone() for t in (p, g, m, ema)]
    exe = _graph_exe(_adam_like, p, g, m, ema)
    assert all(torch.equal(a, b) for a, b in zip((p, g, m, ema), eager))  # warm-up and capture undone
    bufs = exe.input_buffers
    assert bufs[0] is p and bufs[2] is m and bufs[3] is ema  # written in place: read where they are
    assert bufs[1] is not g  # read only, per-call: staged into the graph's own buffer
    for _ in range(3):
        grad = torch.randn(64)
        got = exe(p, grad, m, ema)
        want = _adam_like(eager[0], grad, eager[2], eager[3])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for mine, theirs in zip((p, m, ema), (eager[0], eager[2], eager[3])):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert len(stand_in_graphs) == 1 and exe._last.runner.graph_count == 1


def test_graph_mode_written_inputs_at_new_addresses_stay_correct(stand_in_graphs):
    """compile() given copies: a second graph borrows the real state; a third set of addresses
    runs on one graph that copies every input in and back, with a warning."""
    torch.manual_seed(1)
    sets = [[torch.randn(32) for _ in range(4)] for _ in range(3)]
    example = [t.clone() for t in sets[0]]
    untouched = [t.clone() for t in example]
    eager = [[t.clone() for t in s] for s in sets]
    exe = _graph_exe(_adam_like, *example)
    runner = exe._last.runner
    for k, (mine, theirs) in enumerate(zip(sets, eager)):
        for _ in range(2):
            grad = torch.randn(32)
            if k == 1 and runner.graph_count == 2:  # the third set of addresses: staged, said once
                with pytest.warns(flowexec.RecaptureWarning, match="copies them in"):
                    got = exe(mine[0], grad, mine[2], mine[3])
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    got = exe(mine[0], grad, mine[2], mine[3])
            torch.testing.assert_close(got, _adam_like(theirs[0], grad, theirs[2], theirs[3]), rtol=0, atol=0)
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert runner.graph_count == min(k + 2, 3)  # example's graph, the real state's, then staged
    assert all(torch.equal(a, b) for a, b in zip(example, untouched))
    # Back to an address with its own graph: no new capture.
    grad = torch.randn(32)
    got = exe(sets[0][0], grad, sets[0][2], sets[0][3])
    torch.testing.assert_close(got, _adam_like(eager[0][0], grad, eager[0][2], eager[0][3]), rtol=0, atol=0)
    torch.testing.assert_close(sets[0][2], eager[0][2], rtol=0, atol=0)
    assert len(stand_in_graphs) == 3


def test_graph_mode_borrow_option_reads_read_only_arguments_in_place(stand_in_graphs):
    torch.manual_seed(2)
    p, g, m, ema = (torch.randn(16) for _ in range(4))
    eager = [t.clone() for t in (p, g, m, ema)]
    from flowexec.executable import Executable

    exe = Executable(_adam_like, "graph", "fast", {"borrow": (1,)}).compile_for(p, g, m, ema)
    assert all(b is t for b, t in zip(exe.input_buffers, (p, g, m, ema)))  # nothing staged
    for _ in range(2):
        g.normal_()  # the same tensor, new values: the graph reads them where they are
        eager[1].copy_(g)
        torch.testing.assert_close(exe(p, g, m, ema), _adam_like(*eager), rtol=0, atol=0)
    assert exe._last.runner.graph_count == 1


def test_graph_mode_borrow_option_errors():
    from flowexec.executable import Executable

    with pytest.raises(flowexec.OptionError, match="graph"):
        flowexec.compile(_adam_like, *(torch.zeros(2) for _ in range(4)), borrow=(1,))
    with pytest.raises(flowexec.OptionError, match="borrow: 7 is not the position of a tensor argument"):
        Executable(lambda a, k: a.add_(k), "graph", "fast", {"borrow": (7,)}).compile_for(torch.zeros(2), 3)
    with pytest.raises(flowexec.OptionError, match="borrow: 1 is not"):
        Executable(lambda a, k: a.add_(k), "graph", "fast", {"borrow": (1,)}).compile_for(torch.zeros(2), 3)


# --- arguments that share memory, in graph mode ------------------------------------------------

def _scale_then_read(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    x.mul_(2)  # v may be a view of x: eager reads the doubled values through it
    return v + 1


@pytest.mark.parametrize("compiled_aliased", [True, False])
def test_graph_mode_arguments_sharing_storage_match_eager(stand_in_graphs, compiled_aliased):
    """A call passing ``x`` and ``x[2:]`` to a fn that writes ``x``: the graph's staged copies
    share one buffer laid out as the caller's, so the write shows through the view; a call
    sharing differently is another signature (captured again, with a warning)."""
    ex = torch.arange(6.0)
    exe = _graph_exe(_scale_then_read, *((ex, ex[2:]) if compiled_aliased else (ex, ex[2:].clone())))

    def check(x: torch.Tensor, v: torch.Tensor, expect_warning: bool) -> None:
        xe = x.clone()
        ve = xe[2:] if v._base is x else v.clone()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = exe(x, v)
        assert [w.category for w in seen] == ([flowexec.RecaptureWarning] if expect_warning else [])
        torch.testing.assert_close(got, _scale_then_read(xe, ve), rtol=0, atol=0)
        torch.testing.assert_close(x, xe, rtol=0, atol=0)

    x = torch.arange(6.0) * 3
    check(x, x[2:], expect_warning=not compiled_aliased)
    check(x, x[2:], expect_warning=False)  # the same pattern at the same address: no capture
    y = torch.arange(6.0) - 1
    check(y, y[2:], expect_warning=False)  # the same pattern elsewhere
    check(torch.arange(6.0), torch.arange(4.0) + 7, expect_warning=compiled_aliased)
    assert len(exe._cache) == 2


def test_graph_mode_staging_reproduces_the_callers_offsets(stand_in_graphs):
    """Views at other offsets of one buffer (same shapes) are a pattern of their own: a flat
    buffer split into parameters, written through both views, stays in a graph."""
    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        b.mul_(2)
        return a.sum() + b.sum()

    buf = torch.arange(8.0)
    exe = _graph_exe(step, buf[0:4], buf[4:8])  # apart
    for lo in (4, 2):
        mine = torch.arange(8.0) * 0.5
        theirs = mine.clone()
        want = step(theirs[0:4], theirs[lo:lo + 4])
        if lo == 2:
            with pytest.warns(flowexec.RecaptureWarning, match=r"argument 1 on argument 0's storage at \+8 bytes, "
                                                               r"compiled for argument 1 on argument 0's storage at \+16"):
                got = exe(mine[0:4], mine[lo:lo + 4])
        else:
            got = exe(mine[0:4], mine[lo:lo + 4])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        assert type(exe._last.runner).__name__ == "GraphVariants"  # still a graph


def test_graph_mode_argument_on_written_closure_state_runs_in_trace_mode(stand_in_graphs):
    p = torch.arange(4.0)
    pe = p.clone()

    def h(x: torch.Tensor) -> torch.Tensor:
        p.add_(1)  # closure state written in place; the argument may be a view of it
        return x * 2

    exe = _graph_exe(h, torch.zeros(3))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = exe(p[1:])
    said = [(w.category, str(w.message)) for w in seen]
    assert said[0][0] is flowexec.RecaptureWarning and "argument 0 on closure state's storage" in said[0][1]
    assert said[1][0] is UserWarning and "share memory with tensors fn uses from its closure" in said[1][1]
    assert len(said) == 2
    pe.add_(1)
    torch.testing.assert_close(got, pe[1:] * 2, rtol=0, atol=0)
    got = exe(p[1:])
    pe.add_(1)
    torch.testing.assert_close(got, pe[1:] * 2, rtol=0, atol=0)
    torch.testing.assert_close(p, pe, rtol=0, atol=0)
    got = exe(torch.ones(3))  # apart from the state: the graph
    pe.add_(1)
    torch.testing.assert_close(got, torch.full((3,), 2.0), rtol=0, atol=0)
    torch.testing.assert_close(p, pe, rtol=0, atol=0)


def test_staged_buffers_keep_layouts_flags_and_byte_offsets():
    m = torch.arange(12.0).view(3, 4)
    s, spans = CG.staged_buffers([m.t(), m[1], torch.zeros(2)], [0, 1, 2])
    assert torch.equal(s[0], m.t()) and s[0].stride() == (1, 4) and torch.equal(s[1], m[1])
    assert s[1].data_ptr() - s[0].data_ptr() == 16 and s[0].data_ptr() != m.data_ptr()
    assert [sp.members for sp in spans] == [(0, 1)] and s[2].data_ptr() != spans[0].static.data_ptr()
    s[0][1, 1] = -1.0  # element (1, 1) of the transpose is m[1, 1]: seen through the row view
    assert s[1][1] == -1.0 and m[1, 1] == 5.0
    x = torch.arange(4.0)
    s, _ = CG.staged_buffers([x.view(torch.uint8)[1:], x[1:]], [0, 1])  # a float32 view 3 bytes after a byte view
    assert torch.equal(s[1], x[1:]) and torch.equal(s[0], x.view(torch.uint8)[1:])
    c = torch.randn(4, dtype=torch.complex64)
    s, _ = CG.staged_buffers([c, c.conj(), torch._neg_view(c)], [0, 1, 2])  # lazy conj/neg are flags, kept
    assert s[1].is_conj() and s[2].is_neg() and torch.equal(s[1], c.conj()) and torch.equal(s[2], -c)


@pytest.mark.parametrize("make", [
    lambda x: (x, x),
    lambda x: (x, x[:1].expand(6)),
    lambda x: (x.view(torch.uint8)[4:], x[1:]),
    lambda x: (x, x[::2]),
], ids=["same tensor twice", "expanded view", "byte view", "strided view"])
def test_graph_mode_reads_arguments_sharing_storage(stand_in_graphs, make):
    """Read-only calls on arguments that share memory in every layout: the span is copied whole."""
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.float().sum() + b.float().sum() * 2

    exe = _graph_exe(f, *make(torch.arange(6.0)))
    for k in range(3):
        x = torch.randn(6) + k
        torch.testing.assert_close(exe(*make(x)), f(*make(x)), rtol=0, atol=0)
    assert len(exe._cache) == 1


def test_graph_mode_conjugate_view_arguments(stand_in_graphs):
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    c = torch.randn(4, dtype=torch.complex64)
    exe = _graph_exe(f, c, c.conj())
    for _ in range(2):
        c = torch.randn(4, dtype=torch.complex64)
        torch.testing.assert_close(exe(c, c.conj()), f(c, c.conj()), rtol=0, atol=0)


def test_runner_stages_shared_inputs_from_python(monkeypatch):
    """Members of a shared span never become memcpy nodes (overlapping copies would be nodes with
    equal addresses, which the node lookup cannot tell apart); the rest still may."""
    asked: list[set[int]] = []
    monkeypatch.setattr(CG, "memcpy_runtime", lambda: FakeRuntime())
    monkeypatch.setattr(CG, "capture_graph", lambda fn, warmup=3, pool=None, keep_graph=False: (FakeGraph(fn), fn()))
    monkeypatch.setattr(StagingNodes, "from_graph",
                        classmethod(lambda cls, rt, g, statics, ex: asked.append(set(statics)) or cls(rt, None, [])))
    x, other = torch.arange(6.0), torch.ones(3)
    CG.CudaGraphRunner(lambda a, b, c: [a + 1, b * 2, c - 1], [x, x[2:], other], [], [False] * 3)
    assert asked == [{2}]


def test_graph_mode_borrow_option_skips_arguments_sharing_storage(stand_in_graphs):
    from flowexec.executable import Executable

    def h(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.mul_(2)
        return b + 1

    x = torch.arange(6.0)
    with pytest.warns(UserWarning, match="borrow: argument 1 shares memory with another argument"):
        exe = Executable(h, "graph", "fast", {"borrow": (1,)}).compile_for(x, x[2:])
    y = torch.arange(6.0) * 3
    ye = y.clone()
    torch.testing.assert_close(exe(y, y[2:]), h(ye, ye[2:]), rtol=0, atol=0)
    torch.testing.assert_close(y, ye, rtol=0, atol=0)


def test_graph_mode_copies_back_into_parameters_written_under_no_grad(stand_in_graphs):
    def f(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p.sub_(0.1 * g)
        return g.sum()

    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(4)]
    want = [p.detach().clone() for p in ps]
    exe = _graph_exe(f, ps[0], torch.randn(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flowexec.RecaptureWarning)  # the fourth address is staged
        for p, w in zip(ps, want):
            g = torch.randn(4)
            exe(p, g)
            w.sub_(0.1 * g)
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=0)
    assert exe._last.runner.graph_count == 3


def test_input_buffers_after_the_trace_mode_fallback_says_why(stand_in_graphs):
    p = torch.arange(4.0)

    def h(x: torch.Tensor) -> torch.Tensor:
        p.add_(1)
        return x * 2

    exe = _graph_exe(h, torch.zeros(3))
    assert len(exe.input_buffers) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exe(p[1:])
    with pytest.raises(flowexec.OptionError, match="runs in trace mode"):
        exe.input_buffers
