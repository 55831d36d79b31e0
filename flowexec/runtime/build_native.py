"""``python -m flowexec.runtime.build_native``: compile the native call check
(:mod:`flowexec.runtime.fastcall`) once for this machine (about 30 s); ``scripts/setup.sh`` runs it."""
from __future__ import annotations

from . import fastcall


def main() -> None:
    if fastcall.load() is None:
        print(f"flowexec: compiling the native call check ({fastcall._SOURCE}) once for this machine ...", flush=True)
        fastcall.build()
    print(f"flowexec: native call check ready ({fastcall.status()})")


if __name__ == "__main__":
    main()
