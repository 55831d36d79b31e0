"""The lerp kernels compile for sm_90 as a GPU launch would specialise them (no GPU needed).

The interpreter tests run the kernels as Python; this one catches what only Triton's compiler
rejects. It runs ``tests/lerp_compile_check.py`` in a fresh process without TRITON_INTERPRET.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton.backends.nvidia", reason="needs Triton's NVIDIA backend (ships with the pip wheel)")
_VERSION = tuple(int(p) for p in __import__("triton").__version__.split(".")[:2])
pytestmark = pytest.mark.skipif(_VERSION < (3, 6), reason="the check builds signatures the way Triton >= 3.6 takes them")


def test_kernels_compile_for_sm90():
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # this checkout's flowexec, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(here), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, os.path.join(here, "lerp_compile_check.py")], env=env,
                          cwd=os.path.dirname(here), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAILED" not in proc.stdout and proc.stdout.count("ok ") >= 20, proc.stdout
