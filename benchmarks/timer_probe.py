"""Probe: what a JobTimer span costs on CUDA, beside the same loop of MLP trace steps without it.

    PYTHONPATH=. python3 benchmarks/timer_probe.py     # prints µs per step (median of 5 rounds, each round)

Kinds: off (no timer), events_only (two bare torch.cuda.Event records per step), no_flush
(begin/end, one finish at the end), full (begin/end/flush per step, as the trainer does), nowork
(the timer alone, no step).
"""
import statistics
import time

import torch

import flowexec
from flowexec.profiler.timers import JobTimer

dev = torch.device("cuda")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def step(x, y):
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.cross_entropy(model(x), y); loss.backward(); opt.step(); return loss
x, y = torch.randn(32, 256, device=dev), torch.randint(0, 10, (32,), device=dev)
exe = flowexec.compile(step, x, y, mode="trace")
timer = JobTimer(dev)
N = 50
def loop(kind):
    torch.cuda.synchronize(); t0 = time.perf_counter_ns()
    for k in range(N):
        if kind == "off":
            exe(x, y)
        elif kind == "nowork":
            tok = timer.begin(step=k, stage=0, kind="F", micro=0); timer.end(tok); timer.flush()
        elif kind == "no_flush":
            tok = timer.begin(step=k, stage=0, kind="F", micro=0); exe(x, y); timer.end(tok)
        elif kind == "full":
            tok = timer.begin(step=k, stage=0, kind="F", micro=0); exe(x, y); timer.end(tok); timer.flush()
        elif kind == "events_only":
            a = torch.cuda.Event(enable_timing=True); a.record(); exe(x, y); b = torch.cuda.Event(enable_timing=True); b.record()
    if kind in ("no_flush", "full", "nowork"):
        timer.finish()
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - t0) / 1e3 / N
for k in ("off", "full"): loop(k)
res = {k: [] for k in ("off", "events_only", "no_flush", "full", "nowork")}
for _ in range(5):
    for k in res: res[k].append(loop(k))
for k, v in res.items(): print(f"{k:12s} {statistics.median(v):8.1f} us/step  {[round(t) for t in v]}")
