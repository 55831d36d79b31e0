"""Core run modes on CUDA against eager (run on the lent GPU; skipped without CUDA)."""
from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.models import make_lm_step, make_mlp, make_step

from helpers import assert_close_rel, assert_same_state, assert_seeded_calls_match, block_adam_twins, twin

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def sgd_twins(depth: int):
    """Two identical MLPs (64 wide) on CUDA with their SGD training steps."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(make_mlp(64, depth).cuda(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    return m1, m2, make_step(m1, o1, F.cross_entropy), make_step(m2, o2, F.cross_entropy)


@pytest.mark.parametrize("mode", ["trace", "graph"])
def test_mlp_step_matches_eager(mode):
    m1, m2, s1, s2 = sgd_twins(depth=3)
    data = [(torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")) for _ in range(3)]
    exe = flowexec.compile(s2, *data[0], mode=mode)
    assert_same_state(m1, m2, tol=0)  # neither capture nor graph warm-up changed the state
    kept = []
    for x, y in data:
        got = exe(x, y)
        kept.append((got, got.clone()))
        assert_close_rel(got, s1(x, y))
    assert_same_state(m1, m2)
    for got, snapshot in kept:  # outputs held across calls were not overwritten
        assert torch.equal(got, snapshot)


def test_block_adam_graph_matches_eager():
    # capturable=True on both (block_adam_twins): eager then computes bias corrections on the
    # device, as the captured program does (the non-capturable eager path uses host floats).
    m1, m2, s1, s2, data = block_adam_twins(4)
    exe = flowexec.compile(s2, *data[0], mode="graph")
    for x, y in data[1:]:
        assert_close_rel(exe(x, y), s1(x, y))
    assert_same_state(m1, m2, tol=1e-5)


def test_graph_mode_copies_back_mutated_inputs():
    def f(buf, x):
        buf.add_(x)
        return buf.sum()

    b1, b2 = torch.zeros(8, device="cuda"), torch.zeros(8, device="cuda")
    exe = flowexec.compile(f, b2.clone(), torch.ones(8, device="cuda"), mode="graph")
    for i in range(3):
        x = torch.full((8,), float(i + 1), device="cuda")
        assert_close_rel(exe(b2, x), f(b1, x))
    assert torch.equal(b1, b2)


@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("mode", ["trace", "graph"])
def test_hf_gpt2_backend_matches_eager(mode, streams):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    m1 = transformers.GPT2LMHeadModel(cfg).cuda()
    m2 = copy.deepcopy(m1)
    o1, o2 = torch.optim.AdamW(m1.parameters(), lr=1e-3), torch.optim.AdamW(m2.parameters(), lr=1e-3)
    torch._dynamo.reset()
    # (the graphs as captured: the backend with fusion has tests/gpu/test_fuse_gpu.py, whose
    # Triton kernels round otherwise than eager's, as AdamW magnifies on zero-initialised biases)
    c2 = torch.compile(m2, backend="flowexec", options={"mode": mode, "streams": streams, "fuse": False})

    step1, step2 = make_lm_step(m1, o1), make_lm_step(c2, o2)

    for _ in range(3):
        ids = torch.randint(0, 211, (2, 16), device="cuda")
        assert_close_rel(step2(ids), step1(ids), tol=1e-5, what="loss")
    assert_same_state(m1, m2, tol=1e-4)


@pytest.mark.parametrize("mode", ["trace", "graph"])
def test_fetch_handles_on_cuda(mode):
    m1, m2, s1, s2 = sgd_twins(depth=2)
    data = [(torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")) for _ in range(10)]
    exe = flowexec.compile(s2, *data[0], mode=mode, fetch=[0], fetch_slots=3)
    handles = [exe(x, y) for x, y in data]
    want = [s1(x, y).item() for x, y in data]
    assert [h.result() for h in handles] == pytest.approx(want, rel=1e-5)


def test_graph_input_buffers_skip_staging_and_stay_correct():
    w = torch.randn(16, 16, device="cuda")
    exe = flowexec.compile(lambda a, b: (a @ w + b).relu(), torch.randn(4, 16, device="cuda"),
                           torch.randn(4, 16, device="cuda"), mode="graph")
    ba, bb = exe.input_buffers
    for _ in range(3):
        a, b = torch.randn(4, 16, device="cuda"), torch.randn(4, 16, device="cuda")
        ba.copy_(a), bb.copy_(b)
        assert_close_rel(exe(ba, bb), (a @ w + b).relu())
        a2 = torch.randn(4, 16, device="cuda")
        assert_close_rel(exe(a2, b), (a2 @ w + b).relu())  # other tensors are staged in


def test_graph_mode_fuses_lerp_where_measured_faster_and_matches_eager():
    def f(x, y, w, ema):
        ema.lerp_(y, w)        # broadcast weight: rewritten by default
        ema.lerp_(x, 0.1)      # every operand full-size: ATen's kernel ties, left alone
        return torch.lerp(torch.lerp(x, y, 0.3), y, w).square().mean()

    args = (torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda"),
            torch.rand(1024, device="cuda"), torch.randn(1024, 1024, device="cuda"))
    exe = flowexec.compile(f, *(a.clone() for a in args), mode="graph")
    names = [op.name for op in exe.program.ops]
    assert names.count("flowexec.lerp.default") == 1 and names.count("aten.lerp.Scalar") == 1
    assert names.count("flowexec.lerp_.default") == 1 and names.count("aten.lerp_.Scalar") == 1
    for _ in range(3):
        new = tuple(torch.randn_like(a) for a in args)
        mine, theirs = new[3].clone(), new[3].clone()
        assert_close_rel(exe(*new[:3], mine), f(*new[:3], theirs))
        assert_close_rel(mine, theirs)


def test_graph_staging_nodes_follow_every_kind_of_input():
    """In-graph copies of a per-call input (the program's own copy, passes/copy_in.py, where it
    qualifies; else a staging node): new addresses, the same address, the input buffer, a
    strided input."""
    w = torch.randn(8, 8, device="cuda")
    exe = flowexec.compile(lambda x: (x @ w).relu(), torch.randn(4, 8, device="cuda"), mode="graph")
    runner = exe._last.runner.first
    nodes = runner.copy_in if runner.copy_in is not None else runner.staging
    if nodes is None:
        pytest.skip("cuda-bindings is not installed: inputs are staged from Python")
    assert nodes.index == [0] and runner.copy_in is not None  # x is read by the product alone: copied in
    x = torch.randn(4, 8, device="cuda")
    for _ in range(2):  # new address, then the same address with new contents
        assert_close_rel(exe(x), (x @ w).relu())
        x.normal_()
    buf = exe.input_buffers[0]
    buf.copy_(x)
    assert_close_rel(exe(buf), (x @ w).relu())  # the node reads the buffer
    big = torch.randn(4, 16, device="cuda")
    strided = big[:, ::2]  # same shape, other strides: a new signature is captured
    with pytest.warns(flowexec.RecaptureWarning):
        assert_close_rel(exe(strided), (strided @ w).relu())
    y = torch.randn(4, 8, device="cuda")
    assert_close_rel(exe(y), (y @ w).relu())  # back to the first signature, re-pointed again
    assert_close_rel(exe(x), (x @ w).relu())


def test_backend_gradients_are_adopted_and_survive_accumulation():
    """Backward graphs hand grads to AccumulateGrad without copies; accumulation stays exact."""
    torch.manual_seed(0)
    m1 = make_mlp(64, 2).cuda()
    m2 = copy.deepcopy(m1)
    c2 = torch.compile(m2, backend="flowexec", options={"mode": "graph"})
    data = [(torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")) for _ in range(6)]
    for step, (x, y) in enumerate(data):
        if step % 3 == 0:  # accumulate over three micro-batches, then start over
            for p in (*m1.parameters(), *m2.parameters()):
                p.grad = None
        F.cross_entropy(m1(x), y).backward()
        F.cross_entropy(c2(x), y).backward()
        assert_same_state(m1, m2)
    for p in m2.parameters():
        p.grad = None
    F.cross_entropy(c2(data[0][0]), data[0][1]).backward()  # the grads are the graph's buffers again
    kept = [p.grad for p in m2.parameters()]  # a reference nobody can find: the user is told
    for p in m2.parameters():
        p.grad = None
    with pytest.warns(RuntimeWarning, match="clone gradients you keep"):
        F.cross_entropy(c2(data[0][0]), data[0][1]).backward()
    del kept


def test_backend_gradients_avoid_accumulate_grad_copies():
    torch.manual_seed(0)
    m = make_mlp(64, 2).cuda()
    c = torch.compile(m, backend="flowexec", options={"mode": "graph"})
    x, y = torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    for _ in range(3):
        for p in m.parameters():
            p.grad = None
        F.cross_entropy(c(x), y).backward()
    from flowexec.storage import _STABLE
    adopted = [p.grad.data_ptr() in _STABLE for p in m.parameters()]
    assert all(adopted), adopted


def test_backend_graph_two_modules_of_one_class_take_turns():
    """Dynamo may share one compiled graph between two modules of one class (their parameters
    are graph inputs): each parameter set gets a graph of its own, captured once, and the steps
    taking turns match eager — gradients accumulated over two micro-batches included, whose
    .grad the other module's backward must not overwrite."""
    from flowexec.backend import GraphProgram

    torch._dynamo.reset()  # earlier tests' modules of this class would hold graphs of their own
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) is GraphProgram}
    torch.manual_seed(0)
    eager = [make_mlp(64, 2).cuda() for _ in range(2)]
    mine = [copy.deepcopy(m) for m in eager]
    compiled = [torch.compile(m, backend="flowexec", options={"mode": "graph"}) for m in mine]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (*eager, *mine)]
    data = [(torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")) for _ in range(2)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(3):
            for k in range(2):
                for model, opt in ((eager[k], opts[k]), (compiled[k], opts[2 + k])):
                    for x, y in data:  # two micro-batches, gradients accumulated
                        F.cross_entropy(model(x), y).backward()
                    if step < 2:
                        opt.step()
                        opt.zero_grad()
    for e, m in zip(eager, mine):
        assert_same_state(e, m)  # parameters after two steps, and the third step's gradients
    recaptured = [str(w.message) for w in said if "capturing the graph again" in str(w.message)]
    forwards = [o for o in gc.get_objects() if type(o) is GraphProgram and id(o) not in before and o.forward is None]
    # One graph per module either way; where Dynamo shared the program (seen on torch 2.11), the
    # second module's parameters were said once by the forward (its backward's new addresses
    # are graph outputs and parameter views, captured silently on torch 2.13's partition; a
    # backward that reads a parameter itself says so too).
    assert sum(len(f.graph_runners) for f in forwards) == 2, [len(f.graph_runners) for f in forwards]
    if len(forwards) == 1:
        assert 1 <= len(recaptured) <= 2 and "forward graph" in recaptured[0], recaptured
    else:
        assert not recaptured


def _adam_like(p, g, m, v, ema):
    m.lerp_(g, 0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)
    p.sub_(1e-2 * m / (v.sqrt() + 1e-8))
    ema.lerp_(p, 0.01)
    return (p * ema).sum()


def test_graph_mode_reads_state_arguments_in_place():
    """Arguments the step writes are read where they are (no copies in or back); a second set of
    addresses gets a second graph, a third runs staged (said once); every call matches eager."""
    import warnings

    torch.manual_seed(0)
    sets = [[torch.randn(4096, device="cuda") for _ in range(3)] + [torch.rand(4096, device="cuda"),
                                                                     torch.randn(4096, device="cuda")] for _ in range(3)]
    eager = [[t.clone() for t in s] for s in sets]
    exe = flowexec.compile(_adam_like, *sets[0], mode="graph", fuse=False)  # (eager's kernels: tol 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(sets[0], eager[0]))  # warm-up and capture undone
    bufs = exe.input_buffers
    assert all(bufs[i] is sets[0][i] for i in (0, 2, 3, 4)) and bufs[1] is not sets[0][1]
    runner = exe._last.runner
    said = []
    for call, k in enumerate((0, 0, 1, 1, 2, 2, 0, 1)):
        grad = torch.randn(4096, device="cuda")
        mine, theirs = sets[k], eager[k]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = exe(mine[0], grad, *mine[2:])
        said += [call for w in seen if "copies them in" in str(w.message)]
        assert_close_rel(got, _adam_like(theirs[0], grad, *theirs[2:]), tol=1e-6)
        for a, b in zip(mine, theirs):
            assert_close_rel(a, b, tol=1e-6)
    assert said == [4] and runner.graph_count == 3


@pytest.mark.parametrize("depth,cache_size", [(2, 8), (3, 8), (2, 1)])
def test_backend_graph_two_forwards_then_two_backwards(depth, cache_size):
    """Micro-batches whose forwards all run before their backwards: each replay overwrites the
    static buffers that the previous forward's saved tensors live in (its activations, and its
    input, staged into the graph's buffer: unprotected until d340c67, which made the first
    layer's weight gradient wrong), unless they are moved first. The gradients must be eager's,
    over two such steps (gradients accumulated). With room for one graph only, the forward moves
    the saved tensors and a staging graph copies them in for the backward."""
    from flowexec.backend import GraphProgram

    torch._dynamo.reset()
    gc.collect()
    # type(): gc also lists dead weak proxies, whose isinstance raises
    before = {id(o) for o in gc.get_objects() if type(o) is GraphProgram}
    torch.manual_seed(0)
    m1 = make_mlp(64, depth).cuda()
    m2 = copy.deepcopy(m1)
    c2 = torch.compile(m2, backend="flowexec", options={"mode": "graph", "cache_size": cache_size})
    data = [(torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")) for _ in range(3)]
    F.cross_entropy(c2(data[0][0]), data[0][1]).backward()  # compile and capture first
    for p in (*m1.parameters(), *m2.parameters()):
        p.grad = None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for m in (m1, c2):
            for _ in range(2):
                losses = [F.cross_entropy(m(x), y) for x, y in data]  # every forward first
                for loss in losses:
                    loss.backward()
    assert_same_state(m1, m2)
    # Each micro-batch in flight ran on a forward graph of its own, so no saved tensor was copied,
    # and each backward replayed the graph that reads that forward's buffers in place.
    assert not [w for w in said if "capturing the graph again" in str(w.message)]
    (fw,) = [o for o in gc.get_objects() if type(o) is GraphProgram and id(o) not in before and o.forward is None]
    (bw,) = [o for o in gc.get_objects() if type(o) is GraphProgram and id(o) not in before and o.forward is not None]
    assert fw.saved_from == 1
    if cache_size >= 3:
        assert len(fw.graph_runners) == 3 and len(bw.graph_runners) == 3
        assert sum(r.outputs.moved for r in fw.graph_runners) == 0 and bw.staged_calls == 0
    else:  # one forward graph: the first two micro-batches' saved tensors moved, then staged
        assert len(fw.graph_runners) == 1 and fw.graph_runners[0].outputs.moved > 0
        assert bw.staged_calls == 4 and len(bw.staging_runners) == 1


def test_graphs_warm_up_and_capture_on_one_stream_sharing_its_cublas_workspace():
    # cuBLAS keeps a workspace per (handle, stream) for the life of the process (32 MiB on
    # sm_90): a stream per capture left one behind per graph
    from flowexec.runtime.cuda_graph import capture_graph

    w, x = torch.randn(64, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    seen = []

    def fn():
        seen.append(torch.cuda.current_stream().cuda_stream)
        return x @ w

    first = capture_graph(fn, warmup=1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    more = [capture_graph(fn, warmup=1) for _ in range(3)]
    grown = torch.cuda.memory_allocated() - before
    assert len(set(seen)) == 1, seen  # every warm-up and capture, on one stream
    assert grown < 2**20, grown  # three [8, 64] outputs, no new workspace
    for graph, out in [first, *more]:
        graph.replay()
        assert_close_rel(out, x @ w)


@pytest.mark.parametrize("mode", ["trace", "graph"])
def test_checkpointed_dropout_trains_like_eager_on_cuda(mode: str) -> None:
    """torch.utils.checkpoint restores the CUDA generator's state before its recompute
    (flowexec/rng.py): trace mode runs that as ops; graph mode cannot, and says so (trace mode
    for that signature)."""
    import torch.utils.checkpoint as ckpt

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.3),
                                             torch.nn.Linear(64, 32))
            self.out = torch.nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(x + ckpt.checkpoint(self.block, x, use_reentrant=False))

    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(Net().cuda(), lambda p: torch.optim.SGD(p, lr=0.1))
    eager, mine = make_step(m1, o1, F.cross_entropy), make_step(m2, o2, F.cross_entropy)
    x, y = torch.randn(16, 32, device="cuda"), torch.randint(0, 4, (16,), device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_seeded_calls_match(eager, flowexec.compile(mine, mode=mode), x, y)
    assert_same_state(m1, m2)
    said = [str(w.message) for w in caught if "random generator's state" in str(w.message)]
    assert bool(said) == (mode == "graph")


@pytest.mark.parametrize("mode", ["trace", "graph"])
@pytest.mark.parametrize("rnn", ["gru", "lstm2"])
def test_recurrent_models_train_like_eager_on_cuda(rnn: str, mode: str) -> None:
    """cuDNN's RNN kernels on CUDA (on the CPU: GRU's unsafe_split, LSTM's grad-mode workspace,
    tests/test_core.py and tests/test_memory.py). cuDNN views its packed weights with
    ``set_(storage)``, which the capture refused until it recorded it as a view of the
    parameters (tests/test_fake_capture.py)."""
    from helpers import assert_rnn_trains_like_eager

    torch.manual_seed(0)
    module = (torch.nn.GRU(8, 16, batch_first=True) if rnn == "gru"
              else torch.nn.LSTM(8, 16, num_layers=2, batch_first=True))
    assert_rnn_trains_like_eager(module, device="cuda", mode=mode)
