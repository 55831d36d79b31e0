"""The ``flowexec`` command line."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowexec", description="Run PyTorch programs as planned instruction streams.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a built-in model through flowexec beside eager PyTorch")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present, else cpu")
    demo.add_argument("--out", default=None, help="directory for demo.json (loss curves and figures)")
    args = parser.parse_args(argv)
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
