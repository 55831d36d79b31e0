"""flowexec.fetch on CPU: values equal Tensor.item(), errors match, rings, timeouts (CI)."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowexec import fetch
from flowexec.fetch import graph, item, kernel
from flowexec.fetch import settings as fetch_settings
from flowexec.fetch.slots import SPECS, Slots, SlotView, value_cell, wait
from flowexec.fetch import Fetch, FetchRing, FetchTimeoutError, fast_item

pytestmark = pytest.mark.timeout(60)

_I64 = torch.iinfo(torch.int64)
_EDGE_FLOATS = [0.0, -0.0, 1.0, -2.5, math.inf, -math.inf, math.nan, 1e-45, 3.0e38, 65504.0,
                1 / 3, 1e-8, -1e300]


def _edge_cases() -> list[torch.Tensor]:
    """One-element tensors of every supported dtype holding awkward values."""
    ts = [torch.tensor(v) for v in (True, False)]
    for dt in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        info = torch.iinfo(dt)
        ts += [torch.tensor(v, dtype=dt) for v in (info.min, info.max, 0, -1 if info.min else 1)]
    for name in ("uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            dt = getattr(torch, name)
            ts += [torch.tensor(0, dtype=torch.int64).to(dt)]
            ts += [torch.full((), -1, dtype=torch.int64).view(torch.uint64)] if name == "uint64" else []
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        ts += [torch.tensor(v, dtype=dt) for v in _EDGE_FLOATS]
    ts.append(torch.tensor(1.00390625, dtype=torch.float64).to(torch.bfloat16))  # rounds
    for dt in (torch.complex32, torch.complex64, torch.complex128):
        ts += [torch.tensor(complex(a, b)).to(dt)
               for a, b in ((1.5, -2.0), (math.nan, 0.0), (-0.0, math.inf), (0.0, -0.0))]
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        if hasattr(torch, name):
            ts += [torch.tensor(v).to(getattr(torch, name)) for v in (0.0, -1.75, 448.0, 1e-3)]
    ts += [torch.tensor([[7]], dtype=torch.int64), torch.arange(10.0)[7:8],
           torch.tensor(3.0).expand(1, 1), torch.tensor(_I64.min)]
    return ts


def _same(got: object, want: object) -> bool:
    """Equal as Python numbers, same type, NaN equal to NaN, and the sign of zero kept."""
    if type(got) is not type(want):
        return False
    if isinstance(want, complex):
        return _same(got.real, want.real) and _same(got.imag, want.imag)  # type: ignore[union-attr]
    if isinstance(want, float):
        if math.isnan(want):
            return math.isnan(got)  # type: ignore[arg-type]
        return got == want and math.copysign(1, got) == math.copysign(1, want)  # type: ignore[arg-type]
    return got == want


def _decode_via_slot(t: torch.Tensor) -> object:
    """What the CUDA paths do after the copy: the element's bytes in a slot, then decoded."""
    buf = (ctypes.c_char * 32)()
    ctypes.memmove(buf, t.data_ptr(), t.element_size())
    spec, view = SPECS[t.dtype], SlotView(ctypes.addressof(buf))
    got = spec.decode(view)
    assert _same(value_cell(spec, view).value, got)  # the hot path's way of decoding
    return got


def test_every_dtype_is_covered():
    for t in _edge_cases():
        assert t.dtype in SPECS, t.dtype


@pytest.mark.parametrize("t", _edge_cases(), ids=lambda t: f"{t.dtype}-{t.flatten()[0].item()!r}")
def test_fast_item_and_slot_decoding_equal_item(t: torch.Tensor):
    want = t.item()
    assert _same(fast_item(t), want)
    assert _same(_decode_via_slot(t), want)


def test_bfloat16_rounding_and_negative_zero_sign():
    t = torch.tensor(1.00390625, dtype=torch.float64).to(torch.bfloat16)
    assert _decode_via_slot(t) == t.item() == 1.0  # round-to-nearest-even, not truncation
    assert math.copysign(1, _decode_via_slot(torch.tensor(-0.0, dtype=torch.bfloat16))) == -1


def test_lazy_conj_and_neg_views_read_their_value():
    z = torch.tensor(1 + 2j)
    assert fast_item(z.conj()) == z.conj().item() == 1 - 2j
    assert fast_item(torch._neg_view(z)) == -z.item()


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(0, 2**64 - 1), which=st.sampled_from(
    [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.complex64]))
def test_decoding_random_bit_patterns_equals_item(bits: int, which: torch.dtype):
    raw = torch.tensor([bits - 2**64 if bits >= 2**63 else bits], dtype=torch.int64)
    t = raw.view(torch.uint8)[: which.itemsize].view(which).reshape(())
    assert _same(_decode_via_slot(t), t.item())


@pytest.mark.parametrize("t", [torch.zeros(2), torch.zeros(0), torch.zeros(2, 3, dtype=torch.int64)])
def test_wrong_element_count_raises_like_item(t: torch.Tensor):
    with pytest.raises(RuntimeError) as want:
        t.item()
    with pytest.raises(type(want.value), match=str(want.value)):
        fast_item(t)
    with pytest.raises(type(want.value), match=str(want.value)):
        FetchRing("cpu").submit(t)


def test_backend_and_configure():
    if not torch.cuda.is_available():
        assert fetch.backend() == "cpu"
    old = fetch.configure(spin_us=10, timeout=5)
    try:
        assert fetch_settings.spin_s == pytest.approx(10e-6) and fetch_settings.timeout_s == 5
        with pytest.raises(ValueError, match="unknown fetch backend"):
            fetch.configure(backend="warp-drive")
        with pytest.raises(ValueError):
            fetch.configure(timeout=-1)
    finally:
        fetch.configure(**old)
    assert fetch_settings.spin_s == pytest.approx(old["spin_us"] * 1e-6)


# ------------------------------------------------------------------ the wait loop
def test_wait_times_out_with_a_clear_message():
    t0 = time.perf_counter()
    with pytest.raises(FetchTimeoutError, match=r"timed out after 0\.05 s waiting for the answer"):
        wait(lambda a, b: False, None, None, 0.05, 1e-4, None, 0, "the answer")
    assert time.perf_counter() - t0 < 2.0
    assert issubclass(FetchTimeoutError, TimeoutError)


def test_wait_returns_when_another_thread_finishes():
    flag = threading.Event()
    threading.Timer(0.02, flag.set).start()
    wait(lambda a, b: a.is_set(), flag, None, 10.0, 1e-4, None, 0, "flag")
    assert flag.is_set()


def test_wait_surfaces_producer_errors_instead_of_timing_out():
    def check(stream: int) -> None:
        raise RuntimeError(f"device fault on stream {stream}")

    with pytest.raises(RuntimeError, match="device fault on stream 7"):
        wait(lambda a, b: False, None, None, 10.0, 0.0, check, 7, "x")


class _FakeDeviceSlots(Slots):
    """A stand-in for a device path: the 'copy' lands only when the test lets it (or never)."""

    name = "fake"

    def __init__(self, deliver_after: float | None) -> None:
        self._buf = (ctypes.c_char * 32)()
        self.views = [SlotView(ctypes.addressof(self._buf))]
        self._seq, self._delay = 0, deliver_after

    def write(self, i, t, spec, seq, stream):
        payload = ctypes.string_at(t.data_ptr(), t.element_size())  # taken now, like a copy

        def land():
            ctypes.memmove(self._buf, payload, len(payload))
            self.views[i].seq.value = seq

        if self._delay is not None:
            threading.Timer(self._delay, land).start()

    def ready(self, i, seq):
        return self.views[i].seq.value >= seq


def test_sequence_protocol_reads_each_value_once_it_lands():
    slots = _FakeDeviceSlots(deliver_after=0.01)
    for v in (3.25, -7.5, math.inf):
        t = torch.tensor(v, dtype=torch.float32)
        assert slots.item(t, SPECS[t.dtype], 0, 5.0, 1e-4) == v


def test_sequence_protocol_times_out_when_the_copy_never_lands():
    slots = _FakeDeviceSlots(deliver_after=None)
    t = torch.tensor(1.0)
    with pytest.raises(FetchTimeoutError, match="fast_item of a torch.float32 tensor"):
        slots.item(t, SPECS[t.dtype], 0, 0.05, 1e-4)


# ------------------------------------------------------------------ FetchRing on CPU
def test_ring_wraps_around_and_each_fetch_keeps_its_value():
    ring = FetchRing("cpu", slots=3)
    fs = [ring.submit(torch.tensor(i * 10, dtype=torch.int64), label=f"step {i}") for i in range(20)]
    assert all(isinstance(f, Fetch) for f in fs)
    assert [f.result() for f in fs] == [i * 10 for i in range(20)]
    assert all(f.done() for f in fs)


def test_ring_takes_the_value_at_submit_time():
    ring = FetchRing("cpu", slots=2)
    x = torch.tensor(1.0)
    f = ring.submit(x)
    x.fill_(2.0)  # a producer reusing its buffer after submit
    assert f.result() == 1.0


@pytest.mark.timeout(30)
def test_ring_with_slow_producers_returns_each_steps_value():
    ring = FetchRing("cpu", slots=4)
    n = 16
    xs = [torch.zeros((), dtype=torch.float64) for _ in range(n)]
    evs = [threading.Event() for _ in range(n)]

    def producer():
        for k in range(n):  # writes land in order, long after their submits
            time.sleep(0.002)
            xs[k].fill_(k + 0.5)
            evs[k].set()

    th = threading.Thread(target=producer, daemon=True)
    th.start()
    fs = [ring.submit(xs[k], ready=evs[k], label=f"step {k}", timeout=10) for k in range(n)]
    assert [f.result(timeout=10) for f in fs] == [k + 0.5 for k in range(n)]
    th.join(timeout=10)
    assert not th.is_alive() and ring.pending == 0


@pytest.mark.timeout(30)
def test_blocked_producer_times_out_then_recovers():
    ring = FetchRing("cpu", slots=1, spin_us=50)
    x, gate = torch.tensor(41), threading.Event()
    f = ring.submit(x, ready=gate, label="loss@step 7")
    assert not f.done()
    t0 = time.perf_counter()
    with pytest.raises(FetchTimeoutError, match=r"loss@step 7.*FetchRing\(cpu, 1 slots"):
        f.result(timeout=0.05)
    assert time.perf_counter() - t0 < 5
    # The single slot is still owned by the unread fetch: a new submit must wait for it, and
    # says which fetch it waited for.
    with pytest.raises(FetchTimeoutError, match=r"loss@step 7.*to free slot 0 for step 8"):
        ring.submit(torch.tensor(0), label="step 8", timeout=0.05)
    x.add_(1)
    gate.set()
    assert f.done() and f.result(timeout=1) == 42
    assert ring.submit(torch.tensor(5), label="step 8").result() == 5


@pytest.mark.timeout(30)
def test_result_from_another_thread_while_submit_wraps():
    ring = FetchRing("cpu", slots=2)
    gates = [threading.Event() for _ in range(6)]
    fs = [ring.submit(torch.tensor(k), ready=gates[k]) for k in range(2)]
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(fs[0].result(timeout=10)), daemon=True)
    reader.start()
    threading.Timer(0.02, gates[0].set).start()
    threading.Timer(0.03, gates[1].set).start()
    f2 = ring.submit(torch.tensor(2))  # reuses slot 0: materialises fetch 0 first
    reader.join(timeout=10)
    assert got == [0] and fs[1].result(timeout=10) == 1 and f2.result() == 2


def test_ring_rejects_what_it_cannot_fetch():
    ring = FetchRing("cpu", slots=2)
    q = torch.quantize_per_tensor(torch.tensor([1.0]), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="cannot fetch"):
        ring.submit(q)
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        ring.submit(3.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stream= is for CUDA"):
        ring.submit(torch.tensor(1.0), stream=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one slot"):
        FetchRing("cpu", slots=0)
    with pytest.raises(ValueError, match="cuda and cpu"):
        FetchRing("meta")
    ring.fence()  # no-op on CPU
    ring.drain()


# ------------------------------------------------------------------ the PTX kernel
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas here")
@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_ptx_assembles(tmp_path, arch: str):
    from flowexec import _cuda_native

    src = tmp_path / "fx_read.ptx"
    src.write_text(_cuda_native.ptx())
    r = subprocess.run(["ptxas", f"-arch={arch}", str(src), "-o", str(tmp_path / "a.cubin")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert all(f"fx_read{n}" in _cuda_native.ptx() for n in _cuda_native.SIZES)


# ------------------------------------------------------------------ driver paths, emulated
class _FakeNative:
    """Stands in for flowexec._cuda_native on CPU: 'device' memory is host memory and the
    fx_read kernel runs at launch, reading its parameters the way the driver does (an array of
    pointers to the values). Exercises the real parameter marshalling and sequence protocol."""

    CUDA_ERROR_NOT_READY, CUDA_ERROR_INVALID_CONTEXT = 600, 201
    CudaDriverError = RuntimeError
    LL_SIZES = (1, 2, 4)

    def __init__(self, deliver: bool = True) -> None:
        self.deliver, self._bufs, self.launches, self.graphs = deliver, [], 0, {}
        self.graph_launches = 0
        fake = self

        class Driver:
            def cuEventRecord(self, ev, stream):
                return 0

            def cuStreamWaitEvent(self, stream, ev, flags):
                return 0

            def cuStreamQuery(self, stream):
                return 600

            def cuGraphLaunch(self, exec_, stream):
                fn, src, dst, flag = fake.graphs[exec_]  # parameters as they were at capture
                fake.graph_launches += 1
                if not fake.deliver:
                    return 0
                if fn < 0:  # fx_ll: the element zero-extended, the flag above it, ONE 8-byte store
                    word = int.from_bytes(ctypes.string_at(src, -fn), "little") | flag << 32
                    ctypes.c_uint64.from_address(dst).value = word
                else:  # fx_read: payload, fence, flag at +16
                    ctypes.memmove(dst, src, fn)
                    ctypes.c_uint64.from_address(dst + 16).value = flag
                return 0

            def cuGraphExecDestroy(self, exec_):
                del fake.graphs[exec_]
                return 0

        self._driver = Driver()

        def launch(fn: int, stream: int, paddr: int) -> int:
            fake.launches += 1
            ptrs = (ctypes.c_void_p * 3).from_address(paddr)
            src, dst, seq = (ctypes.c_uint64.from_address(p).value for p in ptrs)
            if fake.deliver:
                ctypes.memmove(dst, src, fn)  # fn is the element size here
                ctypes.c_uint64.from_address(dst + 16).value = seq
            return 0

        self._launch = launch

    def driver(self):
        return self._driver

    def ensure_context(self, idx: int) -> None:
        pass

    def host_alloc(self, n: int) -> tuple[int, int]:
        buf = ctypes.create_string_buffer(n)
        self._bufs.append(buf)
        return ctypes.addressof(buf), ctypes.addressof(buf)

    def event_create(self) -> int:
        return 1

    def stream_create(self) -> int:
        return 7

    def graph_of_launch(self, fn: int, paddr: int, stream: int) -> int:
        ptrs = (ctypes.c_void_p * 3).from_address(paddr)
        src, dst, flag = (ctypes.c_uint64.from_address(p).value for p in ptrs)
        assert flag == 1
        self.graphs[len(self.graphs) + 100] = (fn, src, dst, flag)
        return len(self.graphs) + 99

    def kernels(self, idx: int) -> dict[int, int]:  # the element size; -n: fx_ll<n>
        return {**{n: n for n in (1, 2, 4, 8, 16)}, **{-n: -n for n in self.LL_SIZES}}

    def launcher(self, kind: str):
        return self._launch

    def graph_launcher(self, kind: str):
        return self._driver.cuGraphLaunch

    def check(self, err: int, call: str) -> None:
        if err:
            raise RuntimeError(call)


def test_kernel_path_emulated(monkeypatch):
    fake = _FakeNative()
    monkeypatch.setattr(kernel, "native", lambda: fake)
    ks = kernel.KernelSlots(0, 4, "fake")
    cases = _edge_cases()
    for t in cases:  # the fast_item reader: slot 0, one sequence number per read
        assert _same(ks.item(t, SPECS[t.dtype], 0, 1.0, 1e-4), t.item()), t
    for k, t in enumerate(cases):  # the ring's use: write to slot i, poll, decode
        spec, i = SPECS[t.dtype], k % 4
        ks.write(i, t, spec, 1000 + k, 0)
        assert ks.ready(i, 1000 + k)
        assert _same(ks.read(i, spec, t), t.item())
    assert fake.launches == 2 * len(cases)


def test_kernel_reader_times_out_when_the_kernel_never_writes(monkeypatch):
    fake = _FakeNative(deliver=False)
    monkeypatch.setattr(kernel, "native", lambda: fake)
    slots = kernel.KernelSlots(0, 1, "fake")
    with pytest.raises(FetchTimeoutError, match="fast_item of a torch.int64 tensor"):
        slots.item(torch.tensor(3), SPECS[torch.int64], 0, 0.05, 1e-4)
    assert not slots.ready(0, 1)


def test_graph_reader_emulated(monkeypatch):
    fake = _FakeNative()
    monkeypatch.setattr(kernel, "native", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    slots = graph.GraphSlots(0, "fake")
    for t in _edge_cases():
        spec = SPECS[t.dtype]
        e = slots.entry(t.data_ptr(), spec)
        assert _same(slots.graph_item(e, e_stream := 0, t, 1.0, None), t.item()), t
        if t.dtype.is_floating_point and t.dtype.itemsize >= 2:  # a replay reads the address anew
            t2 = t.clone().fill_(2.0)
            ctypes.memmove(t.data_ptr(), t2.data_ptr(), t.element_size())
            assert slots.graph_item(e, e_stream, t, 1.0, None) == 2.0
        slots.destroy(e)
    assert not fake.graphs
    x = torch.tensor(5, dtype=torch.int32)  # the direct path on slot 0 still works beside it
    assert slots.item(x, SPECS[x.dtype], 0, 1.0, 1e-4) == 5


def test_graph_reader_times_out_when_the_graph_never_writes(monkeypatch):
    fake = _FakeNative(deliver=False)
    monkeypatch.setattr(kernel, "native", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    slots = graph.GraphSlots(0, "fake")
    t = torch.tensor(1.5)
    e = slots.entry(t.data_ptr(), SPECS[t.dtype])
    with pytest.raises(FetchTimeoutError, match="fast_item of a torch.float32"):
        slots.graph_item(e, 0, t, 0.05, 10.0)


def test_graph_reader_uses_the_fenceless_kernel_for_narrow_elements(monkeypatch):
    fake = _FakeNative()
    monkeypatch.setattr(kernel, "native", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    slots = graph.GraphSlots(0, "fake")
    slot1 = slots._host + 32
    for dt in (torch.bool, torch.int8, torch.float16, torch.bfloat16, torch.int32, torch.float32,
               torch.complex32, torch.int64, torch.float64, torch.complex64, torch.complex128):
        t = torch.ones((), dtype=dt)
        e = slots.entry(t.data_ptr(), SPECS[dt])
        fn, flag = fake.graphs[e[graph.E_EXEC]][0], e[graph.E_FLAG]
        if dt.itemsize <= 4:  # fx_ll: flag in the high half of the payload's 8-byte word
            assert fn == -dt.itemsize and ctypes.addressof(flag) == slot1 + 4
        else:  # fx_read: fenced, flag at +16
            assert fn == dt.itemsize and ctypes.addressof(flag) == slot1 + 16
        assert _same(slots.graph_item(e, 0, t, 1.0, None), t.item())
        slots.destroy(e)


def test_graph_reader_never_returns_the_previous_value(monkeypatch):
    """The flag is cleared before each replay: a replay that never lands times out instead of
    returning the value the slot still holds from the read before."""
    fake = _FakeNative()
    monkeypatch.setattr(kernel, "native", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    slots = graph.GraphSlots(0, "fake")
    for dt in (torch.float32, torch.float64):
        t = torch.tensor(4.5, dtype=dt)
        e = slots.entry(t.data_ptr(), SPECS[dt])
        fake.deliver = True
        assert slots.graph_item(e, 0, t, 1.0, None) == 4.5
        fake.deliver = False
        with pytest.raises(FetchTimeoutError):
            slots.graph_item(e, 0, t, 0.02, 10.0)


# ------------------------------------------------------------------ fast_item's hot path, emulated
@pytest.fixture
def emulated_cuda(monkeypatch):
    """fast_item's hot path on CPU tensors: the tensor class claims CUDA, the current device and
    stream are fixed, graphs are the fake driver's, and the slow path only records its calls."""
    fake = _FakeNative()
    monkeypatch.setattr(kernel, "native", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.Tensor, "is_cuda", True, raising=False)
    monkeypatch.setattr(item, "_raw_stream", lambda idx: 0)
    monkeypatch.setattr(item, "_get_device", lambda: 0)
    monkeypatch.setattr(item, "_tls", item._Local())
    slow: list[torch.Tensor] = []
    monkeypatch.setattr(item, "_fast_item_slow", lambda t, timeout, spin_us: slow.append(t))
    slots = graph.GraphSlots(0, "fake")
    item._tls.readers[0] = slots

    def make_hot(t: torch.Tensor) -> graph.HotEntry:
        e = item._tls.hot[(t.data_ptr(), t.dtype)] = slots.entry(t.data_ptr(), SPECS[t.dtype])
        return e

    return fake, slots, make_hot, slow


def test_hot_path_reads_every_dtype(emulated_cuda):
    fake, _, make_hot, slow = emulated_cuda
    cases = _edge_cases()
    for t in cases:
        make_hot(t)
        assert _same(fast_item(t), t.item()), t
    assert not slow and fake.graph_launches == len(cases)


def test_hot_path_declines_what_it_must_not_read(emulated_cuda, monkeypatch):
    fake, _, make_hot, slow = emulated_cuda
    x, z, big = torch.tensor(2.0), torch.tensor(1 + 2j), torch.zeros(4)
    for t in (x, z, big[0]):
        make_hot(t)
    declined = [big, torch._neg_view(x), z.conj(), torch._neg_view(z), x.view(torch.int32)]
    for t in declined:  # four elements; the negative / conjugate bit; another dtype there
        fast_item(t)
    assert len(slow) == len(declined) and fake.graph_launches == 0

    class Sub(torch.Tensor):
        pass

    assert fast_item(torch.Tensor._make_subclass(Sub, x)) == 2.0  # .item(), not the graph
    assert fake.graph_launches == 0
    e = make_hot(x)
    two_gpus = e[:graph.E_DEV] + (0,) + e[graph.E_DEV + 1:]  # a process with two GPUs
    item._tls.hot[(x.data_ptr(), x.dtype)] = two_gpus
    monkeypatch.setattr(item, "_get_device", lambda: 1)  # ... whose current device is another
    fast_item(x)
    assert len(slow) == len(declined) + 1 and fake.graph_launches == 0
    monkeypatch.setattr(item, "_get_device", lambda: 0)
    assert fast_item(x) == 2.0 and fake.graph_launches == 1


def test_hot_path_timeout_retires_the_reader_and_its_graphs(emulated_cuda):
    fake, slots, make_hot, slow = emulated_cuda
    x, y = torch.tensor(1.5), torch.tensor(7, dtype=torch.int64)
    make_hot(x), make_hot(y)
    assert fast_item(x) == 1.5
    fake.deliver = False
    with pytest.raises(FetchTimeoutError, match="fast_item of a torch.float32 tensor"):
        fast_item(x, timeout=0.05, spin_us=10)
    assert not item._tls.hot and 0 not in item._tls.readers  # y's graph went too
    assert item._retired[-1] is slots  # kept, never reused: a late write lands there
    fast_item(x)  # a fresh start: the slow path now
    assert len(slow) == 1
