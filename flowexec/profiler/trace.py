"""Merged spans as the Trace Event Format (JSON; opens in https://ui.perfetto.dev and
chrome://tracing).

One process per rank (``pid = rank + 1``: Perfetto treats pid 0 specially), named by ``M``
events, with threads (integer ``tid``) for rows: ``steps`` (one slice per step, covering the
rank's spans of that step, and an instant line at its start), ``compute`` (the jobs),
``transfers`` (sends and receives), ``waits`` (time blocked on a receive), and one row per
other stream (instruction profiles). Each span is an ``X`` slice named like ``F mb3``, its kind
as ``cat``, a legal ``cname`` colour per kind, and step, stage, micro-batch, clock, issue time in
``args``. A flow arrow (``s`` → ``f``, one ``id`` per pair) goes from each send to the receive it
feeds on the other rank, matched by (sender, receiver, tag, step). Times are µs from the
earliest span.

>>> from .records import Span
>>> sp = lambda r, k, st, a, b, **kw: Span(r, "h", 1, 0, r, k, 0, st, a, b, "host", **kw)
>>> t = trace_events([sp(0, "F", "compute", 0, 4000), sp(0, "send", "comm", 4000, 5000, peer=1, tag=0),
...                   sp(1, "recv", "comm", 1000, 6000, peer=0, tag=0), sp(1, "F", "compute", 6000, 9000)])
>>> sorted({e["ph"] for e in t["traceEvents"]})
['M', 'X', 'f', 'i', 's']
>>> [e["name"] for e in t["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]
['F mb0', 'send mb0', 'recv mb0', 'F mb0']
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from .records import JOB_KINDS, Span

# Chrome's trace viewer accepts only its reserved colour names for ``cname`` (catapult's
# color_scheme.js); anything else is ignored or rejected. Their RGB, for the HTML page.
LEGAL_COLOURS: dict[str, tuple[int, int, int]] = {
    "thread_state_uninterruptible": (182, 125, 143), "thread_state_iowait": (255, 140, 0),
    "thread_state_running": (126, 200, 148), "thread_state_runnable": (133, 160, 210),
    "thread_state_sleeping": (240, 240, 240), "thread_state_unknown": (199, 155, 125),
    "background_memory_dump": (0, 180, 180), "light_memory_dump": (0, 0, 180),
    "detailed_memory_dump": (180, 0, 180), "vsync_highlight_color": (0, 0, 255),
    "generic_work": (125, 125, 125), "good": (0, 125, 0), "bad": (180, 125, 0), "terrible": (180, 0, 0),
    "black": (0, 0, 0), "grey": (221, 221, 221), "white": (255, 255, 255), "yellow": (255, 255, 0),
    "olive": (100, 100, 0), "rail_response": (67, 135, 253), "rail_animation": (244, 74, 63),
    "rail_idle": (238, 142, 0), "rail_load": (13, 168, 97), "startup": (230, 230, 0),
    "heap_dump_stack_frame": (128, 128, 128), "heap_dump_object_type": (0, 0, 255),
    "heap_dump_child_node_arrow": (204, 102, 0), "cq_build_running": (255, 255, 119),
    "cq_build_passed": (153, 238, 102), "cq_build_failed": (238, 136, 136), "cq_build_abandoned": (187, 187, 187),
    "cq_build_attempt_runnig": (222, 222, 75), "cq_build_attempt_passed": (103, 218, 35),
    "cq_build_attempt_failed": (197, 81, 81),
}
KIND_COLOUR = {"F": "rail_response", "B": "rail_load", "I": "cq_build_passed", "W": "bad", "OPT": "rail_animation",
               "send": "thread_state_runnable", "recv": "thread_state_uninterruptible", "wait": "thread_state_iowait",
               "step": "grey"}
OTHER_COLOUR = "generic_work"  # instructions and anything else
ROWS = {"steps": 1, "compute": 2, "comm": 3, "wait": 4}  # tid per row; other streams follow
ROW_NAMES = {"steps": "steps", "compute": "compute", "comm": "transfers", "wait": "waits"}


def colour(kind: str) -> str:
    """The legal ``cname`` of a span kind."""
    return KIND_COLOUR.get(kind, OTHER_COLOUR)


def span_name(s: Span) -> str:
    """``F mb3`` for a job, ``send mb3`` / ``recv mb3`` / ``wait mb3`` for transfers, ``step 4``
    for a step, else its name."""
    if s.kind == "step":
        return f"step {s.step}"
    if s.micro is not None and (s.kind in JOB_KINDS or s.kind in ("send", "recv", "wait")):
        return f"{s.kind} mb{s.micro}"
    return s.name or s.kind


def row_of(s: Span) -> str:
    """The row a span is drawn on: jobs on ``compute``, transfers on ``comm``, waits on ``wait``,
    anything else on its own stream's row."""
    if s.kind in JOB_KINDS:
        return "compute"
    if s.kind in ("send", "recv"):
        return "comm"
    if s.kind == "wait":
        return "wait"
    if s.kind == "step":
        return "steps"
    return s.stream


def lane_rows(spans: list[Span]) -> list[str]:
    """Each span's row, with spans that overlap on one row spread over extra lanes (``comm#1``,
    ``comm#2`` ...): slices on one thread must nest, and receives posted up front overlap each
    other without nesting. Greedy, in start order: a span goes to the first lane free by then.

    >>> sp = lambda a, b: Span(0, "h", 1, 0, 0, "recv", 0, "comm", a, b, "host")
    >>> lane_rows([sp(0, 10), sp(2, 20), sp(12, 15)])
    ['comm', 'comm#1', 'comm']
    """
    order = sorted(range(len(spans)), key=lambda i: (spans[i].rank, spans[i].start_ns, -spans[i].end_ns))
    free: dict[tuple[int, str], list[int]] = {}  # (rank, row) -> each lane's end
    out = [""] * len(spans)
    for i in order:
        s = spans[i]
        ends = free.setdefault((s.rank, row_of(s)), [])
        lane = next((k for k, e in enumerate(ends) if e <= s.start_ns), len(ends))
        if lane == len(ends):
            ends.append(s.end_ns)
        else:
            ends[lane] = s.end_ns
        out[i] = row_of(s) if lane == 0 else f"{row_of(s)}#{lane}"
    return out


def row_name(row: str) -> str:
    """``transfers``, ``transfers 2`` (a second lane), ``stream cuda s1`` ..."""
    base, _, lane = row.partition("#")
    name = ROW_NAMES.get(base, f"stream {base}")
    return f"{name} {int(lane) + 1}" if lane else name


def pair_flows(spans: Iterable[Span]) -> list[tuple[Span, Span]]:
    """``(send, recv)`` pairs: a send from rank a to peer b with tag t in step k feeds the
    receive on b from peer a with the same tag and step (the n-th such send the n-th receive)."""
    sends: dict[tuple, list[Span]] = {}
    recvs: dict[tuple, list[Span]] = {}
    for s in spans:
        if s.peer is None:
            continue
        if s.kind == "send":
            sends.setdefault((s.rank, s.peer, s.tag, s.step), []).append(s)
        elif s.kind == "recv":
            recvs.setdefault((s.peer, s.rank, s.tag, s.step), []).append(s)
    out = []
    for key, ss in sends.items():
        for a, b in zip(sorted(ss, key=lambda s: s.start_ns), sorted(recvs.get(key, []), key=lambda s: s.start_ns)):
            out.append((a, b))
    return out


def trace_events(spans: Iterable[Span], meta: Mapping[str, Any] | None = None,
                 flows: Iterable[tuple[Span, Span]] = ()) -> dict[str, Any]:
    """The trace of merged ``spans`` (one clock), as a JSON-able dict. ``flows``: more arrows
    than the send → receive ones (an instruction profile's event record → wait pairs,
    :meth:`~.instructions.Timeline.flows`)."""
    spans = sorted(spans, key=lambda s: (s.rank, s.start_ns, s.end_ns))
    t0 = min((s.start_ns for s in spans), default=0)
    us = lambda ns: round((ns - t0) / 1e3, 3)  # noqa: E731
    events: list[dict[str, Any]] = []
    tid_of: dict[tuple[int, str], int] = {}
    placed = dict(zip(spans, lane_rows(spans)))  # by value: flows may pass equal copies
    lane = placed.__getitem__
    for rank in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == rank]
        pid = rank + 1
        host = mine[0].host
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {rank} ({host}, pid {mine[0].pid})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": rank}})
        rows = {lane(s) for s in mine}
        base = sorted({r.partition("#")[0] for r in rows} - set(ROWS))
        order = [r for r in ROWS] + base  # each row, then its extra lanes right below it
        extra = sorted(rows - set(order), key=lambda r: (order.index(r.partition("#")[0]), int(r.partition("#")[2])))
        tids = {**ROWS, **{name: len(ROWS) + 1 + i for i, name in enumerate(base)}}
        tids.update({r: 1000 * int(r.partition("#")[2]) + tids[r.partition("#")[0]] for r in extra})
        tid_of.update({(rank, row): tid for row, tid in tids.items()})
        used = {"steps"} | rows
        for row, tid in tids.items():
            if row in used:
                sort = order.index(row.partition("#")[0]) * 1000 + int(row.partition("#")[2] or 0)
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": row_name(row)}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": sort}})
        timed = {s.step for s in mine if s.kind == "step"}  # the trainer timed these steps itself
        for step in sorted({s.step for s in mine}):
            ss = [s for s in mine if s.step == step]
            lo, hi = min(s.start_ns for s in ss), max(s.end_ns for s in ss)
            if step not in timed:
                events.append({"ph": "X", "name": f"step {step}", "cat": "step", "pid": pid, "tid": ROWS["steps"],
                               "ts": us(lo), "dur": round((hi - lo) / 1e3, 3), "cname": colour("step"),
                               "args": {"step": step, "spans": len(ss)}})
            events.append({"ph": "i", "s": "p", "name": f"step {step}", "cat": "step", "pid": pid,
                           "tid": ROWS["steps"], "ts": us(lo)})
        for s in mine:
            args: dict[str, Any] = {"step": s.step, "stage": s.stage, "micro": s.micro, "clock": s.clock,
                                    "stream": s.stream}
            if s.issue_ns is not None:
                args["issued_us"] = us(s.issue_ns)
            for k in ("peer", "tag", "name"):
                if getattr(s, k) is not None:
                    args[k] = getattr(s, k)
            events.append({"ph": "X", "name": span_name(s), "cat": s.kind, "pid": pid, "tid": tids[lane(s)],
                           "ts": us(s.start_ns), "dur": round(s.duration_ns / 1e3, 3), "cname": colour(s.kind),
                           "args": args})
    arrows = [(a, b, "transfer") for a, b in pair_flows(spans)] + [(a, b, "event") for a, b in flows]
    for fid, (a, b, cat) in enumerate(arrows, start=1):
        if a.micro is not None:
            name = f"mb{a.micro} r{a.rank}→r{b.rank}"
        else:
            name = f"r{a.rank}→r{b.rank}" if a.rank != b.rank else f"{a.stream}→{b.stream}"
        inside = min(1_000, b.duration_ns // 2)  # an f event binds to the slice around its ts
        events.append({"ph": "s", "id": fid, "name": name, "cat": cat, "pid": a.rank + 1,
                       "tid": tid_of[(a.rank, lane(a))], "ts": us(a.start_ns)})
        events.append({"ph": "f", "bp": "e", "id": fid, "name": name, "cat": cat, "pid": b.rank + 1,
                       "tid": tid_of[(b.rank, lane(b))], "ts": us(b.end_ns - inside)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "flowexec timeline", "origin_ns": t0, **(meta or {})}}


def write_trace(spans: Iterable[Span], path: str, meta: Mapping[str, Any] | None = None) -> str:
    """Write :func:`trace_events` to ``path``; returns ``path``."""
    with open(path, "w") as f:
        json.dump(trace_events(spans, meta), f)
    return path
