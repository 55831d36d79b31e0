"""Pipeline parallelism: schedules as data, a stage runner over ``torch.distributed``
point-to-point (gloo on CPUs), a local launcher and the job timeline.

>>> from flowexec.pipeline import one_f_one_b, format_schedule
>>> print(format_schedule(one_f_one_b(2, 2)))
rank 0: 0F0 0F1 0B0 0B1
rank 1: 1F0 1B0 1F1 1B1
"""
from .launch import PipelineError, spawn
from .schedules import SCHEDULES, Job, format_schedule, gpipe, one_f_one_b, parse_schedule, simulate
from .stage import PipelineStage, StepResult, split_batch
from .timeline import bubble, chrome_trace

__all__ = ["Job", "PipelineError", "PipelineStage", "SCHEDULES", "StepResult", "bubble", "chrome_trace",
           "format_schedule", "gpipe", "one_f_one_b", "parse_schedule", "simulate", "spawn", "split_batch"]
