"""PipelineTrainer: one training step of a model cut into stages, run by every rank of a
``torch.distributed`` group after a plan (:mod:`.schedules`).

Every rank builds the same list of stage modules and the same trainer; each keeps the stages the
plan puts on it. The first step agrees on shapes (each stage's output spec travels once to the
next stage's rank), builds a runner per local stage (:func:`~.runner.make_runner`) and lowers
this rank's jobs into a list of instructions with their message sources and destinations; every
later step only runs that list: post every receive of the step in channel order (on gloo into
buffers kept for the run, just before the first job that takes one), run the jobs (F, B, I, W,
OPT), wait for the sends.

Run it under ``torchrun`` (or :func:`~.launch.spawn` for a quick local try)::

    # torchrun --nproc-per-node 2 train.py
    import torch, torch.distributed as dist
    from flowexec.pipeline import PipelineTrainer, split
    dist.init_process_group("gloo")
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    trainer = PipelineTrainer(split(model, 2), schedule="1F1B", microbatches=4,
                              loss_fn=torch.nn.functional.mse_loss,
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), compile=False)
    loss = trainer.step(torch.randn(32, 64), torch.randn(32, 64))  # a tensor on the last stage's rank, else None
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..fusion import check_fuse
from ..profiler.timers import NULL_TIMER
from .runner import StageRunner, _as_tuple, make_runner
from .schedules import Job, Plan, check, get_schedule, placement, simulate, with_optimizer
from .step_end import StepEnd, broadcast_from, by_kind, check_max_norm, norm_dtype
from .stage import (Message, SendThread, Spec, channel_order, grad_spec, post_failure, recv_spec, send_spec,
                    spec_of, wait, wire)
from .theory import pipeline_meta
from .tied import cross_rank_ties, find_ties, norm_parameters, optimizer_groups, parameter_at, unique_parameters

NO_GROUP = ("PipelineTrainer needs a torch.distributed process group: start the script with "
            "`torchrun --nproc-per-node N script.py` (across machines: `torchrun --nnodes M --nproc-per-node N "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT script.py`) and call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first, or try it locally with "
            "flowexec.pipeline.spawn(fn, world)")


def split(seq: torch.nn.Sequential, n: int, balance: Sequence[int] | None = None) -> list[torch.nn.Module]:
    """Cut a sequential model into ``n`` contiguous stages (the modules are shared with ``seq``,
    not copied): of as even a number of layers as the count allows, or of ``balance[i]`` layers
    for stage ``i`` (torchgpipe's and Megatron's knob for stages of unequal cost, such as a first
    stage with an input layer or a last one with the output head).

    >>> [len(s) for s in split(torch.nn.Sequential(*[torch.nn.ReLU()] * 5), 2)]
    [3, 2]
    >>> [len(s) for s in split(torch.nn.Sequential(*[torch.nn.ReLU()] * 6), 4, balance=[2, 1, 1, 2])]
    [2, 1, 1, 2]
    """
    if not isinstance(seq, torch.nn.Sequential):
        raise TypeError(f"split cuts an nn.Sequential, got {type(seq).__name__}")
    layers = list(seq)
    if not isinstance(n, int) or not 1 <= n <= len(layers):
        raise ValueError(f"cannot cut {len(layers)} layers into {n!r} stages")
    if balance is None:
        sizes = [len(layers) // n + (i < len(layers) % n) for i in range(n)]  # the first stages get the extra
    else:
        sizes = list(balance)
        if len(sizes) != n or not all(isinstance(k, int) and k >= 1 for k in sizes) or sum(sizes) != len(layers):
            raise ValueError(f"balance={list(balance)!r} must give each of the {n} stages at least one layer and "
                             f"add up to the model's {len(layers)} layers")
    edges = [sum(sizes[:i]) for i in range(n + 1)]
    return [torch.nn.Sequential(*layers[edges[i]:edges[i + 1]]) for i in range(n)]


def split_batch(t: Any, n_micro: int) -> list[Any]:
    """``n_micro`` equal micro-batches along dim 0 of a tensor, or of each tensor of a tuple.

    >>> [m.shape[0] for m in split_batch(torch.zeros(8, 3), 4)]
    [2, 2, 2, 2]
    """
    if isinstance(t, (tuple, list)):
        parts = [split_batch(x, n_micro) for x in t]
        return [tuple(p[i] for p in parts) for i in range(n_micro)]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a batch is a tensor or a tuple of tensors, got {type(t).__name__}")
    if t.dim() == 0 or t.shape[0] % n_micro:
        raise ValueError(f"a batch of {t.shape[0] if t.dim() else 'a scalar'} does not split into {n_micro} "
                         "equal micro-batches")
    return list(t.chunk(n_micro))


@dataclass(frozen=True, slots=True)
class _SendInfo:
    """What sending one message needs, built at set-up: the spec it must match, the ``send``
    and ``isend`` span names, its process group, a tag per tensor and the receiver's global
    rank."""

    spec: Spec
    name: str
    isend_name: str
    group: Any
    tags: tuple[int, ...]
    dst: int


@dataclass(frozen=True, slots=True)
class _Ins:
    """One lowered job: where its input comes from and where its output goes.
    src/dst: None (the caller / the loss / nothing), "local" (a stage on this rank), or a Message."""

    job: Job
    src: Any
    dst: Any


class PipelineTrainer:
    """Train ``stages`` (every stage's module, the same list on every rank) pipeline-parallel.

    ``schedule``: a name (FThenB/GPipe, 1F1B, Eager1F1B, Interleaved1F1B, ZBH1, ZBV; any case), a function
    ``(n_ranks, n_micro, n_stages) -> plan``, or a plan (``{rank: [Job, ...]}``). The plan decides
    which stages each rank holds (ZBV: two in a V; Interleaved1F1B: ``r, r+p, ...``).
    ``loss_fn(output, target)``: a mean over the micro-batch; gradients are those of the mean over
    the batch. ``optimizer(params)`` builds one optimizer per local stage, stepped by the stage's
    ``OPT`` job (None: gradients are left in ``.grad``); local stages that share a weight get one
    optimizer between them, and a weight shared with another rank's stage has its gradient
    summed over those ranks before it is stepped (:mod:`.tied`). ``compile``: False for eager stages, True
    (or a mode string) for flowexec programs; ``fuse``: their fusion, as ``flowexec.compile``'s (None:
    Inductor in graph mode on CUDA). ``device``: where the local stages run (default
    ``cuda:LOCAL_RANK`` on an NCCL group, else the CPU). ``timer``: a
    :class:`~flowexec.profiler.timers.JobTimer` to record every job and receive wait; the spans that
    the last step's flush returned are in ``trainer.spans`` (on CUDA the completed ones, so some
    come a step late; ``timer.finish()`` returns the rest). ``profile``: the steps to record (``range(10, 13)``)
    into ``profile_dir`` (one JSON-lines file per rank; ``flowexec timeline merge DIR``), or use
    ``with trainer.profiling(DIR):`` around steps (docs/timeline.md). ``timeout``: seconds any
    wait may last. ``max_grad_norm``: clip the gradients by their norm over the whole model, as
    ``torch.nn.utils.clip_grad_norm_`` on the unsplit model would (one ``all_reduce`` of a
    scalar at the step's end; the optimizers step after it); ``trainer.grad_norm`` then holds
    the step's norm before the clip (a 0-d tensor, on every rank). ``data_parallel``: train
    that many replicas of the pipeline side by side, as DDP would (the group's ranks split into
    replicas of ``world / data_parallel`` ranks; replica ``d`` is global ranks ``d*p ..
    d*p+p-1``; ``trainer.rank`` and ``trainer.world`` are then the pipeline's): replica 0's
    weights and buffers are broadcast at construction, each replica's first and last ranks take
    their own part of the data, and at the step's end the gradients are averaged over the
    replicas and the buffers take replica 0's values, before the clip and the optimizers;
    profiles go to ``profile_dir/replica{d}``.

    :meth:`step` returns the mean loss (a 0-d tensor) on the rank holding the last stage, None on
    the others (with ``data_parallel``: its replica's mean loss, on each replica's last rank). A
    rank that raises posts its error; the others stop waiting with a :class:`PipelineError`
    naming it.
    """

    def __init__(self, stages: Sequence[torch.nn.Module], schedule: str | Callable[..., Plan] | Plan = "1F1B",
                 microbatches: int = 8, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 optimizer: Callable[[list[torch.nn.Parameter]], Any] | None = None, compile: bool | str = True,
                 device: torch.device | str | None = None, timer: Any = None, timeout: float = 300.0,
                 profile: Any = None, profile_dir: str = "flowexec-timeline",
                 max_grad_norm: float | None = None, data_parallel: int = 1, fuse: str | bool | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(NO_GROUP)
        stages = list(stages)
        if not stages or not all(isinstance(s, torch.nn.Module) for s in stages):
            raise TypeError("stages must be a non-empty list of nn.Module (every stage of the model, on every rank)")
        if loss_fn is None or not callable(loss_fn):
            raise ValueError("PipelineTrainer needs loss_fn(output, target)")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a whole number >= 1, got {microbatches!r}")
        if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
            raise ValueError(f"data_parallel must be a whole number >= 1, got {data_parallel!r}")
        self.global_rank, world = dist.get_rank(), dist.get_world_size()
        if world % data_parallel:
            raise ValueError(f"data_parallel={data_parallel} replicas do not split the group's {world} ranks evenly")
        # Replica d is the pipeline of global ranks d*p .. d*p+p-1; plans, stages and messages
        # speak of pipeline ranks 0..p-1 (self.rank), the transfers of global ones (self._peer).
        self.data_parallel, self.world = data_parallel, world // data_parallel
        self.replica, self.rank = divmod(self.global_rank, self.world)
        self._peer = tuple(self.replica * self.world + r for r in range(self.world))
        self.n_stages, self.n_micro = len(stages), microbatches
        plan = self._resolve(schedule)
        self.plan = with_optimizer(plan)
        self.owner = placement(self.plan)
        self.local = [s for s in range(self.n_stages) if self.owner[s] == self.rank]
        self.backend = str(dist.get_backend())  # "gloo", "nccl", or "cpu:gloo,cuda:nccl"
        if device is None:
            device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.global_rank % torch.cuda.device_count())))
                      if "nccl" in self.backend and torch.cuda.is_available() else torch.device("cpu"))
        self.device = torch.device(device)
        self.nccl = "nccl" in self.backend and self.device.type == "cuda"  # transfers go through NCCL
        self.modules = {s: stages[s].to(self.device) for s in self.local}
        self.loss_fn, self.compile, self.timeout = loss_fn, compile, timeout
        self.fuse = check_fuse(fuse)
        self._dp_group, self._replica_group = self._replica_groups()
        if self.data_parallel > 1:  # as DDP: every replica starts from replica 0's weights and buffers
            broadcast_from(by_kind(self._state_tensors()), self.rank, self._dp_group, self._wait, "replica 0's weights")
        self._optimizer_setup(stages, optimizer, check_max_norm(max_grad_norm))
        self.grad_norm: torch.Tensor | None = None
        self.timer = timer if timer is not None else NULL_TIMER
        self.spans: list[Any] = []
        self.runners: dict[int, StageRunner] = {}
        self.step_count = 0
        self._program: list[_Ins] | None = None
        self._sender: SendThread | None = None
        # NCCL matches point-to-point operations by order per communicator: the two directions of a
        # pair get a group each, so a posted receive never queues a send behind it.
        self._groups = (dist.new_group(), dist.new_group()) if self.nccl else (None, None)
        self._comm = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Built on every rank at once: it measures each rank's clock offset to rank 0.
        self._schedule_name = schedule if isinstance(schedule, str) else getattr(schedule, "__name__", "plan")
        self.profiler = self._profiler(profile_dir, profile) if profile is not None else None

    def _replica_groups(self) -> tuple[Any, Any]:
        """With ``data_parallel`` > 1: the group of this rank's pipeline position across the
        replicas (the gradients' average) and this replica's group (its timeline's clocks),
        made on every rank in one order (``new_group`` is collective); else (None, None)."""
        if self.data_parallel == 1:
            return None, None
        p, dp = self.world, self.data_parallel
        across = [dist.new_group([d * p + r for d in range(dp)]) for r in range(p)]
        replicas = [dist.new_group(list(range(d * p, (d + 1) * p))) for d in range(dp)]
        return across[self.rank], replicas[self.replica]

    def _profiler(self, directory: str, steps: Any) -> Any:
        from ..profiler.recording import StepProfiler

        meta = pipeline_meta(self.plan, self._schedule_name, self.world, self.n_stages, self.n_micro, self.device)
        if self.data_parallel == 1:
            return StepProfiler(directory, steps, device=self.device, meta=meta)
        # a timeline per replica: its pipeline ranks, its clocks
        return StepProfiler(os.path.join(directory, f"replica{self.replica}"), steps, device=self.device,
                            rank=self.rank, group=self._replica_group, meta=meta)

    def evaluate(self, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
        """A forward-only pass over a batch, on every rank (:mod:`.evaluate`): with ``targets``
        the mean ``loss_fn`` over the micro-batches, without them the last stage's output for the
        batch; on the last stage's rank, None elsewhere. No gradients, no optimizer step; the
        batch need not have the training batch's shape."""
        from .evaluate import evaluate

        try:
            return evaluate(self, inputs, targets)
        except BaseException as e:
            post_failure(self.global_rank, e)
            raise

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint: its stages' ``state_dict``, its optimizers' and the
        step count. Every rank saves its own (a weight tied across ranks is in each rank's)::

            torch.save(trainer.state_dict(), f"ckpt/rank{dist.get_rank()}.pt")
            # later, the same stages, schedule and world size:
            trainer.load_state_dict(torch.load(f"ckpt/rank{dist.get_rank()}.pt"))

        Gradients are not saved: a step writes them anew."""
        return {"rank": self.rank, "world": self.world, "schedule": self._schedule_name,
                "stages": {s: self.modules[s].state_dict() for s in self.local},
                "optimizers": {s: opt.state_dict() for s, opt in self.optimizers.items() if opt is not None},
                "step": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved on this rank: the stages' tensors are copied into the
        live parameters and buffers (compiled stages keep reading them), the optimizers' state
        replaced. A checkpoint of other stages (another rank's, another schedule's or world
        size's) is refused, naming both."""
        if not isinstance(state, dict) or "stages" not in state:
            raise ValueError("not a PipelineTrainer checkpoint (a dict from trainer.state_dict())")
        got = sorted(state["stages"])
        if got != self.local:
            raise ValueError(f"this checkpoint holds stages {got} (rank {state.get('rank')} of {state.get('world')}, "
                             f"{state.get('schedule')}); rank {self.rank} of {self.world} holds {self.local} "
                             f"({self._schedule_name}): load each rank's own checkpoint")
        mine = sorted(s for s, opt in self.optimizers.items() if opt is not None)
        if sorted(state.get("optimizers", {})) != mine:
            raise ValueError(f"this checkpoint has optimizers for stages {sorted(state.get('optimizers', {}))}, this "
                             f"trainer for {mine}")
        for s in self.local:  # every stage checked before any is written: a refused load changes nothing
            have = self.modules[s].state_dict()
            got_s = state["stages"][s]
            wrong = sorted(set(have) ^ set(got_s)) or [k for k in have if getattr(have[k], "shape", None)
                                                         != getattr(got_s[k], "shape", None)]
            if wrong:
                raise ValueError(f"rank {self.rank}: the checkpoint's stage {s} does not fit this trainer's stage {s}: "
                                 f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''} "
                                 f"(missing, unexpected or of another shape)")
        for s in self.local:
            self.modules[s].load_state_dict(state["stages"][s])
        for s in mine:
            self.optimizers[s].load_state_dict(state["optimizers"][s])
        self.step_count = int(state.get("step", self.step_count))

    @contextlib.contextmanager
    def profiling(self, directory: str = "flowexec-timeline") -> Iterator[Any]:
        """``with trainer.profiling("timeline/"):`` records every step inside the block (every
        rank enters it at the same step); the records are written when it closes."""
        from ..profiler.recording import ALL_STEPS

        kept, self.profiler = self.profiler, self._profiler(directory, ALL_STEPS)
        try:
            yield self.profiler
        finally:
            prof, self.profiler = self.profiler, kept
            prof.close()

    # -- construction ------------------------------------------------------------------------
    def _resolve(self, schedule: Any) -> dict[int, tuple[Job, ...]]:
        if isinstance(schedule, str):
            fn = get_schedule(schedule)
            name = schedule
        elif callable(schedule):
            fn, name = schedule, getattr(schedule, "__name__", "the schedule")
        else:
            fn, name = None, "the plan"
        try:
            plan = fn(self.world, self.n_micro, self.n_stages) if fn is not None else schedule
        except ValueError as e:
            raise ValueError(f"{name} does not fit {self.n_stages} stages on {self.world} ranks with "
                             f"{self.n_micro} micro-batches: {e}") from None
        plan = {int(r): tuple(js) for r, js in dict(plan).items()}
        if sorted(plan) != list(range(self.world)):
            raise ValueError(f"{name} has jobs for ranks {sorted(plan)}, but the group has {self.world} ranks"
                             if self.data_parallel == 1 else
                             f"{name} has jobs for ranks {sorted(plan)}, but a pipeline has {self.world} ranks (the "
                             f"group's {self.world * self.data_parallel} in {self.data_parallel} replicas)")
        check(plan)
        stages = sorted(placement(plan))
        if len(stages) != self.n_stages:
            raise ValueError(f"{name} runs {len(stages)} stages, but {self.n_stages} stage modules were given")
        micro = 1 + max(j.micro for js in plan.values() for j in js if j.micro is not None)
        if micro != self.n_micro:
            raise ValueError(f"{name} runs {micro} micro-batches, but microbatches={self.n_micro}")
        if any(not js for js in plan.values()):
            raise ValueError(f"{name} leaves rank {next(r for r, js in plan.items() if not js)} without jobs")
        simulate(plan)  # a plan that deadlocks fails here, on every rank, naming the stuck jobs
        return plan

    def _optimizer_setup(self, stages: Sequence[torch.nn.Module], optimizer: Callable[..., Any] | None,
                   max_norm: float | None) -> None:
        """Optimizers, tied weights (:mod:`.tied`) and the clip: local stages that share a
        parameter get one optimizer, stepped by the last of their ``OPT`` jobs on this rank; a
        parameter shared with a stage of another rank has its gradient summed over those ranks at
        the end of the step (a group per set of ranks, made on every rank in one order), and the
        optimizers holding it step after that; with ``max_norm`` every optimizer steps there,
        after the clip (:mod:`.step_end`)."""
        ties = find_ties(stages)
        cross = cross_rank_ties(ties, self.owner)
        opt_at = {j.stage: i for i, j in enumerate(self.plan[self.rank]) if j.kind == "OPT"}
        self.optimizers: dict[int, Any] = {s: None for s in self.local}
        deferred = []  # stages whose OPT waits for the tied gradients' sum or the clip
        local_groups = optimizer_groups(self.local, ties)
        for group in local_groups:
            params = unique_parameters([self.modules[s] for s in group])
            at = max(group, key=lambda s: opt_at.get(s, -1))
            if optimizer is not None and params:
                self.optimizers[at] = optimizer(params)
            if max_norm is not None or self.data_parallel > 1 or any(s in t.stages for t in cross for s in group):
                deferred.append(at)
        # the optimizer each OPT job of the run loop steps (None where it waits for the step's end)
        self._opt_in_loop = {s: None if s in deferred else opt for s, opt in self.optimizers.items()}
        self._shares_locally = frozenset(s for g in local_groups if len(g) > 1 for s in g)
        groups: dict[tuple[int, tuple[int, ...]], Any] = {}
        for d in range(self.data_parallel):  # every rank, in one order: new_group is collective
            for t in cross:
                if (d, t.ranks) not in groups:
                    groups[d, t.ranks] = dist.new_group([d * self.world + r for r in t.ranks])
        mods = [self.modules[s] for s in self.local]
        params, replicated = tuple(unique_parameters(mods)), self.data_parallel > 1
        end = StepEnd(
            synced=tuple((parameter_at(stages, t), groups[self.replica, t.ranks], f"the gradient of {t.name}, tied "
                          f"across ranks {', '.join(map(str, t.ranks))}") for t in cross if self.rank in t.ranks),
            deferred=tuple((s, self.optimizers[s]) for s in deferred if self.optimizers[s] is not None),
            max_norm=max_norm,
            counted=tuple(norm_parameters(mods, stages, cross, self.rank)) if max_norm is not None else (),
            scaled=params if max_norm is not None else (),
            dtype=norm_dtype(stages), device=self.device, norm_group=self._replica_group,
            averaged=by_kind(params) if replicated else (),
            buffers=by_kind([t for t in self._state_tensors() if not isinstance(t, torch.nn.Parameter)])
            if replicated else (), source=self.rank, dp_group=self._dp_group, dp=self.data_parallel)
        self._end = end if end else None  # None: nothing to do at a step's end, decided here once

    def _state_tensors(self) -> list[torch.Tensor]:
        """The local stages' parameters and buffers, each once, in the stages' order."""
        seen: set[int] = set()
        out = []
        for s in self.local:
            for t in (*self.modules[s].parameters(), *self.modules[s].buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def _group(self, src: int, dst: int) -> Any:
        return self._groups[0] if src < dst else self._groups[1]

    def _wait(self, work: Any, what: str) -> None:
        if self.nccl:
            work.wait()  # orders the current stream after the transfer; the host goes on
        else:
            wait(work, what, self.global_rank, self.timeout)

    def _setup(self, first_micro: tuple[torch.Tensor, ...] | None) -> None:
        """Agree on shapes (once), build the runners and lower this rank's jobs."""
        msgs = channel_order(self.plan, self.owner)
        self._warm_up(msgs)
        hdr_dev = self.device if self.nccl else torch.device("cpu")
        last = self.n_stages - 1
        self.in_spec: dict[int, Spec] = {}
        self.out_spec: dict[int, Spec] = {}
        sends = []
        for s in self.local:
            if s == 0:
                self.in_spec[s] = spec_of(first_micro, "stage 0's micro-batch")  # type: ignore[arg-type]
            elif self.owner[s - 1] == self.rank:
                self.in_spec[s] = self.out_spec[s - 1]
            else:
                src = self.owner[s - 1]
                what = f"stage {s - 1}'s output shapes from rank {self._peer[src]}"
                self.in_spec[s] = recv_spec(self._peer[src], self._group(src, self.rank), 1 << 20 | s, hdr_dev,
                                            lambda w: self._wait(w, what))
            example = tuple(torch.zeros(shape, dtype=dt, device=self.device).requires_grad_(s > 0 and dt.is_floating_point)
                            for shape, dt in self.in_spec[s])
            if s == 0:
                example = tuple(x.detach().to(self.device) for x in first_micro)  # type: ignore[union-attr]
            self.runners[s] = make_runner(self.modules[s], example_inputs=example,
                                          loss_fn=self.loss_fn if s == last else None,
                                          loss_scale=1.0 / self.n_micro, compile=self.compile, fuse=self.fuse)
            if s == last:
                continue
            self.out_spec[s] = spec_of(_as_tuple(_probe(self.modules[s], example, self.device)),
                                       f"stage {s}'s output")
            dst = self.owner[s + 1]
            if dst != self.rank:
                sends.append(send_spec(self.out_spec[s], self._peer[dst], self._group(self.rank, dst), 1 << 20 | (s + 1),
                                       hdr_dev))
        for w, _ in sends:
            self._wait(w, "the shapes sent to the next rank")
        by_key = {(m.kind, m.stage, m.micro): m for m in msgs}
        program: list[_Ins] = []
        needed: list[Message] = []
        for j in self.plan[self.rank]:
            s, m = j.stage, j.micro
            src = dst = None
            if j.kind == "F":
                if s > 0:
                    src = "local" if self.owner[s - 1] == self.rank else by_key["act", s, m]
                if s < last:
                    dst = "local" if self.owner[s + 1] == self.rank else by_key["act", s + 1, m]
            elif j.kind in ("B", "I"):
                if s < last:
                    src = "local" if self.owner[s + 1] == self.rank else by_key["grad", s, m]
                if s > 0:
                    dst = "local" if self.owner[s - 1] == self.rank else by_key["grad", s - 1, m]
            if isinstance(src, Message):
                needed.append(src)
            program.append(_Ins(j, src, dst))
        # Receives are posted in each channel's order (what NCCL matches on), as early as this
        # rank's job order needs them: all of them at the start of a step.
        per_channel: dict[tuple[int, int], list[Message]] = {}
        for m_ in msgs:
            if m_.dst == self.rank:
                per_channel.setdefault((m_.src, m_.dst), []).append(m_)
        posted: dict[tuple[int, int], int] = {}
        order: list[Message] = []
        for m_ in needed:
            ch = (m_.src, m_.dst)
            for k in range(posted.get(ch, 0), m_.pos + 1):
                order.append(per_channel[ch][k])
            posted[ch] = max(posted.get(ch, 0), m_.pos + 1)
        self._recv_order = [(m_, self._spec_of(m_)) for m_ in order]
        # On the CPU every message has one receive buffer for the whole run: a fresh 256 KiB
        # buffer a step costs page faults in gloo's I/O thread while the message arrives, on
        # the path of every transfer. A step's jobs are done with its buffers (W included) before
        # the next step posts its receives. (On CUDA a buffer is read on the compute stream
        # after the host moved on, so each step allocates on the comm stream.)
        self._recv_bufs: dict[Message, list[torch.Tensor]] = {} if self._comm is not None else {
            m_: [torch.empty(shape, dtype=dt, device=self.device) for shape, dt in spec] for m_, spec in self._recv_order}
        # Per message, what the hot loop would otherwise rebuild every step: the spec a send
        # must match, the span names, its group and tags, and the wait's error text.
        self._send_info: dict[Message, _SendInfo] = {}
        for m_ in msgs:
            if m_.src == self.rank:
                spec = self._sent_spec(m_)
                self._send_info[m_] = _SendInfo(spec, f"send {m_.kind} for stage {m_.stage}",
                                                f"isend {m_.kind} for stage {m_.stage}", self._group(m_.src, m_.dst),
                                                m_.tags(len(spec)), self._peer[m_.dst])
        self._recv_info = {m_: (f"recv {m_.kind} for stage {m_.stage}",
                                f"the {'input' if m_.kind == 'act' else 'output gradient'} of stage {m_.stage} "
                                f"micro-batch {m_.micro} from rank {self._peer[m_.src]}")
                           for m_, _ in self._recv_order}
        # What posting a step's receives needs, per message in channel order: its key among
        # the step's receives, its group, its tags, its kept buffers and what gloo receives
        # into (their wire views; None on CUDA, where each step allocates).
        self._recv_plan = []
        for m_, spec in self._recv_order:
            kept = self._recv_bufs.get(m_)
            self._recv_plan.append((m_, (m_.kind, m_.stage, m_.micro), self._group(m_.src, m_.dst),
                                    m_.tags(len(spec)), kept,
                                    [wire(b) for b in kept] if kept else None, spec, self._peer[m_.src]))
        # A parameter two local stages share (tied weights) gets both stages' gradients: its
        # buffers are not written over, they start from None.
        self._resets = [_grad_reset(self.runners[s], keep=s not in self._shares_locally) for s in self.local]
        # gloo: sends are issued by a thread of their own, so that no job waits on one
        self._sender = None if self.nccl or not self._send_info else SendThread(self.global_rank, self.timeout)
        self._program = program
        # gloo: the step's receives are posted just before the first job that takes one, so
        # that the jobs ahead of it start at once (stage 0's first forwards, which the next rank
        # waits for at every step's start). A message a peer sends before that posting waits
        # for it (gloo pairs a send with its receive once both are there); nothing else changes.
        # NCCL: all at the start of the step, on the comm stream, as before.
        first = next((i for i, ins in enumerate(program) if isinstance(ins.src, Message)), len(program))
        self._post_at = 0 if self.nccl else first

    def _issue_spans(self, timer: Any, stamps: list[tuple[Message, int, int]]) -> list[Any]:
        """The send thread's ``isend`` calls of this step as spans (kind ``isend``, stream
        ``send thread``): from the hand-off (the ``send`` span) to the call's start a message
        waited for the thread; the call itself may wait for the peer to drain the socket."""
        info = self._send_info
        return [timer.host_span(step=self.step_count, stage=m.stage, kind="isend", micro=m.micro, stream="send thread",
                                start_ns=a, end_ns=b, peer=m.dst, tag=m.pos, name=info[m].isend_name)
                for m, a, b in stamps]

    def _sent_spec(self, m: Message) -> Spec:
        return self.out_spec[m.stage - 1] if m.kind == "act" else grad_spec(self.in_spec[m.stage + 1])

    def _spec_of(self, m: Message) -> Spec:
        return self.in_spec[m.stage] if m.kind == "act" else grad_spec(self.out_spec[m.stage])

    def _warm_up(self, msgs: list[Message]) -> None:
        """One small message each way on every channel, in one global order: NCCL creates a
        pair's communicator at its first operation and blocks both ranks there, so every rank
        must meet its peers in the same order (gloo just checks the connection)."""
        chans = sorted({(m.src, m.dst) for m in msgs} | {(m.dst, m.src) for m in msgs},
                       key=lambda c: (min(c), max(c), c[0] > c[1]))
        dev = self.device if self.nccl else torch.device("cpu")
        for src, dst in chans:
            if self.rank not in (src, dst):
                continue
            t = torch.zeros(1, device=dev)
            g = self._group(src, dst)
            w = (dist.isend(t, self._peer[dst], group=g, tag=1 << 21) if self.rank == src
                 else dist.irecv(t, self._peer[src], group=g, tag=1 << 21))
            self._wait(w, f"rank {self._peer[src if self.rank == dst else dst]} to join the pipeline")
        if self.nccl:
            torch.cuda.synchronize(self.device)

    # -- one step ----------------------------------------------------------------------------
    def step(self, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
        """One training step on the whole batch (``inputs``: the rank holding stage 0 needs
        them, ``targets``: the rank holding the last stage; other ranks may pass None). Returns
        the mean loss over the micro-batches on the last stage's rank, None elsewhere."""
        try:
            xs, ys = self._micro_batches(inputs, targets, "step()", targets_needed=True)
            if self._program is None:
                self._setup(xs[0] if xs is not None else None)
            if xs is not None:
                for m, x in enumerate(xs):
                    if spec_of(x, "micro-batch") != self.in_spec[0]:
                        raise ValueError(f"micro-batch {m} is {_fmt(spec_of(x, 'micro-batch'))}, but the pipeline was "
                                         f"set up for {_fmt(self.in_spec[0])} (the first step fixes the shapes)")
            prof, kept = self.profiler, self.timer
            if prof is not None:
                self.timer = prof.timer(self.step_count)
            try:
                out = self._run(xs, ys)
            finally:
                self.timer = kept
            if prof is not None:
                prof.add(self.step_count, self.spans)
            self.step_count += 1
            return out
        except BaseException as e:
            post_failure(self.global_rank, e)
            raise

    def _micro_batches(self, inputs: Any, targets: Any, call: str, targets_needed: bool
                       ) -> tuple[list[tuple[torch.Tensor, ...]] | None, list[Any] | None]:
        """The batch cut into micro-batches on this rank's device: the inputs where stage 0 lives
        (required there), the targets where the last stage lives (required if ``targets_needed``);
        None elsewhere."""
        xs = ys = None
        if 0 in self.modules:
            if inputs is None:
                raise ValueError(f"rank {self.global_rank} holds stage 0: {call} needs the inputs")
            xs = [tuple(t.to(self.device) for t in _as_tuple(x)) for x in split_batch(inputs, self.n_micro)]
        if self.n_stages - 1 in self.modules:
            if targets is None and targets_needed:
                raise ValueError(f"rank {self.global_rank} holds the last stage: {call} needs the targets")
            if targets is not None:
                ys = [y.to(self.device) if isinstance(y, torch.Tensor) else y for y in split_batch(targets, self.n_micro)]
        return xs, ys

    def _run(self, xs: list[tuple[torch.Tensor, ...]] | None, ys: list[Any] | None) -> torch.Tensor | None:
        timer, k = self.timer, self.step_count
        t_step = timer.begin(step=k, stage=None, kind="step", micro=None)
        for reset in self._resets:
            reset()
        sender = self._sender
        if sender is not None:
            sender.record = bool(getattr(timer, "enabled", False))  # stamp the isend calls of the steps that are recorded
        recvs: dict[tuple[str, int, int], tuple[list[torch.Tensor], list[Any], Any]] = {}
        post_at = self._post_at
        local: dict[tuple[str, int, int], tuple[Any, ...]] = {}
        sends: list[tuple[Any, Any]] = []
        losses: list[torch.Tensor] = []
        for pos, ins in enumerate(self._program):  # type: ignore[arg-type]
            if pos == post_at:
                self._post(recvs)
            j = ins.job
            s, m = j.stage, j.micro
            runner = self.runners[s]
            kind = j.kind
            if kind == "F" or kind in ("B", "I"):
                key = ("act", s, m) if kind == "F" else ("grad", s, m)
                if ins.src is None:
                    got = xs[m] if kind == "F" else None  # type: ignore[index]
                elif ins.src == "local":
                    got = local.pop(key)
                else:
                    got = self._take(recvs.pop(key), ins.src)
                tok = timer.begin(step=k, stage=s, kind=kind, micro=m)
                if kind == "F":
                    out = runner.forward(m, got, ys[m] if s == self.n_stages - 1 else None)  # type: ignore[index]
                    if s == self.n_stages - 1:
                        losses.append(out[0])
                        timer.end(tok)
                        continue
                else:
                    grads = runner.backward(m, got) if kind == "B" else runner.backward_input(m, got)
                    if s == 0:
                        timer.end(tok)
                        continue
                    spec = self.in_spec[s]
                    out = tuple(g if g is not None else torch.zeros(shape, dtype=dt, device=self.device)
                                for g, (shape, dt) in zip(grads, spec) if dt.is_floating_point)
                timer.end(tok)
                if ins.dst == "local":
                    local[("act", s + 1, m) if kind == "F" else ("grad", s - 1, m)] = out
                else:
                    self._send(out, ins.dst, sends)
            elif kind == "W":
                tok = timer.begin(step=k, stage=s, kind="W", micro=m)
                runner.backward_weight(m)
                timer.end(tok)
            else:
                opt = self._opt_in_loop[s]
                if opt is not None:
                    tok = timer.begin(step=k, stage=s, kind="OPT", micro=None)
                    opt.step()
                    timer.end(tok)
        if sender is not None:
            sends += sender.drain()
        for w, _ in sends:
            self._wait(w, "a send to finish")
        if self._end is not None:
            self.grad_norm = self._end.run(self._wait, timer, k)
        timer.end(t_step)
        self.spans = timer.flush()
        if sender is not None and sender.record:
            self.spans += self._issue_spans(timer, sender.issued())
        return torch.stack(losses).mean() if losses else None

    def _post(self, recvs: dict[tuple[str, int, int], tuple[list[torch.Tensor], list[Any], Any]]) -> None:
        """Post every receive of the step, in channel order."""
        timer, k, comm = self.timer, self.step_count, self._comm
        with torch.cuda.stream(comm) if comm is not None else _nullcontext():
            for m, key, group, tags, kept, kept_wire, spec, src in self._recv_plan:
                bufs = kept or [torch.empty(shape, dtype=dt, device=self.device) for shape, dt in spec]
                tok = timer.begin(step=k, stage=m.stage, kind="recv", micro=m.micro, stream="comm", peer=m.src,
                                  tag=m.pos)  # ended in _take, once the data is there
                works = [dist.irecv(b, src, group=group, tag=tag)
                         for b, tag in zip(kept_wire or [wire(b) for b in bufs], tags)]
                recvs[key] = (bufs, works, tok)

    def _take(self, posted: tuple[list[torch.Tensor], list[Any], Any], m: Message) -> tuple[torch.Tensor, ...]:
        bufs, works, recv_tok = posted
        name, what = self._recv_info[m]
        tok = self.timer.begin(step=self.step_count, stage=m.stage, kind="wait", micro=m.micro, stream="wait",
                               peer=m.src, name=name)
        for w in works:
            self._wait(w, what)
        self.timer.end(tok)
        self.timer.end(recv_tok)
        if self._comm is not None:
            cur = torch.cuda.current_stream(self.device)
            for b in bufs:
                b.record_stream(cur)  # allocated on the comm stream, read on compute
        return tuple(bufs)

    def _send(self, out: tuple[torch.Tensor, ...], m: Message, sends: list[tuple[Any, Any]]) -> None:
        info = self._send_info[m]
        spec = info.spec
        if len(out) != len(spec) or any(tuple(t.shape) != sh or t.dtype != dt for t, (sh, dt) in zip(out, spec)):
            raise ValueError(f"stage {m.stage - 1 if m.kind == 'act' else m.stage + 1} produced {_fmt(spec_of(out, 'output'))} "
                             f"for micro-batch {m.micro}, not the {_fmt(spec)} it had at the first step")
        tok = self.timer.begin(step=self.step_count, stage=m.stage, kind="send", micro=m.micro, stream="comm",
                               peer=m.dst, tag=m.pos,  # tag: the receive's, for the trace's flow arrows
                               name=info.name)  # the issue, not the transfer
        self._send_now(out, m, info, sends)
        self.timer.end(tok)

    def _send_now(self, out: tuple[torch.Tensor, ...], m: Message, info: _SendInfo,
                  sends: list[tuple[Any, Any]]) -> None:
        """CUDA: isend on the comm stream after the job; gloo: hand over to the send thread (a
        rank that sends always has one there)."""
        g, tags = info.group, info.tags
        if self._comm is not None:
            # A copy the transfer owns: a compiled stage's outputs live in CUDA-graph buffers that a
            # later replay on the compute stream may overwrite before the NCCL stream read them.
            out = tuple(t.clone(memory_format=torch.contiguous_format) for t in out)
            ev = torch.cuda.Event()
            ev.record()
            self._comm.wait_event(ev)  # the transfer starts once the job that wrote it has
            with torch.cuda.stream(self._comm):
                for t, tag in zip(out, tags):
                    t = wire(t.contiguous())
                    sends.append((dist.isend(t, info.dst, group=g, tag=tag), t))
        else:
            for t, tag in zip(out, tags):
                self._sender.send(wire(t.contiguous()), info.dst, g, tag, m)  # type: ignore[union-attr]


def _grad_reset(runner: StageRunner, keep: bool = True) -> Callable[[], None]:
    """What starts a step's gradients of ``runner``: its ``reset_grads`` (a compiled stage keeps
    its ``.grad`` buffers and writes over them) where ``keep``, else setting every ``.grad`` to
    None."""
    reset = getattr(runner, "reset_grads", None)
    if reset is not None and keep:
        return reset
    params = list(runner.parameters)

    def clear() -> None:
        for p in params:
            p.grad = None
    return clear


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def _fmt(spec: Spec) -> str:
    return ", ".join(f"{str(dt).replace('torch.', '')}{list(sh)}" for sh, dt in spec)


def _probe(module: torch.nn.Module, example: tuple[torch.Tensor, ...], device: torch.device) -> Any:
    """The module's output on the example inputs, leaving no trace: the random stream and the
    buffers (BatchNorm's running statistics) are as they were."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        out = module(*(x.detach() for x in example))
        for b, saved in buffers:
            b.copy_(saved)
    return out


__all__ = ["PipelineTrainer", "split", "split_batch", "NO_GROUP"]
