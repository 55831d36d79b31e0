"""What flowexec's capture costs beyond torch's own tracing (issue 36: the warm build).

A warm build's largest phase is the capture: ``make_fx`` tracing the whole step (forward,
backward, optimizer) on fake tensors. This probe times, in one process and alternating over
``--rounds``, four runs of GPT-2 124M's step (Hugging Face, dropout 0, bf16 autocast, fused
AdamW, as ``benchmarks/scale.py``):

- ``fake_run``: the forward and backward on fake tensors under a dispatch mode that only
  records each op (no graph): what a check that replays the step would cost;
- ``make_fx``: torch's ``make_fx`` of the forward and backward alone (fake tensors);
- ``flowexec_fwd_bwd``: flowexec's capture of the same forward and backward
  (``flowexec.compile``'s build phase ``capture``: guards, hyperparameters, fake run);
- ``flowexec_step``: flowexec's capture of the whole step with its optimizer;
- ``step_replay``: the replay a later process runs before it takes a kept program of that step
  (``flowexec.capture.replay``: the step on fake tensors under the capture's modes, no graph,
  its ops logged), checked to log what the capture logged.

    python3 benchmarks/probes/capture_cost.py --device cpu --batch 1 --seq 64 --out results
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import scale  # noqa: E402  (the workload and its step)
from host_meta import host_meta  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--foreach", action="store_true", help="AdamW's foreach step (AdamW's default) instead of fused")
    ap.add_argument("--out", default="benchmarks/results/probes")
    a = ap.parse_args()
    os.environ["FLOWEXEC_KEEP"] = "0"  # (each build captures: a kept program would be loaded instead)

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    import flowexec

    dev = torch.device(a.device)
    w = scale.build("gpt2_124m", dev, False)
    x = w.x[: a.batch, : a.seq].contiguous()

    def fwd_bwd(x):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = w.loss(w.module, x, x)
        loss.backward()
        return loss.detach()

    def clear() -> None:
        for p in w.module.parameters():
            p.grad = None

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def fake_run() -> tuple[float, int]:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        t = time.perf_counter()
        with mode, Ops() as ops:
            fwd_bwd(mode.from_tensor(x))
        return time.perf_counter() - t, ops.n

    def plain_make_fx() -> tuple[float, int]:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        t = time.perf_counter()
        with torch._guards.tracing(torch._guards.TracingContext(mode)):
            gm = make_fx(fwd_bwd, tracing_mode="fake", _allow_non_fake_inputs=True)(mode.from_tensor(x))
        return time.perf_counter() - t, len(gm.graph.nodes)

    def flowexec_capture(fn, *args) -> tuple[float, int]:
        exe = flowexec.compile(fn, mode="trace", fuse=False)
        exe(*args)
        return exe.build_phases["capture"], exe.plan.stats()["ops"]

    opt = torch.optim.AdamW(w.module.parameters(), lr=1e-4, fused=not a.foreach, foreach=a.foreach or None)
    step = scale.make_step(w, w.module, opt, dev)
    step(x, x)  # (AdamW's state made: the captures below capture the steps)
    from flowexec.capture import capture, replay

    kept_log = capture(step, (x, x), guarded=True, log_ops=True).log
    state = [t for t in kept_log.state if isinstance(t, torch.Tensor)]

    def step_replay() -> tuple[float, int]:
        t = time.perf_counter()
        seen = replay(step, (x, x), kept_log.flags, hold=state)  # (as a build replays: flowexec/executable.py)
        took = time.perf_counter() - t
        if seen.log.entries != kept_log.entries:
            raise SystemExit("the replay logged other ops than the capture")
        return took, len(seen.log.entries)

    runs = {"fake_run": fake_run, "make_fx": plain_make_fx,
            "flowexec_fwd_bwd": lambda: flowexec_capture(fwd_bwd, x),
            "flowexec_step": lambda: flowexec_capture(step, x, x), "step_replay": step_replay}
    times: dict[str, list[float]] = {k: [] for k in runs}
    sizes: dict[str, int] = {}
    for r in range(a.rounds + 1):  # (round 0 warms each path: imports, decomposition tables)
        for k, run in runs.items():
            clear()
            s, n = run()
            if r:
                times[k].append(round(s, 3))
            sizes[k] = n
            print(f"round {r} {k}: {s:.2f} s ({n})", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"probe": "capture_cost", "meta": host_meta(" ".join(sys.argv)), "adamw": "foreach" if a.foreach else "fused",
           "python": sys.version.split()[0], "workload": f"{w.desc}, timed at batch {a.batch} x {a.seq}",
           "seconds": times, "median_s": med, "ops_or_nodes": sizes,
           "flowexec_fwd_bwd_over_make_fx": round(med["flowexec_fwd_bwd"] / med["make_fx"], 3),
           "fake_run_over_make_fx": round(med["fake_run"] / med["make_fx"], 3),
           "step_replay_over_step_capture": round(med["step_replay"] / med["flowexec_step"], 3)}
    os.makedirs(a.out, exist_ok=True)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    tag = next((w.lower() for w in name.split() if w[:1] in "HAB" and w[1:].isdigit()), name.split()[-1].lower())
    path = os.path.join(a.out, f"capture_cost_{tag}_py{sys.version_info[0]}{sys.version_info[1]}"
                               f"{'_foreach' if a.foreach else ''}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("median_s", "flowexec_fwd_bwd_over_make_fx", "fake_run_over_make_fx",
                                          "step_replay_over_step_capture")}))
    print("wrote", path)


if __name__ == "__main__":
    main()
