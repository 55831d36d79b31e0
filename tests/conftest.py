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


# --- the order of files under `-n 2 --dist loadfile` -------------------------------------------
# xdist hands each worker a file at a time, the files with the most tests first. A slow file of
# few tests (the examples: 2 tests, a minute of torchrun launches) then came last and kept one
# worker busy for a minute after the other had finished. The files below, slowest first, are
# handed out before the rest (measured on the 2-core machine; a file missing from the list only
# goes back to xdist's order). The files that use the session's kept gloo ranks (the ``ranks``
# fixture below: a worker's own processes, seconds to start) are one unit, so that one worker
# starts them once rather than both.
_RANK_FILES = ("tests/test_pipeline_trainer.py", "tests/test_pipeline_dp.py", "tests/test_pipeline_transfers.py",
               "tests/test_timeline_ranks.py")
_SLOW_FIRST = ("ranks", "tests/test_lerp.py", "tests/test_examples.py", "tests/test_kept.py",
               "tests/test_compile_workers.py", "tests/test_training.py", "tests/test_fuse.py",
               "tests/test_fake_capture.py", "tests/test_memory.py", "tests/test_guards.py", "tests/test_recompute.py",
               "tests/test_backend_by_name.py", "tests/test_scale_bench.py", "tests/test_threaded.py",
               "tests/test_no_extra_work.py", "tests/test_core.py", "tests/test_first_step.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", None) != "loadfile":
        return None  # (xdist's own scheduler)
    from xdist.scheduler import LoadFileScheduling

    class SlowFilesFirst(LoadFileScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "ranks" if scope in _RANK_FILES else scope

        def _assign_work_unit(self, node) -> None:
            if not self._ordered:  # (the queue is complete at the first assignment)
                self._ordered = True
                for scope in reversed(_SLOW_FIRST):
                    if scope in self.workqueue:
                        self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return SlowFilesFirst(config, log)


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
