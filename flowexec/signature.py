"""Call signatures: a call's pytree arguments flattened into leaves, and the key that says
whether a compiled program fits them.

A call ``exe(*args, **kwargs)`` is one tree: the ``args`` tuple, then the keyword arguments in
order of their names. Containers are lists, tuples, dicts (in insertion order), namedtuples
and the types registered with ``torch.utils._pytree``; leaves are tensors, Python scalars and
``None``. Options that take positions (``fetch=``, ``borrow=``) count leaves in this flattened
order (``torch.utils._pytree.tree_leaves((args, kwargs))`` with kwargs sorted by name).

:func:`flatten` is the per-call path: one walk that collects the leaves and a hashable *key*
holding the tree structure, each leaf's type and every non-tensor leaf's value. The tensors'
shapes, dtypes, devices and strides are checked apart from it (by a precomputed guard), so
a list of 200 tensors costs one ``map(type, ...)`` and one hash here.

    >>> import torch
    >>> leaves, key = flatten(([torch.ones(2), torch.zeros(3)], 0.5), {})
    >>> len(leaves), leaves[2]
    (3, 0.5)
    >>> tree, _, paths = tree_of(({"w": [torch.ones(2)], "lr": 0.1},), {"scale": 2})
    >>> paths
    ["args[0]['w'][0]", "args[0]['lr']", "kwargs['scale']"]
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from .errors import InputError

SCALARS: tuple[type, ...] = (int, float, bool, complex, str, type(None))
_SCALAR_TYPES = frozenset(SCALARS)
_LEAF_WORDS = "tensors, Python scalars (int, float, bool, complex, str) and None"


class _Unsupported(Exception):
    """A leaf of a type flowexec cannot take (the slow path names its path)."""


# Children-type tuples seen before -> None when every child is a tensor (most containers),
# else the types with tensor subclasses (nn.Parameter, ...) read as torch.Tensor: the key says
# where tensors are, not which class they are, so passing parameters or plain tensors is one
# structure (their shapes and the rest are the tensor guard's business).
_CANONICAL: dict[tuple[type, ...], tuple[type, ...] | None] = {}


def _canonical(types: tuple[type, ...]) -> tuple[type, ...] | None:
    try:
        return _CANONICAL[types]
    except KeyError:
        pass
    if len(_CANONICAL) > 4096:  # structures seen once should not pile up
        _CANONICAL.clear()
    tensor = [issubclass(t, torch.Tensor) for t in types]
    hit = _CANONICAL[types] = None if all(tensor) else tuple(
        torch.Tensor if is_t else t for t, is_t in zip(types, tensor))
    return hit


def _is_namedtuple(t: type) -> bool:
    return issubclass(t, tuple) and hasattr(t, "_fields")


def _hashable(ctx: Any) -> Any:
    try:
        hash(ctx)
        return ctx
    except TypeError:
        return repr(ctx)


def _children(seq: Sequence[Any], tag: Any, leaves: list[Any], key: list[Any]) -> None:
    types = tuple(map(type, seq))
    canon = _canonical(types)
    if canon is None:
        key.append((tag, len(types)))
        leaves.extend(seq)
        return
    key.append((tag, canon))
    tensor = torch.Tensor
    for o, t, c in zip(seq, types, canon):
        if c is tensor:  # (canon reads every tensor subclass as torch.Tensor)
            leaves.append(o)
        elif t in _SCALAR_TYPES:
            leaves.append(o)
            key.append(o)  # its type is in `types` already: 1, 1.0 and True stay apart
        elif t is list or t is tuple:  # the common containers without _node's dispatch
            _children(o, t, leaves, key)
        else:
            _node(o, t, leaves, key)


def _node(o: Any, t: type, leaves: list[Any], key: list[Any]) -> None:
    if t is list or t is tuple or _is_namedtuple(t):
        _children(o, t, leaves, key)
    elif t is dict:
        _children(list(o.values()), (dict, tuple(o)), leaves, key)
    elif t in pytree.SUPPORTED_NODES:
        kids, ctx = pytree.SUPPORTED_NODES[t].flatten_fn(o)
        _children(list(kids), (t, _hashable(ctx)), leaves, key)
    else:
        raise _Unsupported(t)


def flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], tuple[Any, ...]]:
    """The call's leaves and its structure key (see the module docstring); raises
    :class:`~flowexec.InputError` naming the path of a leaf of an unsupported type."""
    leaves: list[Any] = []
    key: list[Any] = []
    try:
        _children(args, tuple, leaves, key)
        if kwargs:
            names = tuple(sorted(kwargs))
            _children([kwargs[n] for n in names], ("kwargs", names), leaves, key)
    except _Unsupported:
        tree_of(args, kwargs)  # raises, naming the leaf
        raise
    return leaves, tuple(key)


# --- the tree itself (capture time, not per call) -------------------------------------------
# A tree is None for a leaf or (kind, context, children): kind "list", "tuple", "dict",
# "namedtuple" (context: the class), "node" (context: (class, pytree context)).

def _tree(o: Any, path: str, leaves: list[Any], paths: list[str]) -> Any:
    t = type(o)
    if t in _SCALAR_TYPES or isinstance(o, torch.Tensor):
        leaves.append(o)
        paths.append(path)
        return None
    if t is list or t is tuple:
        return (t.__name__, None, tuple(_tree(c, f"{path}[{i}]", leaves, paths) for i, c in enumerate(o)))
    if _is_namedtuple(t):
        return ("namedtuple", t, tuple(_tree(c, f"{path}.{f}", leaves, paths) for f, c in zip(t._fields, o)))
    if t is dict:
        return ("dict", tuple(o), tuple(_tree(v, f"{path}[{k!r}]", leaves, paths) for k, v in o.items()))
    if t in pytree.SUPPORTED_NODES:
        kids, ctx = pytree.SUPPORTED_NODES[t].flatten_fn(o)
        return ("node", (t, ctx), tuple(_tree(c, f"{path}[{i}]", leaves, paths) for i, c in enumerate(kids)))
    raise InputError(f"{path}: flowexec.compile takes containers (list, tuple, dict, namedtuple, types registered "
                     f"with torch.utils._pytree) of {_LEAF_WORDS}, got {t.__name__}")


def tree_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[Any], list[str]]:
    """(tree, leaves, leaf paths) of a call, in :func:`flatten`'s order; paths read
    ``args[0]['opt'][3]`` or ``kwargs['scale']``."""
    leaves: list[Any] = []
    paths: list[str] = []
    a = tuple(_tree(o, f"args[{i}]", leaves, paths) for i, o in enumerate(args))
    names = tuple(sorted(kwargs))
    k = tuple(_tree(kwargs[n], f"kwargs[{n!r}]", leaves, paths) for n in names)
    return ("call", names, (a, k)), leaves, paths


def output_tree(out: Any) -> tuple[Any, list[Any]]:
    """(tree, leaves) of what ``fn`` returned (leaf paths read ``out[0]['loss']``)."""
    leaves: list[Any] = []
    tree = _tree(out, "out", leaves, [])
    return tree, leaves


def build(tree: Any, it: Any) -> Any:
    """The containers of ``tree`` around the leaves taken from the iterator ``it``."""
    if tree is None:
        return next(it)
    kind, ctx, kids = tree
    children = [build(c, it) for c in kids]
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    if kind == "dict":
        return dict(zip(ctx, children))
    if kind == "namedtuple":
        return ctx(*children)
    if kind == "node":
        return pytree.SUPPORTED_NODES[ctx[0]].unflatten_fn(children, ctx[1])
    raise ValueError(f"not a tree node: {kind!r}")


def call_arguments(tree: Any, leaves: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` rebuilt from a call tree and its leaves."""
    _, names, (a, k) = tree
    it = iter(leaves)
    args = tuple(build(c, it) for c in a)
    return args, {n: build(c, it) for n, c in zip(names, k)}


def builder(tree: Any) -> Callable[[Sequence[Any]], Any]:
    """A function from flat outputs to the containers of ``tree``: precomputed once per
    signature, so the common shapes (one tensor, a flat tuple or list) cost a slice."""
    if tree is None:
        return lambda flat: flat[0]
    kind, _, kids = tree
    if all(c is None for c in kids):
        n = len(kids)
        if kind == "tuple":
            return lambda flat: tuple(flat[:n])
        if kind == "list":
            return lambda flat: flat[:n]
    return lambda flat: build(tree, iter(flat))


def describe_tree(tree: Any) -> str:
    """A short text of a container's kind and size (for messages)."""
    if tree is None:
        return "a leaf"
    kind, ctx, kids = tree
    if kind == "dict":
        return f"dict with keys {list(ctx)}"
    if kind == "namedtuple":
        return f"{ctx.__name__}"
    if kind == "node":
        return f"{ctx[0].__name__} of {len(kids)}"
    return f"{kind} of {len(kids)}"


def first_difference(tree_a: Any, tree_b: Any, path: str = "") -> tuple[str, str, str] | None:
    """(path, what a has there, what b has there) where two call trees first differ in
    structure, else None."""
    if tree_a is None or tree_b is None or tree_a[0] != tree_b[0] or tree_a[1] != tree_b[1] \
            or len(tree_a[2]) != len(tree_b[2]):
        if tree_a is None and tree_b is None:
            return None
        return path, describe_tree(tree_a), describe_tree(tree_b)
    for i, (a, b) in enumerate(zip(tree_a[2], tree_b[2])):
        kind, ctx = tree_a[0], tree_a[1]
        sub = (f"[{ctx[i]!r}]" if kind == "dict" else f".{ctx._fields[i]}" if kind == "namedtuple" else f"[{i}]")
        d = first_difference(a, b, path + sub)
        if d is not None:
            return d
    return None


def call_difference(tree_a: Any, tree_b: Any) -> tuple[str, str, str] | None:
    """:func:`first_difference` for two call trees, with paths that read ``args[0][1]``."""
    _, na, (aa, ka) = tree_a
    _, nb, (ab, kb) = tree_b
    if len(aa) != len(ab):
        return "args", f"{len(aa)} positional argument(s)", f"{len(ab)}"
    for i, (x, y) in enumerate(zip(aa, ab)):
        d = first_difference(x, y, f"args[{i}]")
        if d is not None:
            return d
    if na != nb:
        return "kwargs", f"keyword arguments {list(na)}", f"{list(nb)}"
    for n, x, y in zip(na, ka, kb):
        d = first_difference(x, y, f"kwargs[{n!r}]")
        if d is not None:
            return d
    return None
