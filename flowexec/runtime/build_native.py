"""``python -m flowexec.runtime.build_native``: compile the native extension — the call check
(:mod:`flowexec.runtime.fastcall`) and the job timer's event clock
(:class:`flowexec.profiler.timers.NativeEvents`) — once for this machine (30-60 s), and on a
machine without a GPU the CPU flavour of the lerp kernels' native launcher
(:mod:`flowexec.kernels._native`, ~40 s), which the tests would otherwise build on first use;
``scripts/setup.sh`` runs it."""
from __future__ import annotations

import torch

from . import fastcall


def main() -> None:
    if fastcall.load() is None:
        print(f"flowexec: compiling the native extension ({', '.join(fastcall._SOURCES)}) once for this machine ...",
              flush=True)
        fastcall.build()
    print(f"flowexec: native extension ready ({fastcall.status()})")
    if not torch.cuda.is_available():  # a GPU machine builds its CUDA flavour on first use, as before
        from ..kernels import _native

        ready = _native.load(cuda=False) is not None
        print(f"flowexec: native lerp launcher (CPU) {'ready' if ready else 'not built; the Python path is used'}")


if __name__ == "__main__":
    main()
