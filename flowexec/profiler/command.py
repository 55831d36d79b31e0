"""``flowexec timeline``: merge a directory of records into a trace (and the page), print the
summary.

>>> import tempfile, os
>>> from .io import Header, write_records, rank_file
>>> from .records import Span
>>> d = tempfile.mkdtemp()
>>> _ = write_records(rank_file(d, 0), Header(0, "h", 1), [Span(0, "h", 1, 0, 0, "F", 0, "compute", 0, 10, "host")])
>>> print(merge_command(d, os.path.join(d, "t.json")).splitlines()[-1])  # doctest: +ELLIPSIS
trace: .../t.json (open in https://ui.perfetto.dev or chrome://tracing)
"""
from __future__ import annotations

from .merge import merge_dir
from .page import write_page
from .summary import format_summary, summarize
from .trace import write_trace


def theory_of(meta: dict) -> object:
    """The schedule's theoretical bubble the records' meta carries: per rank, or one figure."""
    th = meta.get("theory_bubble_per_rank") or meta.get("theory_bubble")
    return {int(k): v for k, v in th.items()} if isinstance(th, dict) else th


def theory_at_measured_costs(meta: dict, spans: list) -> dict[int, float] | None:
    """Per rank, the bubble ``pipeline.simulate`` predicts for the records' schedule if every job
    took its kind's measured mean (over all ranks): what the schedule costs at these job times,
    before host overhead and transfer latency. None when the meta does not name a schedule."""
    from ..pipeline.schedules import get_schedule, simulate
    from .records import JOB_KINDS

    try:
        plan = get_schedule(meta["schedule"])(meta["n_ranks"], meta["n_micro"], meta.get("n_stages"))
    except (KeyError, ValueError, TypeError):
        return None
    durs: dict[str, list[int]] = {}
    for s in spans:
        if s.kind in JOB_KINDS:
            durs.setdefault(s.kind, []).append(s.duration_ns)
    mean = {k: sum(v) / len(v) for k, v in durs.items()}
    if "F" not in mean:
        return None
    if "I" in mean:  # split backward: (T_F, T_I, T_W)
        costs = (mean["F"], mean["I"], mean.get("W", 0.0))
    else:  # whole backwards: T_B + T_W is one B
        costs = (mean["F"], mean.get("B", mean["F"]), 0.0)
    sim = simulate(plan, costs=costs)
    return {r: sim.idle[r] / sim.makespan for r in sim.idle}


def merge_command(directory: str, out: str, html: str | None = None) -> str:
    """Merge ``directory``'s records, write the trace to ``out`` (and the page to ``html``);
    returns what to print: the summary table and the paths."""
    merged = merge_dir(directory)
    meta = merged.meta()
    measured = theory_at_measured_costs(meta, merged.spans)
    if measured is not None:
        meta["theory_bubble_measured_costs"] = measured
    offsets = {r: (h.clock_offset_ns, h.clock_rtt_ns) for r, h in merged.headers.items()}
    write_trace(merged.spans, out, meta)
    lines = [f"{len(merged.spans)} spans of {len(merged.ranks)} rank(s) from {directory}",
             format_summary(summarize(merged.spans, theory_of(meta)), measured), ""]
    if html:
        write_page(merged.spans, html, meta, offsets)
        lines.append(f"page: {html}")
    lines.append(f"trace: {out} (open in https://ui.perfetto.dev or chrome://tracing)")
    return "\n".join(lines)
