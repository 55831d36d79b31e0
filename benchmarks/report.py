"""Print the README's performance tables (markdown) from benchmarks/results/*.json.

    python3 benchmarks/report.py            # print
    python3 benchmarks/report.py --readme   # rewrite the block between the report markers in docs/results.md
    python3 benchmarks/report.py --pool benchmarks/results/ops_*_r15_*.json   # lerp rounds of several runs pooled

Every figure comes from a results file written by a benchmark script; nothing here measures.
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Any

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load(name: str) -> dict[str, Any]:
    path = os.path.join(HERE, name)
    return json.load(open(path)) if os.path.exists(path) else {}


def us(v: Any) -> str:
    return f"{v:,.0f} µs" if isinstance(v, (int, float)) else "–"


def ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}×" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "–"


def step_time() -> None:
    d = load("step_time.json")
    if not d:
        return
    print(f"Training steps — {d['device']}, torch {d['torch']}, {d['date'][:10]} "
          f"(`{d['command']}`; rows of one table are timed in alternating rounds, median):\n")
    m = d.get("mlp", {})
    print("| MLP 8×256, batch 32, SGD | step | speed-up vs eager |")
    print("|---|---|---|")
    for key, label in [("eager", "eager"), ("inductor", "torch.compile (inductor)"),
                       ("make_fx_python", "make_fx graph as Python"), ("flowexec_trace", "flowexec trace"),
                       ("raw_cuda_graph", "raw CUDA graph of the eager step"), ("flowexec_graph", "flowexec graph"),
                       ("flowexec_graph_static_inputs", "flowexec graph, inputs in its buffers")]:
        if f"{key}_us" in m:
            print(f"| {label} | {us(m[key + '_us'])} | {ratio(m['eager_us'], m[key + '_us'])} |")
    print(f"\nflowexec graph / raw CUDA graph: {ratio(m.get('flowexec_graph_us'), m.get('raw_cuda_graph_us'))} "
          f"(inputs in its buffers: {ratio(m.get('flowexec_graph_static_inputs_us'), m.get('raw_cuda_graph_us'))}); "
          f"trace / make_fx Python: {ratio(m.get('flowexec_trace_us'), m.get('make_fx_python_us'))}; "
          f"build (capture + plan + lower): {m.get('flowexec_trace_build_s', 0):.2f} s; "
          f"peak memory of a step, trace / eager: {ratio(m.get('flowexec_trace_peak_bytes'), m.get('eager_peak_bytes'))} "
          f"({m.get('flowexec_trace_peak_bytes', 0) / 2**20:.2f} / {m.get('eager_peak_bytes', 0) / 2**20:.2f} MiB).\n")
    b = d.get("transformer_block", {})
    if b:
        print(f"Transformer block (Adam): eager {us(b.get('eager_us'))}, inductor {us(b.get('inductor_us'))}, "
              f"flowexec trace {us(b.get('flowexec_trace_us'))}, flowexec graph {us(b.get('flowexec_graph_us'))} "
              f"({ratio(b.get('eager_us'), b.get('flowexec_graph_us'))} faster than eager).\n")
    print("| GPT-2 training step (torch.compile backend) | eager | inductor | cudagraphs | flowexec graph | vs eager / inductor / cudagraphs | warm-up: cudagraphs / flowexec |")
    print("|---|---|---|---|---|---|---|")
    for tag, label in (("tiny", "2 layers, 64 wide, batch 2×16"), ("small", "4 layers, 256 wide, batch 8×128")):
        h = d.get(f"hf_gpt2_{tag}", {})
        if not h:
            continue
        fx = h.get("flowexec_graph_us")
        print(f"| {label} | {us(h.get('eager_us'))} | {us(h.get('inductor_us'))} | {us(h.get('cudagraphs_us'))} | {us(fx)} | "
              f"{ratio(h.get('eager_us'), fx)} / {ratio(h.get('inductor_us'), fx)} / {ratio(h.get('cudagraphs_us'), fx)} | "
              f"{h.get('cudagraphs_warmup_s', 0):.1f} s / {h.get('flowexec_graph_warmup_s', 0):.1f} s |")
    print()


# The newest run of the four reference cases (the README's main lerp table); ``ops.json`` is the
# last run of every case (float16, bfloat16 and float-weight variants too), whose kernels for
# those variants have not changed since.
LERP_RUN = "ops_fbadecc_r15_c.json"


def lerp() -> None:
    d = load(LERP_RUN) or load("ops.json")
    if not d:
        return
    print(f"Fused lerp forward+backward — {d['device']}, {d['date'][:10]}, commit {d.get('commit', '?')} "
          f"(`{d['command']}`):\n")
    names = [n for n in ("case1", "case2", "case3", "case4") if n in d["cases"]]
    print("| case | GPU fwd+bwd PyTorch → flowexec | ÷ memory floor (graph / kernels) "
          "| wall fwd+bwd (do_bench) PyTorch → flowexec | wall bound: one / three gradients "
          "| wall fwd PyTorch → flowexec |")
    print("|---|---|---|---|---|---|")
    for name in names:
        c = d["cases"][name]
        t, f = c["torch"], c["flowexec"]
        bound = " / ".join(f"{c[k]:.2f}×" if k in c else "–" for k in ("wall_speedup_bound", "wall_speedup_bound3"))
        print(f"| {name}: x {c['x']} y {c['y']} w {c['w']} {c['dtype']} "
              f"| {t['gpu_fwd_bwd_us']:.1f} → {f['gpu_fwd_bwd_us']:.1f} µs ({t['gpu_fwd_bwd_us'] / f['gpu_fwd_bwd_us']:.2f}×) "
              f"| {c['flowexec_gpu_over_floor']:.2f} / {c['flowexec_kernels_over_floor']:.2f} "
              f"| {t['wall_fwd_bwd_us']:.0f} → {f['wall_fwd_bwd_us']:.0f} µs ({t['wall_fwd_bwd_us'] / f['wall_fwd_bwd_us']:.2f}×) "
              f"| {bound} | {t['wall_fwd_us']:.1f} → {f['wall_fwd_us']:.1f} µs |")
    print("\nWall bound: PyTorch's median wall time over that of a floor op, measured in the same alternating "
          "rounds. One gradient: `t * 2` and its backward on one output-sized tensor (one launch each way). Three "
          "gradients: `torch.cat` of three leaves (together the output's size: one of all but two elements, two of "
          "one): one launch forward, a "
          "backward of views only. Every gradient that reaches a leaf is a task of its own for autograd's engine, "
          "and lerp returns three, so the three-gradient bound is about the most any implementation of it could gain "
          "by wall time on that host (each bound is a ratio of medians over rounds that vary by tens of percent, so "
          "one run can land on either side of it).\n")
    lerp_variants()


def lerp_variants() -> None:
    """The float16, bfloat16 and float-weight cases of the last run of every case (``ops.json``)."""
    d = load("ops.json")
    names = [n for n in d.get("cases", {}) if n not in ("case1", "case2", "case3", "case4")]
    if not names:
        return
    print(f"Variants — {d['device']}, {d['date'][:10]}, commit {d.get('commit', '?')} (`{d['command']}`; "
          "their kernels have not changed since):\n")
    print("| case | GPU fwd+bwd PyTorch → flowexec | ÷ memory floor (kernels) | wall fwd+bwd PyTorch → flowexec "
          "| wall fwd PyTorch → flowexec |")
    print("|---|---|---|---|---|")
    for name in names:
        c = d["cases"][name]
        t, f = c["torch"], c["flowexec"]
        print(f"| {name}: x {c['x']} y {c['y']} w {c['w']} {c['dtype']} "
              f"| {t['gpu_fwd_bwd_us']:.1f} → {f['gpu_fwd_bwd_us']:.1f} µs ({t['gpu_fwd_bwd_us'] / f['gpu_fwd_bwd_us']:.2f}×) "
              f"| {c['flowexec_kernels_over_floor']:.2f} "
              f"| {t['wall_fwd_bwd_us']:.0f} → {f['wall_fwd_bwd_us']:.0f} µs ({t['wall_fwd_bwd_us'] / f['wall_fwd_bwd_us']:.2f}×) "
              f"| {t['wall_fwd_us']:.1f} → {f['wall_fwd_us']:.1f} µs |")
    print()


LERP_GOALS = {"case1": 2.0, "case2": 1.5, "case3": 2.0, "case4": 1.5}  # issue 3's wall speed-ups


def cluster_interval(runs: list[list[float]], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of the pooled median: each draw resamples the runs, then the
    rounds within each drawn run, so that rounds of one run (one host) do not count as
    independent. Seeded: the same files give the same interval.

    >>> cluster_interval([[1.0, 1.0], [1.0]], draws=10)
    (1.0, 1.0)
    """
    import random

    runs = [r for r in runs if r]
    rng = random.Random(seed)
    meds = sorted(statistics.median([x for r in rng.choices(runs, k=len(runs)) for x in rng.choices(r, k=len(r))])
                  for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def pool_lerp(paths: list[str]) -> None:
    """The wall rounds of several ``benchmarks/ops.py`` runs taken together, per reference case:
    the median of the per-round ratios PyTorch ÷ flowexec, how many rounds meet the issue's goal,
    the same median against the floor ops (bounds), and flowexec − three-gradient floor op; then
    the forward alone: the median per-round ratio, and how many rounds and runs had it slower."""
    runs: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        with open(path) as fh:
            runs.append((os.path.basename(path), json.load(fh)["cases"]))
    rounds: dict[str, dict[str, list[float]]] = {}
    for _, cases in runs:
        for name in LERP_GOALS:
            wr = cases.get(name, {}).get("wall_rounds")
            if not wr:
                continue
            r = rounds.setdefault(name, {})
            for impl in ("torch", "flowexec", "floor", "floor3"):
                r.setdefault(impl, []).extend(wr.get(f"{impl}:wall_fwd_bwd_us", []))
    print(f"Wall rounds of {len(paths)} runs pooled (median of per-round ratios):\n")
    print("| case | rounds | PyTorch ÷ flowexec | rounds meeting the goal | bound: one / three gradients "
          "| flowexec − floor3 |")
    print("|---|---|---|---|---|---|")
    for name, r in rounds.items():
        t, f = r["torch"], r["flowexec"]
        ratios = [a / b for a, b in zip(t, f)]
        bounds = " / ".join(f"{statistics.median(a / b for a, b in zip(t, r[k])):.2f}×" if len(r.get(k, [])) == len(t)
                            else "–" for k in ("floor", "floor3"))
        gap = (f"{statistics.median(b - c for b, c in zip(f, r['floor3'])):.1f} µs"
               if len(r.get("floor3", [])) == len(f) else "–")
        met = sum(x >= LERP_GOALS[name] for x in ratios)
        print(f"| {name} | {len(ratios)} | {statistics.median(ratios):.2f}× | {met} (goal {LERP_GOALS[name]}×) "
              f"| {bounds} | {gap} |")
    for key, what in (("wall_fwd_us", "each round the median of do_bench's samples (runs since d5fe5ba: "
                       "the mean of two such medians, timed in mirrored order)"),
                      ("wall_fwd_tmean_us", "each round the 10%-trimmed mean of do_bench's samples (runs since "
                       "dd58279; since d5fe5ba of two calls in mirrored order)")):
        forward_rounds(runs, key, what)
    alternating = [(base, {n: cases[n]["alternating"] for n in LERP_GOALS if "alternating" in cases.get(n, {})})
                   for base, cases in runs]
    alternating = [(base, alt) for base, alt in alternating if alt]
    if alternating:
        print("\nCalls alternating, per run: PyTorch ÷ flowexec (three-gradient bound; the five stretches):\n")
        print("| run | " + " | ".join(LERP_GOALS) + " |")
        print("|---|" + "---|" * len(LERP_GOALS))
        for base, alt in alternating:
            cells = [f"{alt[n]['speedup']['wall_fwd_bwd_us']:.2f}× ({alt[n]['bound3']:.2f}; "
                     + " ".join(f"{v:.2f}" for v in alt[n]["segment_speedups"]) + ")" if n in alt else "–"
                     for n in LERP_GOALS]
            print(f"| {base} | " + " | ".join(cells) + " |")


def forward_rounds(runs: list[tuple[str, dict[str, Any]]], key: str, what: str) -> None:
    """The pooled table of the lerp forward's wall rounds (goal: never slower) by one figure."""
    rows = []
    for name in LERP_GOALS:
        per_run = [(wr.get(f"torch:{key}", []), wr.get(f"flowexec:{key}", []))
                   for wr in (cases.get(name, {}).get("wall_rounds") for _, cases in runs) if wr]
        per_run = [(t, f) for t, f in per_run if t and f]
        ratios = [a / b for t, f in per_run for a, b in zip(t, f)]
        if not ratios:
            continue
        slower_runs = sum(statistics.median(t) < statistics.median(f) for t, f in per_run)
        lo, hi = cluster_interval([[a / b for a, b in zip(t, f)] for t, f in per_run])
        rows.append(f"| {name} | {len(ratios)} | {statistics.median(ratios):.4f} | {lo:.4f}–{hi:.4f} "
                    f"| {sum(x < 1 for x in ratios)} | {slower_runs} of {len(per_run)} |")
    if not rows:
        return
    print(f"\nForward alone (goal: never slower), wall rounds pooled, {what}; the interval resamples runs, "
          "then rounds within them (rounds of one run share a host):\n")
    print("| case | rounds | PyTorch ÷ flowexec, median per round | 95% interval | rounds slower "
          "| runs slower (by the run's medians) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


def pipeline() -> None:
    d = load("pipeline_gloo.json")
    if not d or "goals" not in d:  # written by the benchmark before PipelineTrainer: a different table
        return
    c = d["config"]
    ends = f"an input layer Linear({c['in_width']}, {c['width']}) + tanh, " if c.get("in_width") else ""
    head = f", a head Linear({c['width']}, {c['out_width']})" if c.get("out_width") else ""
    if ends and not d.get("configs", {}).get("zbv", c).get("in_width"):
        head += " (ZBV: the blocks alone)"
    print(f"Pipeline-parallel training on CPU with gloo — {d['cpus']} CPUs, torch {d['torch']}, {d['date'][:10]}, "
          f"commit {d['commit']} (`{d['command']}`; {d['ranks']} ranks, {ends}{c['blocks']} blocks of Linear({c['width']}) "
          f"+ tanh{head}, batch {c['batch']} in {c['n_micro']} micro-batches, SGD, one thread per rank; median step of "
          f"the slowest rank over {len(next(iter(d['rounds'].values())))} alternating rounds; speedup: the median "
          "of the rounds' ratios):\n")
    print("| schedule | torch.distributed.pipelining | flowexec (compiled stages) | flowexec bubble, measured "
          "| bubble, simulated: equal costs / every stage's measured costs | losses vs one process |")
    print("|---|---|---|---|---|---|")
    for sched, r in d["summary"].items():
        print(f"| {sched} | {r['torch_schedule']} {r['torch_ms']:.1f} ms | {r['flowexec_ms']:.1f} ms "
              f"({r['speedup']:.2f}×) | {r['bubble_measured']:.1%} | {r['bubble_theory_equal_costs']:.1%} / "
              f"{r.get('bubble_theory_measured_stage_costs', r['bubble_theory_measured_costs']):.1%} "
              f"| {r['losses_max_rel_diff_vs_one_process']:.1e} |")
    print()


def gc_cpu() -> None:
    d = load("gc_cpu.json")
    if not d:
        return
    print(f"Garbage collectors on CPU — {d['cpus']} CPUs, torch {d['torch']}, {d['date'][:10]}, commit {d['commit']} "
          f"(`{d['command']}`; eight elementwise ops over 64 MiB tensors, each intermediate dying one op later; "
          "median call over alternating rounds):\n")
    print("| intra-op threads | eager | trace, `gc=\"fast\"` | trace, `gc=\"async\"` | async vs fast |")
    print("|---|---|---|---|---|")
    for k, r in d["results"].items():
        m = r["median_ms"]
        print(f"| {k.split()[0]} | {m['eager']:.1f} ms | {m['trace, gc=fast']:.1f} ms | {m['trace, gc=async']:.1f} ms "
              f"| {r['async_vs_fast']:.2f}× |")
    print()


def graph_inputs() -> None:
    d = load("graph_inputs.json")
    if not d:
        return
    print(f"Graph mode with optimizer state passed as arguments — {d['device']}, {d['date'][:10]}, commit "
          f"{d.get('commit', '?')} (`{d['command']}`; an Adam-like step that writes four of its five arguments in "
          "place; alternating rounds, median per call with a sync):\n")
    cases = d["cases"]
    names = list(cases)
    print("| variant | " + " | ".join(f"{n} per tensor" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    labels = {"eager": "eager", "graph, staged": "graph, arguments copied in and back (before)",
              "graph, same tensors": "graph, written arguments read in place (default)",
              "graph, borrow=(1,)": "graph, + `borrow=(1,)` (the gradient too)",
              "raw CUDA graph": "raw CUDA graph of the eager step"}
    for key, label in labels.items():
        print(f"| {label} | " + " | ".join(
            f"{cases[n]['us'][key]:,.1f} µs ({cases[n]['speedup_vs_eager'][key]:.2f}×)" for n in names) + " |")
    print()


def item() -> None:
    d = load("item.json")
    s = d.get("summary")
    if not s:
        return
    meta = d["meta"]
    print(f"Scalar readback — {meta['device']}, {meta['date'][:10]} (`{meta['command']}`, backend {s['backend']}):\n")
    print("| figure | `.item()` | flowexec | ratio |")
    print("|---|---|---|---|")
    print(f"| idle CUDA scalar, `fast_item` | {s['item_idle_us']:.2f} µs | {s['fast_item_idle_us']:.2f} µs | {s['idle_ratio']:.2f} |")
    print(f"| right after `(y*2).sum()` | {s['item_after_kernel_us']:.2f} µs | {s['fast_item_after_kernel_us']:.2f} µs | {s['after_kernel_ratio']:.2f} |")
    t = d.get("training_loop_logging", {})
    if "step_us" in t:
        st = t["step_us"]
        print(f"\nMLP training loop logging its loss every step: flowexec graph with a Fetch handle "
              f"{st['flowexec_graph_fetch_every_step']:.0f} µs/step against {st['flowexec_graph']:.0f} µs without logging "
              f"({t['fetch_overhead'] * 100:+.1f}%); eager with `.item()` {st['eager_item_every_step']:.0f} against "
              f"{st['eager']:.0f} µs ({t['eager_item_overhead'] * 100:+.1f}%).")
    print()


def streams() -> None:
    path = os.path.join(HERE, "streams.json")
    if not os.path.exists(path):
        return
    d = load("streams.json")
    print(f"Several streams — {d['device']}, torch {d['torch']}, {d['date']}, commit {d['commit']} "
          f"(`{d['command']}`; {d['timing']}):\n")
    print("| four branches of 6 × (256-wide matmul + SiLU), batch 8 | call | vs eager | MiB reserved by the build |")
    print("|---|---|---|---|")
    for k, v in d["branches"]["us"].items():
        mib = d["branches"].get(f"{k} reserved_MiB")
        print(f"| {k} | {v:,.1f} µs | {d['branches']['vs_eager'][k]:.2f}× | {'–' if mib is None else f'{mib:,.0f}'} |")
    b = d["branches"]["four_over_one"]
    print(f"\nFour streams over one: by hand {b['by hand (cuda graph)']:.2f}×, flowexec graph "
          f"{b['flowexec graph']:.2f}×, flowexec trace {b['flowexec trace']:.2f}× (host time per switch and event).\n")
    m = d["mlp_step"]
    print("| MLP 8×256, batch 32, SGD step | step | vs eager | events planned | MiB reserved by the build |")
    print("|---|---|---|---|---|")
    for k, v in m["us"].items():
        plan, mib = m.get(f"{k} plan", {}), m.get(f"{k} reserved_MiB")
        print(f"| {k} | {v:,.1f} µs | {m['vs_eager step'][k]:.2f}× | {plan.get('events', '–')} "
              f"| {'–' if mib is None else f'{mib:,.0f}'} |")
    print("\nMiB reserved are measured in one process, row after row: a row also pays what no earlier row "
          "had made (a cuBLAS workspace, 32 MiB, per new thread and stream); the one-stream MLP row's 34 MiB are "
          "likely such first-build costs, not yet broken down.")
    for size, label in (("gpt2_tiny", "tiny: 2 layers, 64 wide, batch 2×16"),
                        ("gpt2_small", "small: 4 layers, 256 wide, batch 8×128")):
        g = d.get(size)
        if g:
            print(f"\n| GPT-2 {label} (torch.compile backend, AdamW eager) | step | vs eager | MiB reserved by 3 first steps |")
            print("|---|---|---|---|")
            for k, v in g["us"].items():
                mib = g.get(f"{k} reserved_MiB")
                print(f"| {k} | {v:,.1f} µs | {g['vs_eager'][k]:.2f}× | {'–' if mib is None else f'{mib:,.0f}'} |")
    print()


def main() -> None:
    import contextlib
    import io
    import sys

    if "--pool" in sys.argv:  # the paths follow it
        pool_lerp(sys.argv[sys.argv.index("--pool") + 1:])
        return
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        step_time()
        lerp()
        graph_inputs()
        item()
        streams()
        pipeline()
        gc_cpu()
    text = buf.getvalue()
    if "--readme" not in sys.argv:
        print(text, end="")
        return
    # The README keeps one compact table; the full tables live in docs/results.md.
    readme = os.path.join(os.path.dirname(HERE), "..", "docs", "results.md")
    s = open(readme).read()
    begin, end = "<!-- report:begin -->", "<!-- report:end -->"
    a, b = s.index(begin) + len(begin), s.index(end)
    open(readme, "w").write(s[:a] + "\n" + text + s[b:])


if __name__ == "__main__":
    main()
