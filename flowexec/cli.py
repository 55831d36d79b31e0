"""The ``flowexec`` command line."""
from __future__ import annotations

import argparse
import sys

from .pipeline.schedules import SCHEDULES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowexec", description="Run PyTorch programs as planned instruction streams.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a built-in model through flowexec beside eager PyTorch")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present, else cpu")
    demo.add_argument("--out", default=None, help="directory for demo.json (loss curves and figures), and the profiled "
                      "2-rank pipeline's trace.json and timeline.html")
    prof = sub.add_parser("profile", help="time each instruction of the demo's training step (trace mode)")
    prof.add_argument("--runs", type=int, default=20, help="timed steps (default 20)")
    prof.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present, else cpu")
    prof.add_argument("--out", default="flowexec-trace.json", help="Chrome trace file (default flowexec-trace.json)")
    prof.add_argument("--top", type=int, default=10, help="instructions listed (default 10)")
    prof.add_argument("--streams", type=int, default=1, help="CUDA streams (default 1)")
    pipe = sub.add_parser("pipeline", help="train a small model pipeline-parallel on local gloo ranks (CPU) and "
                                           "save the job timeline")
    pipe.add_argument("--schedule", type=str.lower, default="1f1b", choices=tuple(SCHEDULES),
                      help="schedule (any case; default 1f1b)")
    pipe.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    pipe.add_argument("--micro", type=int, default=8, help="micro-batches per step (default 8)")
    pipe.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    pipe.add_argument("--out", default="flowexec-pipeline.json", help="Chrome trace of the jobs")
    pipe.add_argument("--compile", action="store_true",
                      help="run the stages as flowexec programs (CompiledRunner) instead of eager autograd")
    sch = sub.add_parser("schedules", help="compare pipeline schedules before running one: simulated step, bubble and "
                                           "activations per rank (your own plan too)")
    sch.add_argument("--ranks", type=int, default=None, help="pipeline ranks (default 4, or your plan's)")
    sch.add_argument("--micro", type=int, default=None, help="micro-batches a step (default 8, or your plan's)")
    sch.add_argument("--costs", default="1,1,1", help="T_F,T_I,T_W of a micro-batch through a rank's layers "
                     "(default 1,1,1; a full backward costs T_I + T_W)")
    sch.add_argument("--latency", type=float, default=0.0, help="each message's latency, in the costs' unit")
    sch.add_argument("--show", action="append", default=[], metavar="NAME",
                     help="also print this schedule's jobs per rank (repeatable)")
    sch.add_argument("--plan", action="append", default=[], metavar="FILE",
                     help="a plan of yours in text form ('rank 0: 0F0 0F1 0B0 ...' a line), checked and compared")
    tl = sub.add_parser("timeline", help="merge profiled records (one JSON-lines file per rank) into a trace and page")
    tl_sub = tl.add_subparsers(dest="timeline_command", required=True)
    tl_merge = tl_sub.add_parser("merge", help="DIR/*.jsonl -> Trace Event Format (Perfetto) and an HTML page")
    tl_merge.add_argument("directory", help="the records directory (rank0.jsonl, rank1.jsonl, ...)")
    tl_merge.add_argument("-o", "--out", default="trace.json", help="trace file (default trace.json)")
    tl_merge.add_argument("--html", default=None, help="also write the self-contained timeline page here")
    args = parser.parse_args(argv)
    if args.command == "timeline":
        from .pipeline.theory import theory_at_measured_costs
        from .profiler.command import merge_command

        try:
            print(merge_command(args.directory, args.out, args.html, theory_at_measured_costs))
        except (ValueError, OSError) as e:
            print(f"flowexec timeline: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "schedules":
        from .pipeline.compare import schedules_command

        try:
            print(schedules_command(args.ranks, args.micro, args.costs, args.latency, args.show, args.plan))
        except (ValueError, OSError) as e:
            print(f"flowexec schedules: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "pipeline":
        if min(args.ranks, args.micro, args.steps) < 1:
            parser.error("--ranks, --micro and --steps must be at least 1")
        from .pipeline.demo import run_cli

        try:
            run_cli(args.schedule, args.ranks, args.micro, args.steps, args.out, args.compile)
        except (ValueError, RuntimeError, OSError) as e:
            print(f"flowexec pipeline: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "profile":
        if args.runs < 1 or args.top < 1:
            parser.error("--runs and --top must be at least 1")
        from .demo import run_profile
        from .errors import FlowexecError

        try:
            run_profile(args.runs, args.device, args.out, args.top, args.streams)
        except FlowexecError as e:
            print(f"flowexec profile: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "demo":
        if args.steps < 2:
            parser.error("--steps must be at least 2")
        from .demo import run_demo
        from .errors import FlowexecError

        try:
            run_demo(args.steps, args.device, args.out)
        except FlowexecError as e:
            print(f"flowexec demo: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
