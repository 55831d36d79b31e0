import os
import sys

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

