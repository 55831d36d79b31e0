"""Streams: flowexec's statically planned multi-stream runs against one stream, side by side.

Workload (b) of ``../shared/reference/streams_anchors_gpu.py``: four independent branches of six
small matmul + SiLU (batch 8, 256 wide), concatenated; the reference ran them from one CUDA
graph on one stream (177.8 µs) and on four streams forked and joined by hand (60.0 µs), each
replay followed by a synchronize. Rows: eager; those two hand-made graphs, rebuilt here; flowexec
graph and trace mode with ``streams=1`` and ``streams=4``. Then the reference MLP training step
(8×256, batch 32, SGD) in graph mode with 1, 2 and 4 streams, to show what streams do to a
step with little parallelism (every flowexec row checked against eager first), and the GPT-2
tiny and small training steps through the torch.compile backend in graph mode with 1 and 4
streams.

    PYTHONPATH=. python3 benchmarks/streams.py --out benchmarks/results

Writes streams.json (device, versions, date, commit, plan sizes, every figure).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import platform
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flowexec  # noqa: E402
from flowexec.models import make_mlp, make_step  # noqa: E402
from flowexec.runtime.cuda_graph import capture_graph  # noqa: E402
from step_time import interleaved  # noqa: E402

B, D = 8, 256


def branch(ws: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    for w in ws:
        h = F.silu(h @ w)
    return h


def by_hand_four_streams(br: list[list[torch.Tensor]], streams: list[torch.cuda.Stream]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference's hand-written fork and join over four streams."""
    def fn(xs: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream()
        ev = main.record_event()
        outs: list[Any] = [None] * len(br)
        for i, (s, ws) in enumerate(zip(streams, br)):
            with torch.cuda.stream(s):
                s.wait_event(ev)
                outs[i] = branch(ws, xs)
        for s in streams:
            main.wait_stream(s)
        return torch.cat(outs, -1)
    return fn


def reserved_by(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and the MiB the caching allocator reserved during it (CUDA graph pools included)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.memory_reserved() - before) / 2**20


def branch_rows(dev: torch.device, r: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    xs = torch.randn(B, D, device=dev)
    br = [[torch.randn(D, D, device=dev) / 16 for _ in range(6)] for _ in range(4)]

    def one_stream(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(ws, x) for ws in br], -1)

    want = one_stream(xs)
    rows: dict[str, Callable[[], Any]] = {"eager": lambda: one_stream(xs)}
    g1 = capture_graph(lambda: one_stream(xs))[0]
    rows["cuda graph, one stream"] = g1.replay
    g4 = capture_graph(lambda: by_hand_four_streams(br, [torch.cuda.Stream() for _ in br])(xs))[0]
    rows["cuda graph, four streams by hand"] = g4.replay
    for mode in ("graph", "trace"):
        for n in (1, 4):
            exe, mib = reserved_by(lambda: flowexec.compile(one_stream, xs, mode=mode, streams=n))
            r[f"flowexec {mode}, streams={n} reserved_MiB"] = mib
            torch.testing.assert_close(exe(xs), want, rtol=1e-5, atol=1e-5)
            r[f"flowexec {mode}, streams={n} plan"] = {k: exe.plan.stats()[k] for k in ("ops", "streams", "events")}
            rows[f"flowexec {mode}, streams={n}"] = (lambda exe=exe: exe(xs))
    return rows


def step_rows(dev: torch.device, r: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    base = make_mlp(256, 8).to(dev)
    x, y = torch.randn(32, 256, device=dev), torch.randint(0, 10, (32,), device=dev)
    rows: dict[str, Callable[[], Any]] = {}
    ref_model = copy.deepcopy(base)
    ref = make_step(ref_model, torch.optim.SGD(ref_model.parameters(), lr=1e-3), F.cross_entropy)
    rows["eager step"] = lambda: ref(x, y)
    for n in (1, 2, 4):
        m = copy.deepcopy(base)
        step = make_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), F.cross_entropy)
        exe, mib = reserved_by(lambda: flowexec.compile(step, x, y, mode="graph", streams=n))
        r[f"flowexec graph step, streams={n} reserved_MiB"] = mib
        check = copy.deepcopy(base)
        check_step = make_step(check, torch.optim.SGD(check.parameters(), lr=1e-3), F.cross_entropy)
        for _ in range(2):  # same losses and parameters as eager from the same start
            torch.testing.assert_close(exe(x, y), check_step(x, y), rtol=1e-5, atol=1e-5)
        for p, q in zip(m.parameters(), check.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
        r[f"flowexec graph step, streams={n} plan"] = {k: exe.plan.stats()[k] for k in ("ops", "streams", "events")}
        rows[f"flowexec graph step, streams={n}"] = (lambda exe=exe: exe(x, y))
    return rows


GPT2_SIZES = {  # step_time.py's configs: (config, batch, sequence)
    "gpt2_tiny": (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=32), 2, 16),
    "gpt2_small": (dict(n_layer=4, n_embd=256, n_head=4, vocab_size=5000, n_positions=128), 8, 128),
}


def gpt2_rows(size: str, dev: torch.device, r: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """GPT-2 (step_time.py's ``size`` config) through the torch.compile backend in graph mode,
    one stream against four; AdamW stays eager, as in step_time."""
    import functools

    import transformers

    from flowexec.models import make_lm_step

    cfg_kw, b, t = GPT2_SIZES[size]
    cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **cfg_kw)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).to(dev)
    ids = torch.randint(0, cfg_kw["vocab_size"], (b, t), device=dev)
    rows: dict[str, Callable[[], Any]] = {}
    for name, options in (("eager", None), ("flowexec graph, streams=1", {"mode": "graph"}),
                          ("flowexec graph, streams=4", {"mode": "graph", "streams": 4})):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        torch._dynamo.reset()
        fwd = m if options is None else torch.compile(m, backend="flowexec", options=options)
        rows[name] = functools.partial(make_lm_step(fwd, opt), ids)
        r[f"{name} reserved_MiB"] = reserved_by(lambda: [rows[name]() for _ in range(3)])[1]  # compiles and captures
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=25)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/streams.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": "PYTHONPATH=. python3 benchmarks/streams.py " + " ".join(sys.argv[1:]),
        "commit": os.environ.get("FLOWEXEC_COMMIT", "unknown"),  # the device machine's git may be stale
        "timing": "median µs per call including a synchronize, alternating rounds",
    }
    builds: dict[str, Callable[..., Any]] = {"branches": branch_rows, "mlp_step": step_rows}
    builds.update({size: functools.partial(gpt2_rows, size) for size in GPT2_SIZES})
    # the capture stream's cuBLAS workspace, made before any row's build is measured
    a = torch.randn(8, 8, device=dev)
    capture_graph(lambda: a @ a)
    for name, build in builds.items():
        facts: dict[str, Any] = {}
        rows = build(dev, facts)
        for fn in rows.values():
            for _ in range(10):
                fn()
        sync()
        times = interleaved(rows, sync, args.rounds, args.per_round)
        first = next(iter(times))
        res[name] = {"us": times, "vs_" + first: {k: times[first] / v for k, v in times.items()}, **facts}
        for k, v in times.items():
            print(f"{name:9s} {k:36s} {v:9.1f} µs  {times[first] / v:5.2f}× {first}", flush=True)
    b = res["branches"]["us"]
    res["branches"]["four_over_one"] = {
        "by hand (cuda graph)": b["cuda graph, one stream"] / b["cuda graph, four streams by hand"],
        "flowexec graph": b["flowexec graph, streams=1"] / b["flowexec graph, streams=4"],
        "flowexec trace": b["flowexec trace, streams=1"] / b["flowexec trace, streams=4"],
    }
    print(json.dumps(res["branches"]["four_over_one"], indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "streams.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
