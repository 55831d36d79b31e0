import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

# A script that tests/test_lerp_compile.py runs in a process of its own: imported here (by
# --doctest-modules) it would import Triton compiled and patch the lerp planner's device figures.
collect_ignore = ["lerp_compile_check.py"]

# Triton runs the lerp kernels on CPU tensors only in its interpreter, and fixes interpreter
# mode when it is first imported (its own @jit library too). Where no GPU could run compiled
# kernels, the whole run takes the interpreter, so tests/test_lerp.py's kernel tests run in this
# process instead of re-running their file in a fresh one (about two minutes on 2 cores).
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _kept_programs_per_test(tmp_path_factory, monkeypatch):
    """Each test keeps its captured programs (flowexec/kept.py) in a directory of its own: a test
    that counts captures or watches one park gradients must not load what an earlier test kept
    of the same step (a run of the whole suite on one shared directory, which loads wherever
    that is sound, passes but for such tests: docs/kept.md)."""
    if os.environ.get("FLOWEXEC_KEEP_SHARED") != "1":  # (FLOWEXEC_KEEP_SHARED=1: the FLOWEXEC_KEEP_DIR given)
        monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path_factory.mktemp("kept")))


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world)``: gloo ranks kept for the whole run (``flowexec.pipeline.launch.Ranks``),
    for the multi-process tests whose ranks all succeed: ``ranks(2).run(fn, *args)``. Starting a
    rank (a process importing torch and flowexec) costs seconds on 2 cores; a failed run closes
    its ranks and the next test gets new ones. Tests that make a rank fail use ``spawn``."""
    from flowexec.pipeline.launch import Ranks

    kept: dict[int, Ranks] = {}

    def get(world: int) -> Ranks:
        if world not in kept or kept[world].closed:
            kept[world] = Ranks(world, timeout=300)
        return kept[world]

    yield get
    for r in kept.values():
        r.close()
