"""Pipeline parallelism: schedules as data (jobs F, B, I, W, OPT per rank; :func:`simulate`
checks and times a plan), :class:`PipelineTrainer` (every rank runs its jobs over
``torch.distributed`` point-to-point: gloo on CPUs, NCCL on GPUs), stage runners (eager or
flowexec programs), :func:`split` for a sequential model, and :func:`spawn` for local ranks.

>>> from flowexec.pipeline import one_f_one_b, format_schedule
>>> print(format_schedule(one_f_one_b(2, 2)))
rank 0: 0F0 0F1 0B0 0B1
rank 1: 1F0 1B0 1F1 1B1
"""
# The I/W pass lives in the submodule ``split``; load it before binding the function ``split``
# (cut an nn.Sequential), or its first import later would replace the function on the package.
from . import split as _split_pass  # noqa: F401
from .launch import PipelineError, spawn
from .runner import EagerRunner, StageRunner, make_runner
from .schedules import (NAMES, SCHEDULES, Job, Simulation, check, dependencies, eager_1f1b, format_schedule,
                        get_schedule, gpipe, interleaved_1f1b, one_f_one_b, parse_schedule, placement, simulate,
                        with_optimizer, zbh1, zbv)
from .timeline import bubble, chrome_trace
from .trainer import PipelineTrainer, split, split_batch

__all__ = ["EagerRunner", "Job", "NAMES", "PipelineError", "PipelineTrainer", "SCHEDULES", "Simulation", "StageRunner",
           "bubble", "check", "chrome_trace", "dependencies", "eager_1f1b", "format_schedule", "get_schedule", "gpipe",
           "interleaved_1f1b", "make_runner", "one_f_one_b", "parse_schedule", "placement", "simulate", "spawn",
           "split", "split_batch", "with_optimizer", "zbh1", "zbv"]
