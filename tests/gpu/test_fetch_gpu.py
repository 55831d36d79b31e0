"""flowexec.fetch on CUDA: every backend equals Tensor.item(), ordering, rings, timeouts."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from flowexec import fetch
from flowexec.fetch import FetchRing, FetchTimeoutError, choose, fast_item, graph, item

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(30),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BACKENDS = ["graph+cupy", "graph+ctypes", "torch"]


def _cycles(seconds: float) -> int:
    """torch.cuda._sleep cycles for about ``seconds`` (clock rate from the device, MHz → Hz)."""
    mhz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) / 1000 or 2000
    return int(seconds * mhz * 1e6)


@pytest.fixture(params=BACKENDS)
def with_backend(request):
    old = fetch.configure(backend=request.param)
    try:
        got = fetch.backend()
    except RuntimeError as e:  # e.g. cupy not installed
        fetch.configure(**old)
        pytest.skip(f"{request.param} unavailable: {e}")
    assert got == request.param
    yield got
    fetch.configure(**old)


def _cases() -> list[torch.Tensor]:
    from test_fetch import _edge_cases  # same values as the CPU tests (tests/ is on sys.path)

    return [t.cuda() for t in _edge_cases()]


def _same(got: object, want: object) -> bool:
    from test_fetch import _same as same

    return same(got, want)


def test_auto_picks_the_graph_path():
    fetch.configure(backend="auto")
    assert fetch.backend().startswith("graph+"), choose.failures


def _hot(t: torch.Tensor) -> bool:
    return (t.data_ptr(), t.dtype) in item._tls.hot


def test_repeated_reads_of_one_address(with_backend):
    x = torch.zeros((), device="cuda")
    for k in range(50):
        x.fill_(k * 0.5)  # in place: same address, new value each time
        assert fast_item(x) == k * 0.5
    assert _hot(x) == with_backend.startswith("graph+")
    z = torch.tensor(1 + 2j, device="cuda")
    for _ in range(3):
        assert fast_item(z) == 1 + 2j
    assert fast_item(z.conj()) == 1 - 2j  # same address and dtype as a hot entry, conj bit set
    assert fast_item(z.conj().imag) == -2.0  # the negative bit on a real view
    assert fast_item(x.view(torch.int32)) == x.view(torch.int32).item()  # same address, new dtype
    big = torch.zeros(4, device="cuda")
    fast_item(big[0]), fast_item(big[0])
    with pytest.raises(RuntimeError, match="4 elements"):
        fast_item(big)  # same address as a hot scalar, but four elements


def test_many_distinct_addresses_round_robin(with_backend):
    xs = torch.arange(600, dtype=torch.float64, device="cuda")
    for rnd in range(3):
        for i in (list(range(0, 600, 2)) if rnd < 2 else list(range(40))):
            assert fast_item(xs[i]) == float(i)
    assert len(item._tls.hot) <= graph.HOT_MAX


def test_every_dtype_equals_item(with_backend):
    for t in _cases():
        assert _same(fast_item(t), t.item()), (with_backend, t.dtype, t)


def test_every_dtype_equals_item_when_hot(with_backend):
    """Read three times: the second read builds the graph (fx_ll for <= 4 bytes, fx_read for 8
    and 16), the third replays it."""
    for t in _cases():
        for _ in range(3):
            assert _same(fast_item(t), t.item()), (with_backend, t.dtype, t)
        assert _hot(t) == with_backend.startswith("graph+"), t.dtype


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.int32, torch.float32,
                                   torch.float64])
def test_hot_reads_follow_in_place_updates(with_backend, dtype):
    """Each read comes after a kernel that changed the value in place: a payload seen before its
    flag, or a flag left over from the read before, would show up as a stale value."""
    x = torch.zeros((), dtype=dtype, device="cuda")
    for k in range(400):
        x.fill_(k % 100)
        if k % 3 == 0:
            x.add_(1)  # a second kernel between write and read
        want = (k % 100) + (1 if k % 3 == 0 else 0)
        assert fast_item(x) == want, (k, dtype)


def test_views_offsets_and_autograd(with_backend):
    base = torch.arange(100, dtype=torch.float64, device="cuda")
    p = torch.nn.Parameter(torch.tensor(3.5, device="cuda"))
    z = torch.tensor(1 + 2j, device="cuda")
    for t in (base[37], base[5:6].view(1, 1), base[::7][3], p, p * 2, z.conj(),
              torch._neg_view(z), torch.tensor(9, device="cuda").expand(1, 1)):
        assert _same(fast_item(t), t.item())


def test_wrong_element_count_raises_like_item(with_backend):
    t = torch.zeros(2, device="cuda")
    with pytest.raises(RuntimeError) as want:
        t.item()
    with pytest.raises(RuntimeError, match=str(want.value)):
        fast_item(t)


def test_reads_after_the_producer_on_the_current_stream(with_backend):
    x = torch.zeros((), device="cuda")
    for k in range(20):
        torch.cuda._sleep(_cycles(0.002))  # the producer below runs ~2 ms after this call
        x.fill_(float(k))
        assert fast_item(x) == float(k)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(_cycles(0.002))
        y = x + 100
        assert fast_item(y) == 119.0  # read on the side stream, which is current here
    torch.cuda.synchronize()


def test_threads_each_read_their_own_values(with_backend):
    errors: list[str] = []

    def worker(k: int) -> None:
        try:
            xs = torch.arange(200, dtype=torch.int64, device="cuda") * (k + 1)
            for i in range(200):
                v = fast_item(xs[i])
                if v != i * (k + 1):
                    errors.append(f"thread {k}: {v} != {i * (k + 1)}")
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ths = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=60)
    assert not errors and not any(th.is_alive() for th in ths)


def test_blocked_stream_times_out_then_recovers(with_backend):
    x = torch.zeros((), device="cuda")
    fast_item(x), fast_item(x)  # hot: the timeout is taken on the fast path
    torch.cuda._sleep(_cycles(1.0))
    x.fill_(5.0)
    t0 = time.perf_counter()
    with pytest.raises(FetchTimeoutError, match="fast_item of a torch.float32 tensor"):
        fast_item(x, timeout=0.05)
    assert time.perf_counter() - t0 < 0.9  # it gave up, it did not wait for the sleep
    assert fast_item(x, timeout=30) == 5.0  # a fresh slot; the late copy can't corrupt it
    x.fill_(6.0)
    assert fast_item(x) == 6.0
    torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device(with_backend):
    y = torch.tensor(2.5, device="cuda:1")
    assert fast_item(y) == 2.5 and torch.cuda.current_device() == 0


# ------------------------------------------------------------------ FetchRing
def test_ring_many_in_flight_with_wrap_around(with_backend):
    ring = FetchRing("cuda", slots=4)
    torch.cuda._sleep(_cycles(0.05))  # everything below is still in flight when the ring wraps
    acc = torch.zeros((), dtype=torch.float64, device="cuda")
    fs = []
    for step in range(40):
        acc = acc + step  # a new tensor each step: its memory may be reused after the step
        fs.append(ring.submit(acc.to(torch.float32), label=f"loss@{step}"))
    want = [float(sum(range(s + 1))) for s in range(40)]
    assert [f.result(timeout=30) for f in fs] == want
    torch.cuda.synchronize()


def test_ring_every_dtype(with_backend):
    ring = FetchRing("cuda", slots=8)
    cases = _cases()
    fs = [ring.submit(t) for t in cases]
    for t, f in zip(cases, fs):
        assert _same(f.result(timeout=30), t.item()), (t.dtype, t)


def test_ring_keeps_the_producer_alive_until_copied(with_backend):
    ring = FetchRing("cuda", slots=16)
    torch.cuda._sleep(_cycles(0.02))
    fs = []
    for k in range(16):
        tmp = torch.full((256,), float(k), device="cuda").sum()  # freed right after submit
        fs.append(ring.submit(tmp))
        del tmp
        junk = torch.full((256,), -1.0, device="cuda").sum()  # would reuse a freed block
        del junk
    assert [f.result(timeout=30) for f in fs] == [256.0 * k for k in range(16)]


def test_ring_fence_protects_a_reused_output_buffer(with_backend):
    ring = FetchRing("cuda", slots=8)
    out = torch.zeros((), device="cuda")  # like a CUDA-graph static output
    fs = []
    for step in range(30):
        torch.cuda._sleep(_cycles(0.0002))
        out.fill_(float(step))
        fs.append(ring.submit(out))
        ring.fence()  # the next fill_ waits until this step's copy has read `out`
    assert [f.result(timeout=30) for f in fs] == [float(s) for s in range(30)]


def test_result_waits_for_its_value_not_the_device(with_backend):
    ring = FetchRing("cuda", slots=2)
    x = torch.tensor(7.0, device="cuda")
    f = ring.submit(x)
    torch.cuda._sleep(_cycles(1.0))  # later work keeps the device busy for ~1 s
    t0 = time.perf_counter()
    assert f.result(timeout=0.5) == 7.0
    assert time.perf_counter() - t0 < 0.5
    assert torch.cuda.current_stream().query() is False  # the device was still busy
    torch.cuda.synchronize()


def test_ring_blocked_producer_times_out_then_recovers(with_backend):
    ring = FetchRing("cuda", slots=1, spin_us=50)
    base = torch.tensor(41.0, device="cuda")  # made before the sleep: its upload synchronizes
    torch.cuda._sleep(_cycles(1.0))
    x = base + 1
    f = ring.submit(x, label="loss@step 3")
    assert not f.done()
    with pytest.raises(FetchTimeoutError, match=r"loss@step 3"):
        f.result(timeout=0.05)
    with pytest.raises(FetchTimeoutError, match=r"loss@step 3.*to free slot 0"):
        ring.submit(x, timeout=0.05)
    assert f.result(timeout=30) == 42.0 and f.done()


def test_ring_producer_on_another_stream(with_backend):
    ring = FetchRing("cuda", slots=4)
    s = torch.cuda.Stream()
    base = torch.tensor(1.25, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(_cycles(0.01))
        y = base * 4
    f = ring.submit(y, stream=s)
    assert f.result(timeout=30) == 5.0
    torch.cuda.synchronize()


def test_ring_rejects_a_tensor_on_the_wrong_device(with_backend):
    ring = FetchRing("cuda", slots=2)
    with pytest.raises(ValueError, match="cannot fetch a tensor on cpu"):
        ring.submit(torch.tensor(1.0))
    assert math.isnan(ring.submit(torch.tensor(math.nan, device="cuda")).result())
