"""Memory accounting and memory="planned": planned peak and lower bound against hand-counted
tables, achieved against planned on the core models, the arena validator on random lifetimes,
results equal to eager with the arena and every collector, and flat memory over 1,000 steps."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.capture import capture
from flowexec.models import make_step
from flowexec.passes.liveness import Buffer
from flowexec.passes.memory import (ArenaError, MemoryPlan, Placement, assign_offsets, check_arena, conflict_test,
                                    happens_before)
from flowexec.plan import build_plan
from flowexec.runtime.gc import collector
from flowexec.runtime.memtrack import StorageTracker, measure_memory
from helpers import assert_close_rel, assert_rnn_trains_like_eager, assert_same_state, twin
from test_core import CASES

pytestmark = pytest.mark.timeout(300)
KB = 4096  # a float32[1024]


def _chain(x):
    a = x * 2                     # op 0: 4 KiB
    v = a.view(32, 32)            # op 1: a view of a, counted once
    b = v.exp()                   # op 2: 4 KiB; a dies here
    c = b + 1                     # op 3: 4 KiB; b dies here
    return c.sum()                # op 4: 4 bytes (the output)


def test_planned_peak_counts_views_once_and_the_lower_bound_is_the_largest_live_sum():
    prog = capture(_chain, (torch.randn(1024),)).program
    fast, keep = build_plan(prog, "fast"), build_plan(prog, "none")
    # live per op under fast: {a} {a} {a,b} {b,c} {c,out} -> 8 KiB; gc="none" keeps a, b, c
    assert fast.stats()["planned_peak_bytes"] == 2 * KB and fast.stats()["lower_bound_bytes"] == 2 * KB
    assert keep.stats()["planned_peak_bytes"] == 3 * KB + 4 and keep.stats()["lower_bound_bytes"] == 2 * KB
    assert [(b.start, b.end, b.nbytes, b.output) for b in fast.liveness.buffers] == [
        (0, 2, KB, False), (2, 3, KB, False), (3, 4, KB, False), (4, 5, 4, True)]


def test_split_outputs_share_their_base_buffer():
    prog = capture(lambda x: [c.exp() for c in (x * 2).chunk(4)], (torch.randn(1024),)).program
    bufs = build_plan(prog).liveness.buffers
    base = next(b for b in bufs if b.start == 0)
    assert base.end == 5  # alive until the last chunk is read (op 5), not only until the split


@pytest.mark.parametrize("memory", ["normal", "planned"])
@pytest.mark.parametrize("name", list(CASES))
def test_achieved_peak_is_within_5_percent_of_planned(name, memory):
    model, make_opt, loss_fn, data = CASES[name]()
    step = make_step(model, make_opt(model.parameters()), loss_fn)
    step(*data[0])
    exe = flowexec.compile(step, *data[0], memory=memory)
    r = measure_memory(exe, *data[1])
    assert 0 < r["achieved_peak_bytes"] <= 1.05 * r["planned_peak_bytes"], r
    assert r["lower_bound_bytes"] <= r["planned_peak_bytes"]
    if memory == "planned":
        st = exe.plan.stats()
        assert st["planned_buffers"] > 10
        assert st["arena_lower_bound_bytes"] <= st["arena_bytes"] <= 1.05 * st["arena_lower_bound_bytes"], st


@pytest.mark.parametrize("name", list(CASES))
def test_arena_is_within_5_percent_of_its_lower_bound_in_memory_order(name):
    order = "memory"  # program order: test_achieved_peak_is_within_5_percent_of_planned[planned]
    model, make_opt, loss_fn, data = CASES[name]()
    step = make_step(model, make_opt(model.parameters()), loss_fn)
    step(*data[0])
    st = flowexec.compile(step, *data[0], memory="planned", order=order).plan.stats()
    assert st["planned_buffers"] > 10
    assert st["arena_lower_bound_bytes"] <= st["arena_bytes"] <= 1.05 * st["arena_lower_bound_bytes"], st


def _random_buffers(rng: random.Random, n_ops: int, n: int) -> list[Buffer]:
    out = []
    for k in range(n):
        s = rng.randrange(n_ops)
        e = min(n_ops - 1, s + rng.randrange(1, 8))
        uses = tuple(sorted({s, e} | {rng.randint(s, e) for _ in range(2)}))
        out.append(Buffer(k, k, s, e, rng.choice([4, 100, 256, 4096, 5000, 65536]), False, uses))
    return out


def _plan_random(bufs, conflicts, align):
    sizes = [b.nbytes for b in bufs]
    order = sorted(range(len(bufs)), key=lambda i: -sizes[i])
    offsets, top = assign_offsets(sizes, conflicts, order, align)
    return MemoryPlan((torch.device("cpu"),), (top,), tuple(Placement(b.root, b.group, 0, offsets[i], b.nbytes,
                                                                      b.start, b.end) for i, b in enumerate(bufs)),
                      (), (0,), (align,), {}, frozenset(), ("size",))


@pytest.mark.parametrize("seed", range(20))
def test_arena_validator_on_random_lifetimes_one_and_several_streams(seed):
    rng = random.Random(seed)
    n_ops = 40
    bufs = _random_buffers(rng, n_ops, 30)
    plan = _plan_random(bufs, conflict_test(bufs, None), 64)
    check_arena(plan, bufs)
    # several streams: a random DAG; blocks are shared only when ordered by it
    deps = [tuple(sorted(rng.sample(range(i), min(i, rng.randrange(3))))) for i in range(n_ops)]
    where = [rng.randrange(3) for _ in range(n_ops)]
    anc = happens_before(deps, where)
    multi = _plan_random(bufs, conflict_test(bufs, anc), 512)
    check_arena(multi, bufs, anc)
    # the one-stream plan is not valid over streams wherever it shares a block across unordered ops
    unordered = any(conflict_test(bufs, anc)(i, j) and not conflict_test(bufs, None)(i, j)
                    and {plan.placements[i].offset} & {plan.placements[j].offset}
                    for i in range(len(bufs)) for j in range(i))
    if unordered:
        with pytest.raises(ArenaError):
            check_arena(plan, bufs, anc)


def test_arena_validator_catches_overlap_and_misalignment():
    bufs = [Buffer(0, 0, 0, 2, 128, False, (0, 2)), Buffer(1, 1, 1, 3, 128, False, (1, 3))]
    dev = (torch.device("cpu"),)
    overlap = MemoryPlan(dev, (256,), (Placement(0, 0, 0, 0, 128, 0, 2), Placement(1, 1, 0, 64, 128, 1, 3)),
                         (), (256,), (64,), {}, frozenset(), ("size",))
    with pytest.raises(ArenaError, match="overlap while both are live"):
        check_arena(overlap, bufs)
    skew = MemoryPlan(dev, (512,), (Placement(0, 0, 0, 0, 128, 0, 2), Placement(1, 1, 0, 130, 128, 1, 3)),
                      (), (256,), (64,), {}, frozenset(), ("size",))
    with pytest.raises(ArenaError, match="alignment"):
        check_arena(skew, bufs)


def test_real_plans_pass_the_validator_and_name_what_allocates_normally():
    model, make_opt, loss_fn, data = CASES["transformer_adam"]()
    step = make_step(model, make_opt(model.parameters()), loss_fn)
    step(*data[0])
    plan = flowexec.compile(step, *data[0], memory="planned").plan
    from flowexec.passes.memory import arena_buffers

    check_arena(plan.memory, arena_buffers(plan.program, plan.groups, plan.liveness.last_use))
    reasons = {why for _, why in plan.memory.unplanned}
    assert "aten.native_layer_norm.default returns several values (no single out= overload)" in reasons
    assert "an output of the program (outlives the call)" in reasons


@pytest.mark.parametrize("gc", ["fast", "async", "none"])
@pytest.mark.parametrize("name", list(CASES))
def test_planned_memory_trains_like_eager(name, gc):
    model, make_opt, loss_fn, data = CASES[name]()
    (m1, o1), (m2, o2) = twin(model, make_opt)
    eager, mine = make_step(m1, o1, loss_fn), make_step(m2, o2, loss_fn)
    eager(*data[0]), mine(*data[0])
    exe = flowexec.compile(mine, *data[0], gc=gc, memory="planned")
    for x, y in data[1:]:
        assert_close_rel(exe(x, y), eager(x, y), what="loss")
    assert_same_state(m1, m2)
    assert collector().drain(timeout=30)


def test_functional_step_with_state_as_arguments_and_planned_memory():
    # State passed as arguments (flat; lists once list arguments land), updated in place.
    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 32), torch.randn(32, 4)

    def step(x, y, a, b):
        a.requires_grad_(True), b.requires_grad_(True)
        loss = F.mse_loss(torch.tanh(x @ a) @ b, y)
        ga, gb = torch.autograd.grad(loss, [a, b])
        with torch.no_grad():
            a.sub_(0.1 * ga), b.sub_(0.1 * gb)
        return loss

    ref = [w1.clone(), w2.clone()]
    mine = [w1.clone(), w2.clone()]
    xs = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
    exe = flowexec.compile(step, *xs[0], mine[0].clone(), mine[1].clone(), memory="planned", gc="async")
    assert exe.plan.stats()["planned_buffers"] > 0
    for x, y in xs:
        want = step(x, y, *ref)
        assert_close_rel(exe(x, y, *mine), want, what="loss")
        for i in range(2):
            ref[i] = ref[i].detach()
    assert_close_rel(mine[0], ref[0]), assert_close_rel(mine[1], ref[1])


def _live_tensor_bytes() -> tuple[int, int]:
    """(live tensors, bytes of their distinct storages) among Python objects."""
    import gc as pygc

    seen: dict[int, int] = {}
    n = 0
    for o in pygc.get_objects():
        if type(o) is torch.Tensor and o.layout == torch.strided:  # not fake tensors other tests left
            n += 1
            s = o.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return n, sum(seen.values())


@pytest.mark.parametrize("gc,memory", [("fast", "normal"), ("async", "normal"), ("none", "normal"),
                                       ("fast", "planned"), ("async", "planned"), ("none", "planned")])
def test_memory_stays_flat_over_1000_steps(gc, memory):
    w = torch.randn(64, 64)

    def step(x):  # a few ops, a state update in place, a fresh output each call
        h = (x @ w).tanh()
        w.sub_(0.001 * (x.t() @ h))
        return h.sum()

    x = torch.randn(16, 64)
    exe = flowexec.compile(step, x, gc=gc, memory=memory)
    after = {}
    for i in range(1000):
        exe(x)
        if i in (9, 999):
            assert collector().drain(timeout=30) and collector().backlog_bytes == 0
            import gc as pygc

            pygc.collect()
            after[i] = _live_tensor_bytes()
    # The count is process-wide: garbage other tests left may die in between, so it may fall; a
    # leak of one tensor per step would add 990.
    assert after[999][0] <= after[9][0] and after[999][1] <= after[9][1], after


@pytest.mark.parametrize("options", [{"memory": "planned"}, {"memory": "planned", "order": "memory", "gc": "async"}])
def test_backend_with_planned_memory_trains_like_eager(options):
    torch._dynamo.reset()
    model, make_opt, loss_fn, data = CASES["transformer_adam"]()
    (m1, o1), (m2, o2) = twin(model, make_opt)
    eager = make_step(m1, o1, loss_fn)
    mine = make_step(torch.compile(m2, backend="flowexec", options={"mode": "trace", **options}), o2, loss_fn)
    for x, y in data[:3]:
        assert_close_rel(mine(x, y), eager(x, y), what="loss")
    assert collector().drain(timeout=30)
    assert_same_state(m1, m2)


def test_a_channels_last_intermediate_stays_out_of_the_arena_and_keeps_its_layout():
    """An arena view is row-major: a channels_last intermediate placed there lost its layout, and
    a view that needs it (permute then view, as a channels_last model's flatten) failed."""
    from flowexec.build import plan_for
    from flowexec.capture import capture
    from flowexec.runtime.interpreter import lower_trace

    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x * 2  # channels_last, like x
        return h.permute(0, 2, 3, 1).view(-1)[:7].sum() + (h + 1).sum()

    plan = plan_for(capture(fn, (x,)).program, "trace", memory="planned")
    why = dict(plan.memory.unplanned)
    assert any("row-major" in w for w in why.values())
    torch.testing.assert_close(lower_trace(plan)(x)[0], fn(x))


def test_unsafe_split_pieces_keep_their_base_buffer_alive_and_out_of_reuse():
    """``unsafe_split``'s schema marks no alias, though its pieces view their input (a GRU's
    gates on the CPU): the arena reused the input's block while the pieces were still read,
    and a GRU trained differently under memory="planned"."""
    split = torch.ops.aten.unsafe_split.Tensor

    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = split(x * 2, 4)
        c = (a + 1) * 3  # allocated after the split: it took the input's block
        return (c + b).sum()

    x = torch.randn(8)
    plan = build_plan(capture(fn, (x,)).program, memory="planned")
    base = next(b for b in plan.liveness.buffers if b.start == 0)
    assert base.end >= 3  # alive while b is read (the add), not only until the split
    from flowexec.runtime.interpreter import lower_trace

    run = lower_trace(plan)
    for _ in range(2):
        torch.testing.assert_close(run(x)[0], fn(x))


def test_an_intermediate_whose_shape_changes_in_place_stays_out_of_the_arena():
    """An arena view is made once for every call: ``transpose_`` on it (a batch_first GRU's
    output) left the next call's ``cat.out`` a tensor of the transposed shape."""
    from flowexec.runtime.interpreter import lower_trace

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x, y], 1)
        h.transpose_(0, 1)
        return (h.contiguous() * torch.arange(h.shape[1], dtype=h.dtype)).sum(0)

    x, y = torch.randn(3, 2), torch.randn(3, 4)
    plan = build_plan(capture(fn, (x, y)).program, memory="planned")
    assert any("changed in place (aten.transpose_.default)" in w for _, w in plan.memory.unplanned)
    run = lower_trace(plan)
    for _ in range(3):
        torch.testing.assert_close(run(x, y)[0], fn(x, y))


@pytest.mark.timeout(120)
def test_a_batch_first_gru_trains_like_eager_with_planned_memory():
    torch.manual_seed(0)
    assert_rnn_trains_like_eager(torch.nn.GRU(8, 16, batch_first=True), memory="planned")


def test_a_host_snapshot_puts_back_every_tensor_it_saved() -> None:
    """Capture and graph-mode warm-up undo their writes from a HostSnapshot: every saved tensor
    (strided views, aliases of one storage, several dtypes) comes back as it was, the saved
    copies do not alias the originals, and a later write to the original leaves them alone."""
    from flowexec.snapshot import HostSnapshot, extent

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    col = base[:, 1::2]  # a strided view of the same storage
    flags = torch.tensor([True, False, True])
    ints = torch.arange(5, dtype=torch.int64)
    want = [t.clone() for t in (base, flags, ints)]
    snap = HostSnapshot([col, base, flags, ints])
    assert len(snap) == 4 and extent(col) == 1 + 3 * 6 + 2 * 2
    with torch.no_grad():
        base.mul_(-1)
        flags.logical_not_()
        ints.add_(7)
    assert all(saved.data_ptr() != t.data_ptr() for t, saved in snap.pairs)
    snap.restore()
    for t, w in zip((base, flags, ints), want):
        assert torch.equal(t, w)


def _cpu_blocks(monkeypatch, block: int = 4096) -> None:
    """HostSnapshot's block path (a CUDA tensor's) on CPU tensors, with unpinned blocks."""
    from flowexec import snapshot

    monkeypatch.setattr(snapshot, "_BLOCK", block)
    monkeypatch.setattr(snapshot, "_new_block", lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    monkeypatch.setattr(snapshot, "in_blocks", lambda t: True)


def test_prepin_plans_the_blocks_a_snapshot_of_the_same_tensors_cuts(monkeypatch) -> None:
    """snapshot.block_sizes (what prepin pins ahead) is the list of blocks a HostSnapshot of
    tensors of those sizes, saved in that order, cuts: shared blocks, aligned, and one of its
    own per tensor larger than a block; prepin pins them all at once on a thread."""
    from flowexec import snapshot

    _cpu_blocks(monkeypatch, block=4096)
    made: list[int] = []
    monkeypatch.setattr(snapshot, "_new_block", lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    shapes = [(10,), (1000,), (7, 3), (2000,), (0,), (1, 1), (900,), (5000,), (3,)]
    ts = [torch.ones(s) for s in shapes]
    snap = snapshot.HostSnapshot(ts)
    cut, made[:] = list(made), []
    sizes = [snapshot.extent(t) * t.element_size() for t in ts]
    assert snapshot.block_sizes(sizes) == cut == [4096, 4096, 4096, 8000, 4096, 20000]
    snapshot.prepin(sizes).join(timeout=30)
    assert made == cut
    assert snapshot.prepin([0, 0]) is None
    snap.restore()


def test_copies_stay_on_the_device_within_half_its_room_below_the_peak(monkeypatch) -> None:
    """A snapshot keeps a copy on its tensor's device while the copies fit in half the room
    between what is allocated there and the peak, less what the run ahead allocates; the rest
    go to the (pinned) blocks, and every tensor comes back either way."""
    from flowexec.snapshot import DeviceRoom, HostSnapshot

    _cpu_blocks(monkeypatch)
    reads = []

    def room(device: torch.device) -> int:
        reads.append(device)
        return 1000 + 4 * 100  # (1000 of room, plus the 100-byte copy it holds at the re-read)

    snap = HostSnapshot(device_room=DeviceRoom(ahead=200, room=room))
    ts = [torch.full((25,), float(k)) for k in range(4)]  # 100 bytes each
    for t in ts:
        snap.save(t)
    # budget (1400 - 200) // 2 = 600 at the first read: all four fit, kept beside themselves
    assert snap.on_device == 400 and not snap._blocks
    big = torch.arange(300.0)  # 1,200 bytes: no room (a re-read: 600 + 600 = 1,200 < 1,600), a block
    snap.save(big)
    assert snap.on_device == 400 and len(snap._blocks) == 1 and len(reads) == 2
    for t in (*ts, big):
        t.add_(7)
    snap.restore()
    assert all(torch.equal(t, torch.full((25,), float(k))) for k, t in enumerate(ts))
    assert torch.equal(big, torch.arange(300.0))
    never = HostSnapshot(device_room=DeviceRoom(ahead=10**9, room=room))  # the run ahead fills the room
    never.save(ts[0])
    assert never.on_device == 0 and len(never._blocks) == 1
    shut = HostSnapshot(device_room=DeviceRoom(room=room, open=False))  # (a capture before its backward ends)
    shut.save(ts[0])
    assert shut.on_device == 0 and len(shut._blocks) == 1
    shut.device_room.open = True
    shut.save(ts[1])
    assert shut.on_device == 100


def test_lazily_negated_or_conjugated_views_come_back_through_the_blocks(monkeypatch) -> None:
    """A conj or neg view is saved as its memory (on CUDA, torch applies the flag to an async
    copy's host side before the copy lands), and every view comes back as it was."""
    from flowexec.snapshot import HostSnapshot

    _cpu_blocks(monkeypatch)
    z, r = torch.randn(6, dtype=torch.complex64), torch.randn(6)
    views = [z.conj(), torch._neg_view(r), z.conj().imag]  # (the last: a neg view of z's memory)
    want, mem = [v.clone() for v in views], [z.clone(), r.clone()]
    snap = HostSnapshot()
    for v in views:
        snap.save(v)
    assert not any(s.is_conj() or s.is_neg() for _, s in snap.pairs)
    z.mul_(3), r.add_(1)
    snap.restore()
    assert all(torch.equal(v, w) for v, w in zip(views, want))
    assert torch.equal(z, mem[0]) and torch.equal(r, mem[1])


def test_two_threads_saving_at_once_get_disjoint_pieces_of_the_blocks(monkeypatch) -> None:
    """The autograd engine's device threads (one per GPU) may save at once: each copy gets its
    own piece of a block, so both come back (without the lock the second thread took the piece
    the first was about to get)."""
    import threading
    import time

    from flowexec.snapshot import HostSnapshot

    _cpu_blocks(monkeypatch)
    snap = HostSnapshot()
    b_done = threading.Event()

    class Blocks(list):  # A appends its new block, then B saves whole, then A goes on
        def append(self, block):
            super().append(block)
            if threading.current_thread().name == "saver-a":
                b_done.wait(timeout=1)  # (with the lock B waits for A instead, and this times out)

    snap._blocks = Blocks()
    ta, tb = torch.full((700,), 1.0), torch.full((700,), 2.0)

    def b() -> None:
        time.sleep(0.1)  # A first
        snap.save(tb)
        b_done.set()

    threads = [threading.Thread(target=lambda: snap.save(ta), name="saver-a"), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(snap.pairs) == 2 and all(torch.equal(t, s) for t, s in snap.pairs)


def test_a_real_capture_keeps_copies_on_the_device_only_after_its_backward(monkeypatch) -> None:
    """A capture's undo copies may stay on the device (snapshot.DeviceRoom) only once its
    backward is over: batch norm's running statistics, written in the forward, would sit under
    the activations still to come; the optimizer's writes come after the activations are gone."""
    import flowexec.capture as capture
    from flowexec import snapshot

    monkeypatch.setattr(capture, "_FAKE_CAPTURE", False)
    seen: list[tuple[tuple[int, ...], bool]] = []
    save = snapshot.HostSnapshot.save

    def noting(self, t):
        if self.device_room is not None:
            seen.append((tuple(t.shape), self.device_room.open))
        return save(self, t)

    monkeypatch.setattr(snapshot.HostSnapshot, "save", noting)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    x = torch.randn(8, 6)
    flowexec.compile(step)(x)
    fives = [o for s, o in seen if s == (5,)]  # running mean and var (forward), then biases and BN's affine
    assert fives[:2] == [False, False] and all(fives[2:])
    assert any(s == (3, 5) and o for s, o in seen)  # the optimizer's write of the last weight
