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

from typing import Callable

from .merge import merge_dir
from .page import write_page
from .records import Span
from .summary import format_summary, summarize
from .trace import write_trace


def theory_of(meta: dict) -> object:
    """The schedule's theoretical bubble the records' meta carries: per rank, or one figure."""
    th = meta.get("theory_bubble_per_rank") or meta.get("theory_bubble")
    return {int(k): v for k, v in th.items()} if isinstance(th, dict) else th


def merge_command(directory: str, out: str, html: str | None = None,
                  predict: Callable[[dict, list[Span]], dict[int, float] | None] | None = None) -> str:
    """Merge ``directory``'s records, write the trace to ``out`` (and the page to ``html``);
    returns what to print: the summary table and the paths. ``predict(meta, spans)``: the
    schedule's bubble per rank at the measured job costs (``flowexec timeline`` passes
    :func:`flowexec.pipeline.theory.theory_at_measured_costs`: the profiler reads records and
    does not know schedules)."""
    merged = merge_dir(directory)
    meta = merged.meta()
    measured = predict(meta, merged.spans) if predict is not None else None
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
