"""``python -m flowexec.runtime.build_native``: compile the native extension — the call check
(:mod:`flowexec.runtime.fastcall`) and the job timer's event clock
(:class:`flowexec.profiler.timers.NativeEvents`) — once for this machine (30-60 s);
``scripts/setup.sh`` runs it."""
from __future__ import annotations

from . import fastcall


def main() -> None:
    if fastcall.load() is None:
        print(f"flowexec: compiling the native extension ({', '.join(fastcall._SOURCES)}) once for this machine ...",
              flush=True)
        fastcall.build()
    print(f"flowexec: native extension ready ({fastcall.status()})")


if __name__ == "__main__":
    main()
