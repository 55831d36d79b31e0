"""ATen ops that return a tuple holding lists (cuDNN's RNN backward: ``(dx, dhx, dcx, dw[])``),
made ops that return one flat list, which a program's op unpacks as it unpacks any list.

A program's op writes each of its outputs to one value (``Op.outputs``); an FX graph reaches a
list inside a tuple through two ``getitem`` nodes, which no op stands for. :func:`flatten_list_returns`
rewrites such a node to call ``flowexec::flat_<op>``, the same op with its returns flattened
in order (an undefined tensor stays ``None``), and its ``getitem`` users to index that list.

>>> import torch, torch.fx as fx, operator
>>> g = fx.Graph()
>>> x = g.placeholder("x")
>>> both = g.call_function(torch.ops.aten.histogramdd.default, (x, [2, 2]))
>>> edges = g.call_function(operator.getitem, (both, 1))
>>> _ = g.output([g.call_function(operator.getitem, (both, 0)), g.call_function(operator.getitem, (edges, 1))])
>>> both.meta["val"] = (torch.empty(2, 2), [torch.empty(3), torch.empty(3)])
>>> gm = fx.GraphModule(torch.nn.Module(), g)
>>> flatten_list_returns(gm)
>>> [(n.target, n.args[1]) for n in gm.graph.nodes if n.target is operator.getitem]
[(<built-in function getitem>, 0), (<built-in function getitem>, 2)]
"""
from __future__ import annotations

import operator
import threading
from typing import Any

import torch
import torch.fx as fx

from .errors import CaptureError

_LIB = torch.library.Library("flowexec", "FRAGMENT")
_MADE: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {}  # op -> its flat op
_SOURCE: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {}  # flat op -> the op it flattens
_lock = threading.Lock()


def is_list(r: Any) -> bool:
    """Whether schema return ``r`` is a list (``Tensor[]``, ``Tensor?[]``)."""
    return isinstance(r.type, torch._C.ListType)


def _flat(returns: Any, values: Any) -> list[Any]:
    """``values``, one per schema return, with each list's items in its place."""
    return [t for r, v in zip(returns, values) for t in (v if is_list(r) else (v,))]


def mixes_lists(target: Any) -> bool:
    """Whether ``target`` is an ATen op with several returns of which one is a list."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    rets = target._schema.returns
    return len(rets) > 1 and any(is_list(r) for r in rets)


def flat_op(target: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """``flowexec::flat_<namespace>_<op>_<overload>``: ``target`` with the same arguments,
    returning its results as one list (made once a process)."""
    with _lock:
        if target in _MADE:
            return _MADE[target]
        schema = str(target._schema)
        args = schema[schema.index("(") + 1:schema.rindex(") ->")]
        if "(a" in args:  # (an op that writes or aliases its arguments would need their annotations kept)
            raise CaptureError(f"{target} returns lists inside a tuple and annotates its arguments: flowexec "
                               "cannot unpack its results")
        name = f"flat_{target.namespace}_{target._opname}_{target._overloadname or 'default'}"

        def impl(*a: Any, **kw: Any) -> list[torch.Tensor | None]:
            return _flat(target._schema.returns, target(*a, **kw))

        _LIB.define(f"{name}({args}) -> Tensor?[]")
        _LIB.impl(name, impl, "CompositeExplicitAutograd")  # (Meta too: the op's own meta kernel, where it has one)
        made = getattr(getattr(torch.ops.flowexec, name), "default")
        _MADE[target] = made
        _SOURCE[made] = target
        return made


def flattened_from(op: Any) -> torch._ops.OpOverload | None:
    """The op that :func:`flat_op` made ``op`` of, or None (a kept program names that one)."""
    return _SOURCE.get(op) if isinstance(op, torch._ops.OpOverload) else None


def flatten_list_returns(gm: fx.GraphModule) -> None:
    """Rewrite, in place, each call of an op that :func:`mixes_lists` to its :func:`flat_op`,
    and the ``getitem`` nodes that read its results to index the flat list (the module's code is
    made again only where a node changed: a large step's graph takes a while)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not mixes_lists(node.target):
            continue
        rets = node.target._schema.returns
        val = node.meta.get("val")
        if not isinstance(val, (list, tuple)) or len(val) != len(rets):
            raise CaptureError(f"{node.target} (node {node.name}): its results' lengths were not recorded")
        starts, n = [], 0
        for r, v in zip(rets, val):
            starts.append(n)
            n += len(v) if is_list(r) else 1
        for use in list(node.users):
            if use.target is not operator.getitem:
                raise CaptureError(f"{node.target} (node {node.name}): its results are used whole")
            k = use.args[1]
            if not is_list(rets[k]):
                use.args = (node, starts[k])
                continue
            for item in list(use.users):
                if item.target is not operator.getitem:
                    raise CaptureError(f"{node.target} (node {node.name}): its list {k} is used whole")
                item.args = (node, starts[k] + item.args[1])
            gm.graph.erase_node(use)
        node.target = flat_op(node.target)
        node.meta["val"] = _flat(rets, val)
        changed = True
    if changed:
        gm.recompile()
