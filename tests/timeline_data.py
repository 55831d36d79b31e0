"""Synthetic timeline records for the timeline tests: a 2-stage 1F1B pipeline laid out from the
schedule simulation (forward 1 ms, backward 2 ms), with sends, receives, waits and an
optimizer step per rank, on chosen hosts and clock offsets."""
from __future__ import annotations

from flowexec.pipeline.schedules import one_f_one_b, simulate
from flowexec.profiler.records import Span

F_NS = 1_000_000
WAIT_NS = 15_000


def pipeline_spans(p: int = 2, m: int = 4, steps=(10, 11), hosts=("hostA", "hostB"), offsets=(0, 0)) -> list[Span]:
    """The spans as each rank would record them: rank r's times are on its own clock, which reads
    ``true - offsets[r]``, and carry ``offset_ns = offsets[r]``."""
    sim = simulate(one_f_one_b(p, m), costs=(1.0, 1.0, 1.0))  # a backward costs two forwards
    out: list[Span] = []
    base = 0

    def add(r, step, kind, micro, stream, a, b, **kw):
        out.append(Span(r, hosts[r], 100 + r, step, r, kind, micro, stream, a - offsets[r], b - offsets[r], "host",
                        offset_ns=offsets[r], **kw))

    for step in steps:
        for job in sorted(sim.start, key=lambda j: (sim.start[j], j.stage)):
            r, a, b = job.stage, base + round(sim.start[job] * F_NS), base + round(sim.end[job] * F_NS) - 20_000
            add(r, step, job.kind, job.micro, "compute", a, b, issue_ns=a - offsets[r] - 5_000)
            down = job.kind == "F"
            to = r + 1 if down else r - 1
            if 0 <= to < p:  # the output goes on
                add(r, step, "send", job.micro, "comm", b, b + 10_000, peer=to, tag=2 * job.micro + (not down))
            frm = r - 1 if down else r + 1
            if 0 <= frm < p:  # the input came in: posted early; the job waited on it for its first 15 µs
                add(r, step, "recv", job.micro, "comm", a - 300_000, a + WAIT_NS, peer=frm, tag=2 * job.micro + (not down))
                add(r, step, "wait", job.micro, "wait", a, a + WAIT_NS, peer=frm)
        for r in range(p):
            e = base + round(sim.makespan * F_NS)
            add(r, step, "OPT", None, "compute", e, e + 200_000)
        base += round(sim.makespan + 1) * F_NS
    return out
