"""One rank's part of a pipeline: its stage's module, the jobs of a schedule, point-to-point
transfers with its neighbours (``torch.distributed``: gloo on CPUs, NCCL on GPUs) and a timer
per job.

Forward ``sFm`` takes micro-batch ``m`` from the caller (stage 0) or from stage ``s-1``, runs the
module and sends the output on (the last stage computes the loss instead); backward ``sBm``
takes the output's gradient from stage ``s+1`` (the last stage starts from its loss), runs
autograd through the module and sends the input's gradient back. Parameter gradients accumulate
over the micro-batches in ``.grad``, each micro-batch's loss scaled by ``1 / n_micro`` so that
they equal the gradients of the mean loss over the whole batch.

Shapes travel once, at ``setup``: each stage runs its module on zeros of the incoming shape and
tells the next stage the shape and dtype it will send.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .schedules import Job

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HEADER = 10  # dtype code, ndim, up to 8 dims


@dataclass
class StepResult:
    """What a rank saw in one step: the losses of its micro-batches (last stage only, unscaled)
    and per job (job, start ns, end ns, ns spent waiting to receive), on ``perf_counter_ns``."""

    losses: list[float] = field(default_factory=list)
    jobs: list[tuple[str, int, int, int]] = field(default_factory=list)


class PipelineStage:
    """Stage ``stage`` of ``n_stages`` on this rank (ranks are stages, in order).

    >>> import torch
    >>> st = PipelineStage(torch.nn.Linear(4, 4), 0, 1, loss_fn=torch.nn.functional.mse_loss)
    >>> st.setup((2, 4))
    >>> r = st.run([Job(0, "F", 0), Job(0, "B", 0)], inputs=[torch.ones(2, 4)], targets=[torch.zeros(2, 4)])
    >>> len(r.losses), st.module.weight.grad is not None
    (1, True)
    """

    def __init__(self, module: torch.nn.Module, stage: int, n_stages: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 group: Any = None) -> None:
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage {stage} is not in 0..{n_stages - 1}")
        if stage == n_stages - 1 and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn")
        self.module, self.stage, self.n_stages, self.loss_fn, self.group = module, stage, n_stages, loss_fn, group
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.in_spec: tuple[tuple[int, ...], torch.dtype] | None = None
        self.out_spec: tuple[tuple[int, ...], torch.dtype] | None = None
        self.device = next(iter(module.parameters()), torch.empty(0)).device

    # -- set-up ------------------------------------------------------------------------------
    def setup(self, micro_shape: Sequence[int] | None = None, dtype: torch.dtype = torch.float32) -> None:
        """Learn the shapes this stage receives and sends. Stage 0 passes one micro-batch's
        shape; the others receive it from their predecessor."""
        if self.first:
            if micro_shape is None:
                raise ValueError("stage 0's setup needs the shape of one micro-batch")
            self.in_spec = (tuple(micro_shape), dtype)
        else:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            dist.recv(header, self.stage - 1, group=self.group)
            ndim = int(header[1])
            self.in_spec = (tuple(int(d) for d in header[2:2 + ndim]), _DTYPES[int(header[0])])
        if self.last:  # its output only feeds loss_fn: any type will do, nothing is sent
            return
        out = self._probe()
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"stage {self.stage} returns {type(out).__name__}; a stage that sends to the next "
                             "must return one tensor")
        self.out_spec = (tuple(out.shape), out.dtype)
        if out.dtype not in _DTYPES or out.dim() > _HEADER - 2:
            raise ValueError(f"stage {self.stage} outputs {out.dtype} of {out.dim()} dims; "
                             f"a pipeline sends floating tensors of at most {_HEADER - 2} dims")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(out.dtype), out.dim()
        header[2:2 + out.dim()] = torch.tensor(out.shape)
        dist.send(header, self.stage + 1, group=self.group)

    def _probe(self) -> Any:
        """The module's output on zeros of the incoming shape, leaving no trace: random state
        and buffers (BatchNorm's running statistics) are as they were."""
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            out = self.module(torch.zeros(self.in_spec[0], dtype=self.in_spec[1], device=self.device))  # type: ignore[index]
            for b, saved in buffers:
                b.copy_(saved)
        return out

    # -- one step ----------------------------------------------------------------------------
    def run(self, jobs: Sequence[Job], inputs: Sequence[torch.Tensor] | None = None,
            targets: Sequence[torch.Tensor] | None = None) -> StepResult:
        """Run this rank's jobs of one step (``inputs``: stage 0's micro-batches, ``targets``:
        the last stage's). Gradients accumulate into the parameters' ``.grad``."""
        if self.in_spec is None:
            raise RuntimeError(f"stage {self.stage}: call setup() before run()")
        if not jobs:
            raise ValueError(f"stage {self.stage}: no jobs to run")
        n_micro = 1 + max(j.micro for j in jobs)
        for name, given, needed in (("inputs", inputs, self.first), ("targets", targets, self.last)):
            if needed and (given is None or len(given) != n_micro):
                raise ValueError(f"stage {self.stage} needs {n_micro} micro-batch {name}, "
                                 f"got {None if given is None else len(given)}")
        if self.first:
            for m, t in enumerate(inputs):  # type: ignore[arg-type]
                if (tuple(t.shape), t.dtype) != self.in_spec:
                    raise ValueError(f"stage 0: micro-batch {m} is {t.dtype} {list(t.shape)}, but setup() was "
                                     f"given {self.in_spec[1]} {list(self.in_spec[0])} (the shapes sent down the "
                                     "pipeline follow from it)")
        res = StepResult()
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro -> (input, output or loss)
        sends: list[Any] = []
        clock = time.perf_counter_ns
        # Every receive of the step is posted up front, in job order (so the transfers overlap
        # the jobs before the one that needs them); a job waits on its own.
        recvs = {(j.kind, j.micro): self._post_recv(j) for j in jobs
                 if (j.kind == "F" and not self.first) or (j.kind == "B" and not self.last)}
        for job in jobs:
            if job.stage != self.stage:
                raise ValueError(f"job {job} is not stage {self.stage}'s")
            t0 = clock()
            waited = 0
            if job.kind == "F":
                if self.first:
                    x = inputs[job.micro]  # type: ignore[index]
                else:
                    x, work = recvs.pop(("F", job.micro))
                    work.wait()
                    waited = clock() - t0
                    x.requires_grad_(True)
                out = self.module(x)
                if self.last:
                    loss = self.loss_fn(out, targets[job.micro])  # type: ignore[index,misc]
                    res.losses.append(float(loss.detach()))
                    saved[job.micro] = (x, loss / n_micro)
                else:
                    if (tuple(out.shape), out.dtype) != self.out_spec:
                        raise ValueError(f"stage {self.stage}: micro-batch {job.micro}'s output is {out.dtype} "
                                         f"{list(out.shape)}, not the {self.out_spec[1]} "  # type: ignore[index]
                                         f"{list(self.out_spec[0])} it had at setup()")  # type: ignore[index]
                    saved[job.micro] = (x, out)
                    sends.append(dist.isend(out.detach().contiguous(), self.stage + 1, group=self.group,
                                            tag=2 * job.micro))
            else:
                x, out = saved.pop(job.micro)
                if not self.last:
                    grad, work = recvs.pop(("B", job.micro))
                    work.wait()
                    waited = clock() - t0
                if out.requires_grad:  # else nothing before it needs a gradient (no parameters, say)
                    torch.autograd.backward(out, None if self.last else grad)
                if not self.first:
                    gx = x.grad if x.grad is not None else torch.zeros_like(x)  # the output ignored its input
                    sends.append(dist.isend(gx.contiguous(), self.stage - 1, group=self.group, tag=2 * job.micro + 1))
            res.jobs.append((str(job), t0, clock(), waited))
        for w in sends:
            w.wait()
        return res

    def _post_recv(self, job: Job) -> tuple[torch.Tensor, Any]:
        """The buffer and pending receive of what ``job`` takes from a neighbour: the activation
        from stage ``s-1`` for a forward, the output's gradient from ``s+1`` for a backward."""
        shape, dtype = self.in_spec if job.kind == "F" else self.out_spec  # type: ignore[misc]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        peer, tag = (self.stage - 1, 2 * job.micro) if job.kind == "F" else (self.stage + 1, 2 * job.micro + 1)
        return buf, dist.irecv(buf, peer, group=self.group, tag=tag)


def split_batch(t: torch.Tensor, n_micro: int) -> list[torch.Tensor]:
    """``n_micro`` equal micro-batches along dim 0 (an error names sizes that do not divide).

    >>> [m.shape[0] for m in split_batch(torch.zeros(8, 3), 4)]
    [2, 2, 2, 2]
    """
    if t.shape[0] % n_micro:
        raise ValueError(f"a batch of {t.shape[0]} does not split into {n_micro} equal micro-batches")
    return list(t.chunk(n_micro))
