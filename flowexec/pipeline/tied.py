"""Weights tied between pipeline stages: which stages share a parameter, which local stages
must share one optimizer, and which parameters need their gradients summed across ranks.

A parameter object that appears in several stage modules (an embedding tied to the output
head, a block reused twice) gets contributions from every stage that uses it. Two cases:

- **on one rank** (ZBV puts stages ``0`` and ``2p-1`` on rank 0; interleaved puts ``r`` and
  ``r+p`` together): the stages' jobs add into the same ``.grad``; the stages get one
  optimizer between them, stepped once, by the ``OPT`` job that comes last on the rank (an
  optimizer per stage would step the weight twice, the first time on half its gradient);
- **across ranks** (every rank built the same model, so each holds its own copy of the
  weight): after the step's last job every rank that holds a copy sums the copies' gradients
  (``all_reduce`` in a group of those ranks), and only then steps the optimizers of the stages
  that hold it; the copies start equal (the same seeded model on every rank) and stay equal.
  This is Megatron-LM's embedding group.

All functions here are pure: they read modules and the stage -> rank placement and return
tables the trainer keeps.

>>> import torch
>>> lin = torch.nn.Linear(2, 2)
>>> stages = [torch.nn.Sequential(lin), torch.nn.Linear(2, 2), torch.nn.Sequential(lin)]
>>> ties = find_ties(stages)
>>> [(t.stages, t.name) for t in ties]
[((0, 2), 'stage 0: 0.weight'), ((0, 2), 'stage 0: 0.bias')]
>>> optimizer_groups([0, 2], ties)
[(0, 2)]
>>> cross_rank_ties(ties, {0: 0, 1: 1, 2: 1})[0].ranks
(0, 1)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True, slots=True)
class Tie:
    """A parameter used by several stages: its position (``index``: the order of first
    appearance over the stages, the same on every rank), the stages that use it, its name in
    the first of them, and the ranks that hold those stages (filled by :func:`cross_rank_ties`)."""

    index: int
    stages: tuple[int, ...]
    param: str
    ranks: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"stage {self.stages[0]}: {self.param}"


def find_ties(stages: Sequence[torch.nn.Module]) -> list[Tie]:
    """Every trainable parameter that more than one stage uses, in order of first appearance."""
    first: dict[int, tuple[int, str]] = {}  # id -> (stage, name) where it first appears
    users: dict[int, list[int]] = {}
    order: list[int] = []
    for s, mod in enumerate(stages):
        for name, p in mod.named_parameters():
            if not p.requires_grad:
                continue
            key = id(p)
            if key not in first:
                first[key] = (s, name)
                users[key] = []
                order.append(key)
            if s not in users[key]:
                users[key].append(s)
    ties = []
    for key in order:
        if len(users[key]) > 1:
            ties.append(Tie(len(ties), tuple(users[key]), first[key][1]))
    return ties


def optimizer_groups(local: Sequence[int], ties: Sequence[Tie]) -> list[tuple[int, ...]]:
    """The local stages joined by shared parameters (each group gets one optimizer), as
    sorted tuples; a stage that shares nothing locally is a group of its own."""
    parent = {s: s for s in local}

    def root(s: int) -> int:
        while parent[s] != s:
            parent[s] = parent[parent[s]]
            s = parent[s]
        return s

    for t in ties:
        here = [s for s in t.stages if s in parent]
        for s in here[1:]:
            parent[root(s)] = root(here[0])
    groups: dict[int, list[int]] = {}
    for s in local:
        groups.setdefault(root(s), []).append(s)
    return sorted(tuple(sorted(g)) for g in groups.values())


def cross_rank_ties(ties: Sequence[Tie], owner: Mapping[int, int]) -> list[Tie]:
    """The ties whose stages live on more than one rank, with those ranks filled in."""
    out = []
    for t in ties:
        ranks = tuple(sorted({owner[s] for s in t.stages}))
        if len(ranks) > 1:
            out.append(Tie(t.index, t.stages, t.param, ranks))
    return out


def unique_parameters(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The trainable parameters of ``modules``, each once, in order of first appearance."""
    seen: set[int] = set()
    out = []
    for mod in modules:
        for p in mod.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def norm_parameters(modules: Sequence[torch.nn.Module], stages: Sequence[torch.nn.Module], cross: Sequence[Tie],
                    rank: int) -> list[torch.nn.Parameter]:
    """The parameters of ``modules`` (this rank's stages) whose gradients ``rank`` counts toward
    a norm over the whole model: each once, but a weight tied across ranks (``cross``) only on
    the lowest of its ranks, since after the sum every copy holds the whole gradient."""
    skip = {id(parameter_at(stages, t)) for t in cross if rank in t.ranks and rank != min(t.ranks)}
    return [p for p in unique_parameters(modules) if id(p) not in skip]


def parameter_at(stages: Sequence[torch.nn.Module], tie: Tie) -> torch.nn.Parameter:
    """The parameter object a tie names, looked up in its first stage."""
    return stages[tie.stages[0]].get_parameter(tie.param)


__all__ = ["Tie", "cross_rank_ties", "find_ties", "norm_parameters", "optimizer_groups", "parameter_at",
           "unique_parameters"]
