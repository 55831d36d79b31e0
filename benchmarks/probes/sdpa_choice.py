"""Which attention kernel eager runs and which one a Dynamo + AOTAutograd trace keeps, for the
model sweep's Hugging Face cases: eager's fused attention draws its dropout inside the kernel,
the math path draws it with a dropout op, so the two draw other masks from the same seed.

    PYTHONPATH=. python3 benchmarks/probes/sdpa_choice.py --device cuda --cases bert,t5 --out $OUT
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_sweep import HF, batch  # noqa: E402

WATCH = ("attention", "dropout", "bernoulli", "softmax")


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(w in str(func) for w in WATCH):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default="bert,t5")
    ap.add_argument("--out", default="/tmp")
    a = ap.parse_args()
    from torch._dynamo.backends.common import aot_autograd

    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                           "torch": torch.__version__, "commit": os.environ.get("FLOWEXEC_COMMIT", "unknown")}
    for name in a.cases.split(","):
        make, kind = HF[name]
        torch.manual_seed(0)
        model = make().to(a.device).train()
        b = batch(kind, torch.device(a.device))
        with _Count() as c:
            model(**b).loss.backward()
        traced: collections.Counter[str] = collections.Counter()

        def count(gm: torch.fx.GraphModule, _: Any) -> Any:
            traced.update(str(n.target) for n in gm.graph.nodes if any(w in str(n.target) for w in WATCH))
            return gm

        torch._dynamo.reset()
        torch.compile(model, backend=aot_autograd(fw_compiler=count, bw_compiler=count))(**b).loss.backward()
        out[name] = {"eager": dict(c.ops), "aot": dict(traced)}
        print(name, json.dumps(out[name], indent=1), flush=True)
    with open(os.path.join(a.out, f"sdpa_choice_{a.device}.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
