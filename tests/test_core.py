"""flowexec.compile and the torch.compile backend against eager PyTorch: 3 training steps."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.models import Block, ConvNet, lm_loss, make_lm_step, make_mlp, make_step
from helpers import assert_close_rel, assert_rnn_trains_like_eager, assert_same_state, record_graph_programs, twin

torch.backends.mkldnn.enabled = True


def _cases():
    def mlp():
        torch.manual_seed(0)
        model = make_mlp(width=32, depth=3)
        data = [(torch.randn(8, 32), torch.randint(0, 10, (8,))) for _ in range(4)]
        return model, lambda ps: torch.optim.SGD(ps, lr=0.1), F.cross_entropy, data

    def block():
        torch.manual_seed(0)
        model = Block()
        data = [(torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))) for _ in range(4)]
        return model, lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True), lm_loss, data

    def cnn():
        torch.manual_seed(0)
        model = ConvNet()
        data = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(4)]
        return model, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), F.cross_entropy, data

    return {"mlp_sgd": mlp, "transformer_adam": block, "cnn_bn_momentum": cnn}


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_compile_matches_eager(name):
    model, make_opt, loss_fn, data = CASES[name]()
    (m1, o1), (m2, o2) = twin(model, make_opt)
    eager, mine = make_step(m1, o1, loss_fn), make_step(m2, o2, loss_fn)
    # Optimizer state (momentum, Adam moments) is created lazily: one eager step first on both.
    eager(*data[0]), mine(*data[0])
    exe = flowexec.compile(mine, *data[0])
    assert_same_state(m1, m2, tol=0)  # capture left no trace on the caller's state
    for x, y in data[1:]:
        assert_close_rel(exe(x, y), eager(x, y), what="loss")
    assert_same_state(m1, m2)
    for s1, s2 in zip(o1.state.values(), o2.state.values()):
        for k in s1:
            assert_close_rel(s2[k], s1[k], what=f"optimizer state {k}", floor=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_backend_matches_eager(name):
    torch._dynamo.reset()
    model, make_opt, loss_fn, data = CASES[name]()
    (m1, o1), (m2, o2) = twin(model, make_opt)
    eager = make_step(m1, o1, loss_fn)
    mine = make_step(torch.compile(m2, backend="flowexec", options={"mode": "trace"}), o2, loss_fn)
    for x, y in data[:3]:
        assert_close_rel(mine(x, y), eager(x, y), what="loss")
    assert_same_state(m1, m2)


def test_autograd_grad_step_with_set_to_none():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(make_mlp(16, 2), lambda ps: torch.optim.SGD(ps, lr=0.1))

    def step_for(m, o):
        def step(x, y):
            o.zero_grad(set_to_none=True)  # grads are created inside the step each time
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            return {"loss": loss, "logits_mean": m(x).mean()}
        return step

    data = [(torch.randn(4, 16), torch.randint(0, 10, (4,))) for _ in range(3)]
    eager, mine = step_for(m1, o1), step_for(m2, o2)
    exe = flowexec.compile(mine, *data[0])
    for x, y in data:
        got, want = exe(x, y), eager(x, y)
        assert set(got) == {"loss", "logits_mean"}
        assert_close_rel(got["loss"], want["loss"])
        assert_close_rel(got["logits_mean"], want["logits_mean"])
    assert_same_state(m1, m2)  # p.grad re-bound to this step's gradients


def test_functional_sgd_with_autograd_grad():
    torch.manual_seed(0)
    w = torch.randn(8, 4, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()

    def step(weight):
        def f(x):
            loss = (x @ weight).tanh().pow(2).mean()
            (g,) = torch.autograd.grad(loss, [weight])
            with torch.no_grad():
                weight.sub_(0.5 * g)
            return loss
        return f

    xs = [torch.randn(3, 8) for _ in range(3)]
    exe = flowexec.compile(step(w), xs[0])
    for x in xs:
        assert_close_rel(exe(x), step(w_ref)(x))
    assert_close_rel(w, w_ref)


def test_hf_causal_lm_through_backend():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    m1 = transformers.GPT2LMHeadModel(cfg)
    (m1, o1), (m2, o2) = twin(m1, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    torch._dynamo.reset()
    c2 = torch.compile(m2, backend="flowexec")

    step1, step2 = make_lm_step(m1, o1), make_lm_step(c2, o2)

    for _ in range(3):
        ids = torch.randint(0, 97, (2, 12))
        assert_close_rel(step2(ids), step1(ids), what="loss")
    assert_same_state(m1, m2)


def test_inference_forward_and_recapture_warning():
    torch.manual_seed(0)
    model = make_mlp(16, 2).eval()
    exe = flowexec.compile(model, torch.randn(4, 16))
    x = torch.randn(4, 16)
    assert_close_rel(exe(x), model(x))
    with pytest.warns(flowexec.RecaptureWarning, match=r"args\[0\]"):
        y = exe(torch.randn(6, 16))
    assert y.shape == (6, 10)



def test_strided_input_recaptures_instead_of_failing():
    fn = lambda x: x.reshape(-1) * 2  # noqa: E731  (make_fx records a view for a contiguous example)
    exe = flowexec.compile(fn, torch.randn(4, 6))
    xt = torch.randn(6, 4).t()  # same shape, not contiguous
    with pytest.warns(flowexec.RecaptureWarning, match="stride"):
        got = exe(xt)
    assert_close_rel(got, fn(xt))


class _FakeRunner:
    """Stands in for a captured CudaGraphRunner (CPU): it borrows the inputs at ``borrowed``
    where they were when captured, as the real one does."""

    def __init__(self, args, borrowed):
        self._borrowed = [(i, args[i].data_ptr()) for i in borrowed]
        self.replays = 0
        self.outputs = self  # saved_held(): whether the last call's saved tensors are held
        self.held = False
        self.checked = []  # saved_checked per call: True skips moving held saved tensors

    def moved(self, args):
        return [i for i, ptr in self._borrowed if args[i].data_ptr() != ptr]

    def matches(self, args):
        return not self.moved(args)

    def saved_held(self):
        return self.held

    def __call__(self, args, saved_checked=False):
        assert not (saved_checked and self.held), "a busy graph's held saved tensors would be overwritten"
        self.replays += 1
        self.checked.append(saved_checked)
        return ["replayed"]


def _fake_graph_program(monkeypatch, cache_size=8, saved_from=None):
    """A GraphProgram of ``a * b`` whose captures make stand-in runners that borrow what the real
    capture borrows: AOTAutograd-static inputs and stable ones (parameters, graph outputs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from flowexec.backend import GraphProgram
    from flowexec.storage import is_stable

    a, b = torch.randn(3), torch.randn(3)
    gp = GraphProgram(make_fx(lambda a, b: (a * b,))(a, b), [a, b], "graph", "fast", 1, cache_size=cache_size,
                      saved_from=saved_from)
    captures = []

    def capture(args):
        captures.append(_FakeRunner(args, [i for i, t in enumerate(args) if i in gp.static_idx or is_stable(t)]))
        return captures[-1]

    monkeypatch.setattr(gp, "_capture", capture)
    return gp, captures


def test_graph_program_stages_one_call_copies_and_captures_again_for_parameters(monkeypatch):
    """A graph-mode program whose borrowed inputs moved: one-call copies (a micro-batch's saved
    tensors moved out of another graph's buffers) run on a second graph that copies them in,
    captured once and silently, the first graph kept for calls that find them in place. A
    parameter at a new address gets a graph of its own, with a warning."""
    import warnings

    from flowexec.storage import mark_stable

    gp, captures = _fake_graph_program(monkeypatch, cache_size=1)
    a, b = torch.randn(3), torch.randn(3)
    mark_stable(b)  # b stands for another graph's output: borrowed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gp(a, b) == ["replayed"] and len(captures) == 1  # the first call captures, silently
        kept = captures[0]
        assert gp(a, b.clone()) == ["replayed"]  # b moved, and the copy is a plain tensor
        assert gp(a, b.clone()) == ["replayed"]
    assert len(captures) == 2 and captures[1].replays == 2 and gp.staged_calls == 2
    assert gp.graph_runner is kept and gp.staging_runners == [captures[1]]
    assert gp(a, b) == ["replayed"] and kept.replays == 2  # in place again: the first graph

    p = torch.nn.Parameter(torch.randn(3))  # the moved input is a parameter: it moved for good
    mark_stable(p)
    with pytest.warns(flowexec.RecaptureWarning, match=r"input 1 \w+ \(3,\) \(a parameter\) of this forward graph.*capturing the "
                      r"graph again for them \(1 graph\(s\) kept, cache_size=1, the least recently"):
        assert gp(a, p) == ["replayed"]
    assert len(captures) == 3 and gp.graph_runners == [captures[2]]
    # A copy of p is a one-call copy for p's graph; the staging graph (it borrows nothing) runs it.
    assert gp(a, p.detach().clone()) == ["replayed"] and captures[1].replays == 3 and len(captures) == 3

    gp.static_idx = {1}  # an input AOTAutograd marks static moves for good too
    with pytest.warns(UserWarning, match=r"input 1 \w+ \(3,\) \(static for AOTAutograd\).*capturing the graph again"):
        gp(a, torch.randn(3))
    assert len(captures) == 4


def test_graph_program_drops_the_least_recently_used_staging_graph(monkeypatch):
    """Staging graphs are kept like the others: one-call copies that no kept staging graph
    serves (it borrows another parameter) get a new one, the least recently used dropped past
    cache_size, and the result is the replayed graph's."""
    from flowexec.storage import mark_stable

    gp, captures = _fake_graph_program(monkeypatch, cache_size=1)
    a, b = torch.randn(3), torch.randn(3)
    mark_stable(b)
    gp(a, b)
    old = _FakeRunner([torch.randn(3), torch.randn(3)], [0])  # borrows another a
    gp.staging_runners = [old]
    assert gp(a, b.clone()) == ["replayed"]
    assert gp.staging_runners == [captures[1]] and old.replays == 0 and gp.staged_calls == 1 and gp.dropped == 1


def test_graph_program_keeps_a_graph_per_set_of_parameter_addresses(monkeypatch):
    """Dynamo shares one compiled graph between modules of one class: two parameter sets taking
    turns capture once each and then replay their own graphs; past cache_size the least recently
    used graph is dropped (said in the warning) and captured again when its addresses return."""
    import warnings

    gp, captures = _fake_graph_program(monkeypatch, cache_size=2)
    a = torch.randn(3)
    p1, p2, p3 = (torch.nn.Parameter(torch.randn(3)) for _ in range(3))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            gp(a, p1)
            gp(a, p2)
    assert len(captures) == 2 and len(said) == 1  # p2's graph is the one capture warned about
    assert [r.replays for r in captures] == [3, 3] and gp.graph_runners == [captures[1], captures[0]]

    with pytest.warns(UserWarning, match=r"2 graph\(s\) kept, cache_size=2, the least recently used dropped"):
        gp(a, p3)
    assert gp.graph_runners == [captures[2], captures[1]]  # p1's graph went
    gp(a, p2)
    assert len(captures) == 3 and captures[1].replays == 4
    with pytest.warns(UserWarning, match="least recently used dropped"):
        gp(a, p1)
    assert len(captures) == 4 and gp.graph_runners == [captures[3], captures[1]]


def test_backend_saved_tensors_start_after_mutations_outputs_and_bases(monkeypatch):
    """``saved_from`` (where the forward's saved tensors begin among its outputs) on a forward
    that also returns mutated inputs (BatchNorm's running statistics), several user outputs and
    views of them: the outputs from there on are exactly the backward's non-tangent inputs."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)

        def forward(self, x):
            h = torch.relu(self.bn(self.lin(x)))
            return h, h.view(-1), h.t()

    made = record_graph_programs(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    c = torch.compile(Net().train(), backend="flowexec", options={"mode": "trace"})
    h, flat, ht = c(torch.randn(4, 8))
    (h.sum() + flat.pow(2).sum() + ht.mean()).backward()
    (fw, _, fw_outs), (bw, bw_names, _) = made
    assert fw.saved_from is not None and fw.saved_from > 3  # after 3 running-stat writes and the outputs
    assert fw_outs[fw.saved_from:] == [n for n in bw_names if not n.startswith("tangents")], (fw.saved_from, fw_outs, bw_names)


def test_backend_static_inputs_are_the_forwards_own(monkeypatch):
    """AOTAutograd's static input indices belong to the forward graph; the backward, compiled
    while the tracing context still holds them, must not take them as its own. It did: saved
    activations (and, in other shapes, the tangent) became "static", so in graph mode a backward
    whose saved tensors were moved (micro-batches) captured again instead of running a trace."""
    made = record_graph_programs(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    c = torch.compile(make_mlp(16, 2), backend="flowexec", options={"mode": "trace"})
    F.cross_entropy(c(torch.randn(4, 16)), torch.randint(0, 10, (4,))).backward()
    (fw, fw_names, _), (bw, bw_names, _) = made
    assert bw.forward is fw
    # The forward's static inputs are its parameters; the input batch (primals_3) is not.
    assert fw.static_idx == {i for i, n in enumerate(fw_names) if n != "primals_3"}, (fw_names, fw.static_idx)
    # The backward reads saved tensors and the tangent: activations and per-call tensors, none
    # static (its parameters, where it reads any, are borrowed by address: is_stable).
    assert bw.static_idx == set(), (bw_names, bw.static_idx)
    # The forward's outputs: the logits, then the tensors saved for backward, which the backward
    # reads (with its tangent).
    assert fw.saved_from == 1 and bw.saved_from is None
    n_saved = len(fw.plan.program.outputs) - fw.saved_from
    assert n_saved == sum(not n.startswith("tangents") for n in bw_names), (n_saved, bw_names)


def test_stable_address_needs_its_owner_still_there():
    """An address counts as stable while the tensor recorded for it still holds it: an alias
    moved by outputs.py (``.data = clone``) must not vouch for its old address, which may be freed
    and handed to a per-call tensor (that one was then borrowed, moved, and captured again)."""
    from flowexec.storage import is_stable, mark_stable

    alias = torch.zeros(4)
    old = alias.untyped_storage()
    mark_stable(alias)
    assert is_stable(torch.empty(0).set_(old))
    alias.data = alias.clone()  # moved: its old memory is someone else's now
    assert not is_stable(torch.empty(0).set_(old))
    assert not is_stable(alias)  # nor is it stable where it went

    buf = torch.zeros(4)
    mark_stable(buf)
    view = buf.detach()
    mark_stable(view)  # a borrowed alias of a live buffer does not replace the buffer's record
    view.data = view.clone()
    assert is_stable(buf)


def test_forward_with_saved_tensors_in_flight_gets_a_graph_of_its_own(monkeypatch):
    """GPipe order: a forward called while the saved tensors of its graph's last call are held
    (that micro-batch's backward has not run) replays a kept graph whose saved tensors are free,
    or captures one, silently; with no room it replays a busy one (whose held outputs the real
    runner moves to private memory first)."""
    import warnings

    gp, captures = _fake_graph_program(monkeypatch, cache_size=2, saved_from=1)
    a, b = torch.randn(3), torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gp(a, b)
        captures[0].held = True  # micro-batch 1 waits for its backward
        gp(a, b)
        assert len(captures) == 2 and gp.graph_runner is captures[1]
        captures[1].held = True
        gp(a, b)  # both busy, no room: the busy graph used last runs it
        assert len(captures) == 2 and captures[1].replays == 2 and captures[0].replays == 1
        captures[0].held = captures[1].held = False  # the backwards ran
        gp(a, b)
        captures[1].held = True
        gp(a, b)  # the other kept graph is free
        assert len(captures) == 2 and captures[0].replays == 2 and gp.graph_runner is captures[0]
    # A new graph's first call, and the busy graph's call, move whatever is held (False); a free
    # graph's call was checked just before (True).
    assert captures[0].checked == [False, True] and captures[1].checked == [False, False, True]


def test_full_cache_drops_an_idle_graph_before_copying_saved_tensors(monkeypatch):
    """With cache_size graphs kept, a forward whose own graph is busy drops the least recently
    used graph that is idle (another parameter set's) to capture one, instead of copying."""
    from flowexec.storage import mark_stable

    gp, captures = _fake_graph_program(monkeypatch, cache_size=2, saved_from=1)
    a = torch.randn(3)
    p1, p2 = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    for p in (p1, p2):
        mark_stable(p)
    gp(a, p1)
    with pytest.warns(UserWarning, match="a parameter"):
        gp(a, p2)
    captures[1].held = True  # p2's micro-batch waits for its backward
    gp(a, p2)
    assert gp.graph_runners == [captures[2], captures[1]] and gp.dropped == 1  # p1's graph went


def test_new_saved_tensors_for_known_parameters_capture_silently(monkeypatch):
    """Two modules of one class share a backward graph: a call with the first module's
    parameters and another micro-batch's saved tensors (stable: another graph's outputs) moved
    no parameter for good, whichever graph ran last, so its graph is captured without a warning."""
    import warnings

    from flowexec.storage import mark_stable

    gp, captures = _fake_graph_program(monkeypatch)
    p1, p2 = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    s1, s2, s3 = torch.randn(3), torch.randn(3), torch.randn(3)
    for t in (p1, p2, s1, s2, s3):
        mark_stable(t)
    gp(p1, s1)
    with pytest.warns(UserWarning, match=r"input 0 \w+ \(3,\) \(a parameter\)"):
        gp(p2, s2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gp(p1, s3)
    assert len(captures) == 3


def test_capture_leaves_make_fx_metadata_alone_elsewhere() -> None:
    """A capture stores each value's fake metadata itself (no ``tensor_meta`` copy); make_fx run
    outside a capture afterwards still records torch's own ``val`` and ``tensor_meta``, and the
    captured program's values carry the real tensors' dtypes, shapes, strides and devices."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from flowexec.capture import capture

    x = torch.randn(3, 4)
    prog = capture(lambda x: (x.t() * 2).sum(0), (x,)).program
    t = x.t()
    want = [(tuple(v.shape), v.stride()) for v in (t, t * 2, (t * 2).sum(0))]  # as eager makes them
    assert [(v.meta.shape, v.meta.stride) for v in prog.values if v.meta is not None][1:] == want
    gm = make_fx(lambda x: (x.t() * 2).sum(0))(x)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert "tensor_meta" in node.meta and node.meta["val"].shape == node.meta["tensor_meta"].shape


def test_a_capture_s_values_made_on_another_thread_take_its_fake_mode() -> None:
    """The autograd engine runs a CUDA backward's ops on a thread of its own: while one capture
    is under way, a value made inside a backward on any thread takes that capture's fake mode
    directly (no fake mode of its own, which cost ~2 ms a value); with two under way a thread
    outside both cannot tell whose it is, and torch's own path makes the value."""
    import threading

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental import proxy_tensor

    from flowexec.capture import _direct_fake_metas

    def made_elsewhere() -> FakeTensor:
        """A value made inside a backward on another thread (as the engine's device thread makes one)."""
        box = []

        class Made(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                box.append(proxy_tensor.extract_val(torch.ones(2, 3).t()))
                return g

        th = threading.Thread(target=lambda: Made.apply(torch.ones(1, requires_grad=True)).sum().backward())
        th.start()
        th.join(timeout=30)
        return box[0]

    mode, other = FakeTensorMode(), FakeTensorMode()
    with _direct_fake_metas(mode):
        val = made_elsewhere()
        assert isinstance(val, FakeTensor) and val.fake_mode is mode
        assert (val.shape, val.stride(), val.device) == ((3, 2), (1, 3), torch.device("cpu"))
        entered, leave = threading.Event(), threading.Event()

        def second_capture() -> None:
            with _direct_fake_metas(other):
                entered.set()
                leave.wait(timeout=30)
        th = threading.Thread(target=second_capture)
        th.start()
        assert entered.wait(timeout=30)
        try:
            val = made_elsewhere()
            assert isinstance(val, FakeTensor) and val.fake_mode not in (mode, other)
        finally:
            leave.set()
            th.join(timeout=30)
    val = made_elsewhere()  # no capture under way: torch's path
    assert isinstance(val, FakeTensor) and val.fake_mode is not mode


def test_a_make_fx_on_another_thread_keeps_its_own_fake_mode() -> None:
    """While a capture is under way, another thread's own make_fx (outside any backward) keeps
    the fake mode of its own tracing context: the capture's mode is for a backward's values."""
    import threading

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from flowexec.capture import _direct_fake_metas

    capture_mode, mine = FakeTensorMode(), FakeTensorMode()
    box: list = []

    def other_thread() -> None:
        try:
            with torch._guards.tracing(torch._guards.TracingContext(mine)):
                gm = make_fx(lambda x: x * 2)(torch.randn(3))
            box.append([n.meta["val"].fake_mode for n in gm.graph.nodes if n.op == "call_function"])
        except BaseException as e:  # (reported below)
            box.append(e)

    with _direct_fake_metas(capture_mode):  # one capture under way on this thread
        th = threading.Thread(target=other_thread)
        th.start()
        th.join(timeout=60)
    modes = box[0]
    assert not isinstance(modes, BaseException), modes
    assert modes and all(m is mine for m in modes), "the other thread's values took the capture's fake mode"


WRITES_THROUGH_VIEWS = {
    "flat view, slice": lambda buf, x: buf.view(-1)[:2].add_(x.sum()),
    "row slice": lambda buf, x: buf[0, :2].mul_(2),
    "transposed row": lambda buf, x: buf.t()[1].copy_(x),
    "index_put_ on a view": lambda buf, x: buf.view(-1).index_put_((torch.tensor([3, 5]),), x[:2], accumulate=True),
}


@pytest.mark.parametrize("write", list(WRITES_THROUGH_VIEWS), ids=list(WRITES_THROUGH_VIEWS))
def test_a_write_to_state_through_a_view_the_step_made_lands_once_a_call(write):
    """The capture runs the step for real and undoes its writes to tensors that existed before.
    A view the step makes of such a tensor is new, but its memory is not: a write through it
    was not undone, and the first call applied it twice."""
    fn = WRITES_THROUGH_VIEWS[write]
    bufs = [torch.arange(16, dtype=torch.float32).reshape(4, 4) for _ in range(2)]

    def step_of(buf):
        def step(x):
            fn(buf, x)
            return (buf * x[0]).sum()
        return step

    eager, exe = step_of(bufs[0]), flowexec.compile(step_of(bufs[1]))
    for k in range(3):
        x = torch.full((4,), float(k + 1))
        assert exe(x).item() == eager(x).item(), f"call {k}"
        assert torch.equal(bufs[1], bufs[0]), f"call {k}: {bufs[1]} against {bufs[0]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["trace", "threaded"])
def test_a_two_layer_lstm_trains_like_eager(mode: str) -> None:
    """The CPU LSTM's forward (``mkldnn_rnn_layer``) makes the workspace its backward reads only
    with grad mode on, which a program runs without: its backward failed on a missing tensor."""
    torch.manual_seed(0)
    assert_rnn_trains_like_eager(torch.nn.LSTM(8, 16, num_layers=2, batch_first=True), mode=mode,
                                 streams=2 if mode == "threaded" else 1)


def test_torch_func_transforms_inside_fn_capture() -> None:
    """torch.func's grad refuses to run under saved-tensor hooks, which the capture used to tell
    tensors an autograd graph saved from state fn left behind: it captures again without them."""
    from torch.func import grad, vmap

    w = torch.randn(8, 3)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (x @ w).square().sum()

    def per_sample_norms(x: torch.Tensor) -> torch.Tensor:
        return vmap(grad(loss), in_dims=(None, 0))(w, x).norm(dim=(1, 2))

    x = torch.randn(5, 8)
    exe = flowexec.compile(per_sample_norms, x)
    torch.testing.assert_close(exe(x), per_sample_norms(x))


def test_a_transformer_encoder_s_nested_fast_path_is_named_where_capture_cannot_take_it() -> None:
    """In eval with a padding mask, eager runs nn.TransformerEncoder through nested tensors and
    returns zeros at the padded positions; under capture (as under torch.compile) torch takes its
    other path, which computes them: said, and equal to eager elsewhere and with
    enable_nested_tensor=False."""
    import warnings

    torch.manual_seed(0)
    x, mask = torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False, False, False, True, True]])
    for nested in (True, False):
        enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
                                          enable_nested_tensor=nested).eval()

        def f(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return enc(x, src_key_padding_mask=mask)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exe = flowexec.compile(f, x, mask)
        said = [w for w in caught if "nested-tensor fast path" in str(w.message)]
        assert bool(said) == nested
        got, want = exe(x, mask), f(x, mask)
        kept = ~mask.unsqueeze(-1).expand_as(want) if nested else torch.ones_like(want, dtype=torch.bool)
        torch.testing.assert_close(got[kept], want[kept])


@pytest.mark.parametrize("mode", ["trace", "threaded"])
def test_an_op_returning_lists_inside_a_tuple_is_unpacked(mode: str) -> None:
    """An op whose results are a tuple holding lists (cuDNN's RNN backward: ``(dx, dhx, dcx,
    dw[])``; here the functional fused Adam's five lists) runs as one op of a flat list
    (flowexec/list_returns.py): the program's ops unpack one level, and the capture failed with
    "unsupported call 'getitem'"."""
    def f(p, g, m, v):
        steps = [torch.ones(()) for _ in p]
        out = torch.ops.aten._fused_adam.default(p, g, m, v, [], steps, lr=0.1, beta1=0.9, beta2=0.99,
                                                 weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        return out[0][1] * 2, out[2][0] + out[3][0], out[4]

    gen = torch.Generator().manual_seed(0)
    args = [[torch.rand(3, generator=gen), torch.rand(4, generator=gen)] for _ in range(4)]
    exe = flowexec.compile(f, mode=mode)
    for _ in range(2):
        got, want = exe(*args), f(*args)
        torch.testing.assert_close(got[:2], want[:2])
        assert got[2] == want[2] == []
    assert any(op.target.name().startswith("flowexec::flat_aten__fused_adam") for op in exe.plan.program.ops)
