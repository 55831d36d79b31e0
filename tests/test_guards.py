"""Nothing passes unnoticed (issue 37): every kind of Python value a capture reads, changed
between calls, gives eager's answer (a re-capture) or an error naming it.

Each case builds a fresh function and the state it reads, calls it, changes one value, calls it
again: the compiled function must return what eager returns after the change, and the change
must alter eager's answer (else the case would prove nothing).
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import sys
import types
import weakref
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.errors import CaptureError, GuardError
from flowexec.guards import Guard, GuardSet, describe
from flowexec.models import make_step
from helpers import twin

G_SCALE = 1.0
G_TABLE = {"bias": 0.0, "inner": {"gain": 1.0}}


@dataclasses.dataclass
class Opts:
    power: float = 1.0


G_OPTS = Opts()


def g_helper(x: torch.Tensor) -> torch.Tensor:
    return x * G_TABLE["inner"]["gain"]  # a global read by a function fn calls


def g_act(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)
        self.temperature = 1.0
        self.cfg = {"shift": 0.0}
        self.act = torch.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self.lin(x))) / self.temperature + self.cfg["shift"]


def _reset_globals() -> None:
    global G_SCALE, g_act
    G_SCALE = 1.0
    G_TABLE.update(bias=0.0, inner={"gain": 1.0})
    G_OPTS.power = 1.0

    def act(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)
    g_act = act


def _forward_case(change: Callable[[Net], None]) -> Callable[[], tuple]:
    def make() -> tuple:
        _reset_globals()
        net = Net()
        return (lambda x: net(x)), (lambda: change(net)), net
    return make


def _global_case(change: Callable[[], None]) -> Callable[[], tuple]:
    def make() -> tuple:
        _reset_globals()
        w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))

        def fn(x):
            y = g_helper(g_act(x @ w)) * G_SCALE + G_TABLE["bias"]
            return y ** G_OPTS.power
        return fn, change, None
    return make


def _closure_case() -> tuple:
    settings = {"k": 2.0}
    factor = [1.0]

    def fn(x):
        return x * settings["k"] + factor[0]

    def change() -> None:
        settings["k"] = 3.0
        factor[0] = -1.0
    return fn, change, None


class _Scale:
    """A plain helper object (not a module): its method reads its attributes."""

    def __init__(self) -> None:
        self.gain = 2.0
        self.table = {"shift": 0.5}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x) + self.table["shift"]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def _object_case(change: Callable[[_Scale], None], passed: bool = False) -> Callable[[], tuple]:
    """A callable object reached through fn's closure, or (``passed``) handed to a helper as
    its first argument."""
    def make() -> tuple:
        obj = _Scale()

        def helper(o: _Scale, x: torch.Tensor) -> torch.Tensor:
            return x * o.gain - o.table["shift"]

        def fn(x):
            return helper(obj, x) if passed else obj(x).tanh()
        return fn, (lambda: change(obj)), obj
    return make


def _set_global(name: str, value: Any) -> Callable[[], None]:
    def change() -> None:
        globals()[name] = value
    return change


def _training_case(change: Callable[[torch.nn.Module, torch.optim.Optimizer], None],
                   opt: Callable[[Any], torch.optim.Optimizer] = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                   zero: bool = True):
    """A training step; ``zero=False``: gradients accumulate over calls (what fn finds in
    ``.grad`` then matters)."""
    def make() -> tuple:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        o = opt(model.parameters())

        def step(x):
            if zero:
                o.zero_grad(set_to_none=False)
            loss = model(x).square().mean()
            loss.backward()
            o.step()
            return torch.cat([p.detach().flatten() for p in model.parameters()])
        return step, (lambda: change(model, o)), model
    return make


def _add_group(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    bias = model[2].bias  # moved to a group of its own, with another lr
    opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if p is not bias]
    opt.add_param_group({"params": [bias], "lr": 1.0})


G_LIB = torch.tanh


def _library_global_case() -> tuple:
    global G_LIB
    G_LIB = torch.tanh

    def fn(x):
        return G_LIB(x) * 2  # (a builtin in a global: guarded by identity)

    def change() -> None:
        global G_LIB
        G_LIB = torch.sigmoid
    return fn, change, None


def _numpy_case() -> tuple:
    import numpy as np

    _reset_globals()
    net = Net()
    net.temperature = np.float32(1.0)
    return (lambda x: net(x)), (lambda: setattr(net, "temperature", np.float32(4.0))), net


def _class_attribute_case(read: str, change: str) -> Callable[[], tuple]:
    """A module that reads a number its class holds (``read``: ``"self"`` as ``self.shift``,
    ``"type"`` as ``type(self).shift``), held by its base class; ``change``: ``"class"`` sets one
    on its own class between calls, ``"base"`` sets the base's, ``"instance"`` sets one on the
    instance, in front of the classes'."""
    def make() -> tuple:
        class Base(torch.nn.Module):
            shift = 0.5

        class Block(Base):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.lin = torch.nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin(x) * (type(self).shift if read == "type" else self.shift)

        block = Block()
        where = {"class": Block, "base": Base, "instance": block}[change]
        return (lambda x: block(x)), (lambda: setattr(where, "shift", 2.0)), block
    return make


def _method_case(where: str) -> Callable[[], tuple]:
    """A block whose ``forward`` calls a helper method; between calls ``where`` changes the code
    that runs: ``"class"`` replaces ``Block.forward``, ``"helper"`` the helper method on the
    class, ``"instance"`` sets a ``forward`` on the instance, ``"torch"`` patches
    ``torch.nn.Linear.forward`` (put back by the next make and by the test's finaliser)."""
    def make() -> tuple:
        _unpatch()
        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.lin = torch.nn.Linear(4, 4)

            def scale(self, x: torch.Tensor) -> torch.Tensor:
                return x * 0.5

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.scale(self.lin(x))

        block = Block()

        def other_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x)) - 1.0

        def change() -> None:
            if where == "class":
                Block.forward = other_forward
            elif where == "helper":
                Block.scale = lambda self, x: x * 3.0
            elif where == "instance":
                block.forward = lambda x: other_forward(block, x)
            else:
                _patch(torch.nn.Linear, "forward", lambda self, x: torch.nn.functional.linear(x, self.weight) * 2.0)
        return (lambda x: block(x)), change, block
    return make


_PATCHED: list = []  # (owner, name, value as it was) while a case has patched a torch function


def _patch(owner: Any, name: str, value: Any) -> None:
    _PATCHED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _unpatch() -> None:
    while _PATCHED:
        owner, name, value = _PATCHED.pop()
        setattr(owner, name, value)


def _patched_function_case() -> tuple:
    """fn calls ``F.gelu`` through its module (a global here); between calls the function in
    torch's module is replaced (put back by the next make and by the test's finaliser)."""
    _unpatch()
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    return ((lambda x: F.gelu(lin(x))), (lambda: _patch(F, "gelu", lambda t, approximate="none": torch.tanh(t))),
            lin)


def _patched_inside_torch_case(when: str) -> Callable[[], tuple]:
    """``nn.GELU`` looks ``F.gelu`` up in torch's module at each call, which no frame scan of
    the user's code sees: between calls the function there is replaced ("patched"), or a
    replacement made before the capture is put back ("restored"), which no dispatch reports."""
    def make() -> tuple:
        _unpatch()
        torch.manual_seed(0)
        lin, act = torch.nn.Linear(4, 4), torch.nn.GELU()
        tanh = (lambda t, approximate="none": torch.tanh(t))
        if when == "restored":
            _patch(F, "gelu", tanh)
        change = _unpatch if when == "restored" else (lambda: _patch(F, "gelu", tanh))
        return (lambda x: act(lin(x))), change, lin
    return make


def _patched_nested_case() -> tuple:
    """``nn.LayerNorm`` calls ``F.layer_norm``, which calls ``torch.layer_norm``: a call no
    torch function mode sees (the mode is off inside its own handler). Between calls the
    inner function is replaced."""
    _unpatch()
    torch.manual_seed(0)
    lin, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    inner = torch.layer_norm
    return ((lambda x: norm(lin(x))), (lambda: _patch(torch, "layer_norm", lambda *a, **k: inner(*a, **k) + 1.0)),
            lin)


@pytest.fixture(autouse=True)
def _unpatch_linear() -> Any:
    yield
    _unpatch()


class _Gain:
    """A plain helper whose method reads a number its class holds."""

    factor = 2.0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _class_attribute_of_object_case() -> tuple:
    gain = _Gain()

    def fn(x):
        return gain.apply(x).tanh()

    def change() -> None:
        _Gain.factor = 3.0
    _Gain.factor = 2.0
    return fn, change, gain


def _plain_method_case(where: str) -> Callable[[], tuple]:
    """A plain helper object's method, called from fn; between calls ``where`` (``"class"``,
    ``"instance"``) gets another function for it."""
    def make() -> tuple:
        class Gain:
            def apply(self, x: torch.Tensor) -> torch.Tensor:
                return x * 2.0

        gain = Gain()

        def change() -> None:
            if where == "class":
                Gain.apply = lambda self, x: x * 3.0
            else:
                gain.apply = lambda x: x - 1.0
        return (lambda x: gain.apply(x).tanh()), change, gain
    return make


class _Helper:
    """A plain helper that holds a tensor beside its numbers (issue: its numbers went unseen)."""

    def __init__(self) -> None:
        self.w = torch.linspace(0.5, 1.5, 4)
        self.scale = 2.0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w * self.scale


class _Holds(torch.nn.Module):
    """A module that keeps a helper (a plain object) and calls it."""

    def __init__(self, helper: _Helper, passed: bool) -> None:
        super().__init__()
        self.helper, self.passed = helper, passed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.passed:
            return _scaled(self.helper.apply, x)
        return self.helper.apply(x).tanh()


def _scaled(apply: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return apply(x) - 1


def _tensor_holder_case(passed: bool = False) -> tuple:
    """A helper holding a tensor, kept by a module: its method reads its number, called by the
    module or (``passed``) by a function the module hands the method to."""
    helper = _Helper()
    holds = _Holds(helper, passed)
    return (lambda x: holds(x)), (lambda: setattr(helper, "scale", 3.0)), helper


# --- configs in containers the guards once skipped (the second keep review: c05, c06, c08, c09,
# c15, c40) ---

_NT = collections.namedtuple("_NT", "scale")


@dataclasses.dataclass(slots=True)
class _SlotCfg:
    scale: float


G_NT = _NT(2.0)
G_SHAPE = torch.Size([3, 2, 2])
G_SLOT = _SlotCfg(2.0)
G_FLAGS: set[str] = set()
G_FROZEN: frozenset[str] = frozenset()
G_DEEP: dict[str, Any] = {}
G_ORDER: dict[str, float] = {}
G_LONG: dict[str, float] = {}


def _cfg_scaled(c: Any, t: torch.Tensor) -> torch.Tensor:
    return t * c.scale  # (a config handed to a helper: used whole)


def _container_case(kind: str) -> Callable[[], tuple]:
    """A config of ``kind`` in a global, read by fn or handed to a helper, changed between calls
    (rebound or changed in place)."""
    def make() -> tuple:
        global G_NT, G_SHAPE, G_FROZEN
        G_NT, G_SHAPE, G_FROZEN = _NT(2.0), torch.Size([3, 2, 2]), frozenset()
        G_SLOT.scale = 2.0
        G_FLAGS.clear()
        G_DEEP.clear()
        G_DEEP.update(model={"head": {"out": {"scale": 2.0}}})
        G_ORDER.clear()
        G_ORDER.update(a=2.0, b=3.0)
        G_LONG.clear()
        G_LONG.update({f"k{i}": float(i) for i in range(80)})  # (past the leaf budget: one copy)
        w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))

        def fn(x):
            h = x @ w
            if kind == "namedtuple":
                return _cfg_scaled(G_NT, h)
            if kind == "slots":
                return _cfg_scaled(G_SLOT, h)
            if kind == "size":
                return h.reshape(G_SHAPE).softmax(-1).reshape(3, 4)
            if kind == "set":
                return h * 2 if "double" in G_FLAGS else h
            if kind == "frozenset":
                return h * 2 if "double" in G_FROZEN else h
            if kind == "order":  # (the entries in the dict's order: equality ignores it)
                return torch.cat([h * s for s in G_ORDER.values()], 1)
            if kind == "long order":
                return torch.stack([h.sum(1) * s for s in list(G_LONG.values())[:2]], 1)
            c = G_DEEP  # (used whole: the read below is four levels into it)
            return h * c["model"]["head"]["out"]["scale"]

        def change() -> None:
            global G_NT, G_SHAPE, G_FROZEN
            if kind == "namedtuple":
                G_NT = _NT(3.0)
            elif kind == "slots":
                G_SLOT.scale = 3.0
            elif kind == "size":
                G_SHAPE = torch.Size([3, 1, 4])
            elif kind == "set":
                G_FLAGS.add("double")
            elif kind == "frozenset":
                G_FROZEN = frozenset({"double"})
            elif kind == "order":  # (in place: the same items, 'a' now last)
                G_ORDER["a"] = G_ORDER.pop("a")
            elif kind == "long order":
                G_LONG["k0"] = G_LONG.pop("k0")
            else:
                G_DEEP["model"]["head"]["out"]["scale"] = 3.0
        return fn, change, None
    return make


class _Columns(torch.nn.Module):
    """Scales each of 80 columns by a number of a list it keeps (more numbers than a container's
    leaf guards once covered)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 80)
        self.scales = [1.0] * 80

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.stack([h[:, i] * self.scales[i] for i in range(80)], 1).sum(1, keepdim=True)


def _leaky(x: torch.Tensor, slope: float = 0.1) -> torch.Tensor:
    return torch.nn.functional.leaky_relu(x, slope)


def _function_default_case() -> tuple:
    """A function kept on a module whose default changes between calls."""
    _leaky.__defaults__ = (0.1,)
    net = Net()
    net.act = _leaky
    return (lambda x: net(x)), (lambda: setattr(_leaky, "__defaults__", (0.9,))), net


def _long_list_case() -> tuple:
    m = _Columns()
    return (lambda x: m(x)), (lambda: m.scales.__setitem__(79, 5.0)), m


class _NsCfg:
    """A class used as a config namespace (never instantiated)."""

    scale = 2.0


G_NS_MOD = types.ModuleType("_ns_cfg")  # a config module (as `import config`), with a file of the user's
G_NS_MOD.__file__ = __file__


def _namespace_case(kind: str) -> Callable[[], tuple]:
    """A class or a Python module used as a config namespace, read by name with ``getattr`` (the
    second keep review's c19, c20): its entry changed between calls."""
    def make() -> tuple:
        _NsCfg.scale = 2.0
        G_NS_MOD.scale, G_NS_MOD.act = 2.0, torch.tanh
        w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
        key = "act" if kind == "module function" else "scale"

        def fn(x):
            ns = _NsCfg if kind == "class" else G_NS_MOD
            if key == "act":
                return getattr(ns, key)(x @ w)
            return (x @ w) * getattr(ns, key)

        def change() -> None:
            if kind == "class":
                _NsCfg.scale = 3.0
            elif kind == "module":
                G_NS_MOD.scale = 3.0
            else:
                G_NS_MOD.act = torch.sigmoid
        return fn, change, None
    return make


CASES: dict[str, Callable[[], tuple]] = {
    "module training flag": _forward_case(lambda n: n.drop.eval()),
    "module attribute": _forward_case(lambda n: setattr(n, "temperature", 4.0)),
    "module container item": _forward_case(lambda n: n.cfg.update(shift=1.5)),
    "module function attribute": _forward_case(lambda n: setattr(n, "act", torch.sigmoid)),
    "module forward hook added": _forward_case(lambda n: n.lin.register_forward_hook(lambda m, i, o: o * 2)),
    "global number": _global_case(_set_global("G_SCALE", 3.0)),
    "global dict item": _global_case(lambda: G_TABLE.update(bias=2.0)),
    "global nested dict item read by a helper": _global_case(lambda: G_TABLE["inner"].update(gain=5.0)),
    "global object attribute": _global_case(lambda: setattr(G_OPTS, "power", 2.0)),
    "global function replaced": _global_case(_set_global("g_act", torch.sigmoid)),
    "library function in a global replaced": _library_global_case,
    "numpy scalar module attribute": _numpy_case,
    "module swapped into a Sequential": _training_case(lambda m, o: m.__setitem__(1, torch.nn.ReLU())),
    "closure numbers": _closure_case,
    "plain object attribute read by its method": _object_case(lambda o: setattr(o, "gain", 3.0)),
    "plain object container read by its method": _object_case(lambda o: o.table.update(shift=-1.0)),
    "plain object passed to a helper": _object_case(lambda o: setattr(o, "gain", -1.0), passed=True),
    "requires_grad": _training_case(lambda m, o: m[0].weight.requires_grad_(False)),
    "grad replaced": _training_case(lambda m, o: setattr(m[0].weight, "grad", torch.ones_like(m[0].weight)),
                                    zero=False),
    "grad set to None": _training_case(lambda m, o: setattr(m[0].weight, "grad", None), zero=False),
    "optimizer flag": _training_case(lambda m, o: o.param_groups[0].update(nesterov=True)),
    "optimizer number read on the host": _training_case(lambda m, o: o.param_groups[0].update(momentum=0.0)),
    "optimizer lr becomes a tensor": _training_case(lambda m, o: o.param_groups[0].update(lr=torch.tensor(0.5))),
    "optimizer param group added": _training_case(_add_group),
    "optimizer state cleared": _training_case(lambda m, o: o.state.clear()),
    "parameter replaced": _training_case(lambda m, o: (setattr(m[0], "weight", torch.nn.Parameter(torch.ones(8, 4))),
                                                       o.param_groups[0]["params"].__setitem__(0, m[0].weight))),
    "submodule replaced": _forward_case(lambda n: setattr(n, "drop", torch.nn.Identity())),
    "class attribute read through self": _class_attribute_case("self", "class"),
    "class attribute read through type(self)": _class_attribute_case("type", "class"),
    "base class attribute": _class_attribute_case("self", "base"),
    "class attribute covered by an instance attribute": _class_attribute_case("self", "instance"),
    "plain object class attribute": _class_attribute_of_object_case,
    "plain object holding a tensor": _tensor_holder_case,
    "plain object holding a tensor passed to a helper": lambda: _tensor_holder_case(passed=True),
    "namedtuple config passed to a helper": _container_case("namedtuple"),
    "slotted dataclass config passed to a helper": _container_case("slots"),
    "torch.Size global in a reshape": _container_case("size"),
    "set of flags tested with in": _container_case("set"),
    "frozenset of flags tested with in": _container_case("frozenset"),
    "config dict four levels deep": _container_case("deep"),
    "dict reordered, its values read in order": _container_case("order"),
    "dict of 80 numbers reordered": _container_case("long order"),
    "module list of 80 numbers, the last changed": _long_list_case,
    "default of a function kept on a module": _function_default_case,
    "method replaced on the class": _method_case("class"),
    "helper method replaced on the class": _method_case("helper"),
    "forward set on the instance": _method_case("instance"),
    "torch module's forward patched": _method_case("torch"),
    "torch function patched, called through its module": _patched_function_case,
    "torch function patched where torch's module reads it": _patched_inside_torch_case("patched"),
    "torch function put back where torch's module reads it": _patched_inside_torch_case("restored"),
    "torch function patched where torch's own function calls it": _patched_nested_case,
    "plain object's method replaced on its class": _plain_method_case("class"),
    "plain object's method set on the instance": _plain_method_case("instance"),
    "class namespace read with getattr": _namespace_case("class"),
    "module namespace read with getattr": _namespace_case("module"),
    "library function in a module namespace read with getattr": _namespace_case("module function"),
}

# The cases above whose values the guards once skipped: each must capture once when nothing changes.
CONTAINER_CASES = {"namedtuple config passed to a helper": r"G_NT: _NT\(scale=2\.0\) -> _NT\(scale=3\.0\)",
                   "slotted dataclass config passed to a helper": r"G_SLOT\.scale: 2\.0 -> 3\.0",
                   "torch.Size global in a reshape": r"G_SHAPE: torch\.Size\(\[3, 2, 2\]\) -> ",
                   "set of flags tested with in": r"G_FLAGS: set\(\) -> \{'double'\}",
                   "frozenset of flags tested with in": r"G_FROZEN: frozenset\(\) -> frozenset\(\{'double'\}\)",
                   "config dict four levels deep": r"G_DEEP\['model'\]\['head'\]\['out'\]\['scale'\]: 2\.0 -> 3\.0",
                   "module list of 80 numbers, the last changed": r"m\.scales\[79\]: 1\.0 -> 5\.0",
                   "dict reordered, its values read in order": r"G_ORDER\.keys\(\): \('a', 'b'\) -> \('b', 'a'\)",
                   "dict of 80 numbers reordered": r"G_LONG\.keys\(\): \('k0', 'k1', .* -> \('k1', 'k2', ",
                   "class namespace read with getattr": r"_NsCfg\.scale: 2\.0 -> 3\.0",
                   "module namespace read with getattr": r"G_NS_MOD\.scale: 2\.0 -> 3\.0",
                   "library function in a module namespace read with getattr": r"G_NS_MOD\.act: .*tanh.* -> .*sigmoid"}


def _calls(make: Callable[[], tuple], wrap: Callable) -> list[torch.Tensor]:
    fn, change, _ = make()
    exe = wrap(fn)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(3, 4, generator=g) for _ in range(4)]
    out = []
    torch.manual_seed(11)
    for i, x in enumerate(xs):
        out.append(exe(x).detach().clone())
        if i == 1:
            change()
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_changed_value_gives_eager_answer(name: str) -> None:
    make = CASES[name]
    eager = _calls(make, lambda f: f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flowexec.RecaptureWarning)
        mine = _calls(make, flowexec.compile)
    for k, (a, b) in enumerate(zip(mine, eager)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}, call {k}: {m}")
    unchanged = _calls(lambda: (make()[0], lambda: None, None), lambda f: f)
    assert not torch.allclose(unchanged[-1], eager[-1]), f"{name}: the change does not alter eager's answer"


@pytest.mark.parametrize("name", list(CONTAINER_CASES))
def test_a_config_in_a_container_captures_once_and_names_the_change(name: str) -> None:
    """Namedtuples, torch.Size, sets, slotted objects, containers deeper or longer than the
    leaf guards reach: no capture while nothing changes, and the change is named to its entry."""
    fn, change, _ = CASES[name]()
    exe = flowexec.compile(fn)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", flowexec.RecaptureWarning)
        for _ in range(3):
            exe(x)
    change()
    with pytest.warns(flowexec.RecaptureWarning, match=CONTAINER_CASES[name]):
        got = exe(x)
    torch.testing.assert_close(got, fn(x), rtol=1e-5, atol=1e-6)
    assert sum(map(len, exe._cache.values())) == 2


def test_recapture_warning_names_the_value() -> None:
    net = Net()
    exe = flowexec.compile(lambda x: net(x))
    exe(torch.ones(2, 4))
    net.drop.eval()
    with pytest.warns(flowexec.RecaptureWarning, match=r"net\.drop\.training: True -> False"):
        exe(torch.ones(2, 4))
    net.temperature = 2.0
    with pytest.warns(flowexec.RecaptureWarning, match=r"net\.temperature: 1\.0 -> 2\.0"):
        exe(torch.ones(2, 4))


def test_autocast_and_default_dtype_are_guarded() -> None:
    w = torch.randn(4, 4)
    exe = flowexec.compile(lambda x: x @ w)
    made = flowexec.compile(lambda x: x + torch.ones(4))  # a factory without a dtype: the default's
    x = torch.randn(2, 4)
    assert exe(x).dtype == torch.float32 and made(x).dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flowexec.RecaptureWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = exe(x), x @ w
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want)
        assert exe(x).dtype == torch.float32  # and back
        torch.set_default_dtype(torch.float64)
        try:
            assert made(x.double()).dtype == (x.double() + torch.ones(4)).dtype == torch.float64
        finally:
            torch.set_default_dtype(torch.float32)


def test_value_fn_changes_itself_is_refused_naming_it() -> None:
    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1  # Python state no compiled call can replay
            return x * self.calls

    counter = Counter()
    with pytest.raises(CaptureError, match=r"counter\.calls: 0 -> 1"):
        flowexec.compile(lambda x: counter(x), torch.ones(2))


def test_value_changing_every_call_ends_in_an_error_naming_it() -> None:
    box = {"step": 0}

    def fn(x):
        return x + box["step"]

    exe = flowexec.compile(fn, cache_size=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flowexec.RecaptureWarning)
        for k in range(3):
            box["step"] = k
            assert float(exe(torch.zeros(())) ) == k
        box["step"] = 3
        with pytest.raises(GuardError, match=r"box\['step'\]: 2 -> 3 .*cache_size=3"):
            exe(torch.zeros(()))


def test_module_attributes_fn_assigns_are_replayed() -> None:
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())

    def step_for(net):
        def step(x):
            net.train()  # fn puts the model in training mode itself
            return net(x)
        return step

    eager, mine = step_for(nets[0]), flowexec.compile(step_for(nets[1]))
    for k in range(3):
        for n in nets:
            n.eval()
        torch.manual_seed(k)
        a = eager(torch.ones(2, 4))
        torch.manual_seed(k)
        b = mine(torch.ones(2, 4))
        torch.testing.assert_close(b, a)
        assert nets[1].training and nets[1][1].training  # as running fn leaves them


def test_native_and_python_checks_agree() -> None:
    """The C++ guard check passes exactly where the Python one does, over random changes."""
    from flowexec.runtime import fastcall

    if fastcall.load() is None:
        pytest.skip("native extension not built (python -m flowexec.runtime.build_native)")
    import random

    rng = random.Random(0)
    for trial in range(200):
        d = {"a": 1.0, "b": True, "c": "x", "n": None, "t": (1, 2)}
        od = collections.OrderedDict(a=1, b=2)  # (its order is its own list's, not the dict's table)
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.zeros(3)
        guards = (Guard("d.a", d, (("item", "a"),), 1.0, "eq"), Guard("d.b", d, (("item", "b"),), True, "is"),
                  Guard("d.c", d, (("item", "c"),), "x", "eq"), Guard("d.n", d, (("item", "n"),), None, "is"),
                  Guard("d.t", d, (("item", "t"),), (1, 2), "eq"), Guard("len(d)", d, (("len", None),), 5, "eq"),
                  Guard("d.keys()", d, (("keys", None),), ("a", "b", "c", "n", "t"), "eq"),
                  Guard("od.keys()", od, (("keys", None),), ("a", "b"), "eq"),
                  Guard("p.requires_grad", p, (("attr", "requires_grad"),), True, "is"),
                  Guard("p.grad", p, (("attr", "grad"),), (torch.float32, torch.device("cpu"), (3,), (1,)), "grad"))
        gs = GuardSet(guards)
        gs.attach(fastcall.guard_checker(gs))
        assert gs.native().check() == -1
        change = rng.choice(["none", "a", "a_int", "b", "c", "n", "t", "len", "order", "od_order", "rg",
                             "grad_none", "grad_shape", "grad_dtype", "grad_same_kind"])
        if change == "a":
            d["a"] = 2.0
        elif change == "a_int":
            d["a"] = 1  # equal but another type: a guard tells them apart
        elif change == "b":
            d["b"] = False
        elif change == "c":
            d["c"] = "y"
        elif change == "n":
            d["n"] = 0
        elif change == "t":
            d["t"] = (1, 3)
        elif change == "len":
            d["z"] = 0
        elif change == "order":  # (the same items: the keys guard alone fails)
            d["a"] = d.pop("a")
        elif change == "od_order":
            od.move_to_end("a")
        elif change == "rg":
            p.requires_grad_(False)
        elif change == "grad_none":
            p.grad = None
        elif change == "grad_shape":
            p.grad = torch.zeros(6)[::2]
        elif change == "grad_dtype":
            p.data = p.data.double()
            p.grad = torch.zeros(3, dtype=torch.float64)
        elif change == "grad_same_kind":
            p.grad = torch.ones(3)
        native = gs.native().check() == -1
        python = all(same_holds(g) for g in guards)
        assert native == python, f"{change}: native {native}, python {python} ({[describe(g) for g in guards]})"
        assert native == (change in ("none", "grad_same_kind")), change


class _MappedConfig:
    """A config whose class reads attributes in Python (as Hugging Face's ``PretrainedConfig``
    does: ``attribute_map`` renames some), with a property beside plain attributes."""

    attribute_map = {"width": "n_embd"}

    def __init__(self) -> None:
        self.n_embd = 8
        self._impl = "eager"

    def __getattribute__(self, key: str) -> Any:
        if key != "attribute_map" and key in super().__getattribute__("attribute_map"):
            key = super().__getattribute__("attribute_map")[key]
        return super().__getattribute__(key)

    @property
    def impl(self) -> str:
        return self._impl


def test_native_and_python_checks_agree_on_instance_dicts_and_absent_items() -> None:
    """Attributes of an object whose class has its own ``__getattribute__`` are read from its
    ``__dict__`` by the C++ check (a property's, and a renamed one's, through the class), and
    an "absent" guard holds until the item is set: both checks agree on each change."""
    from flowexec.guards import native_path
    from flowexec.runtime import fastcall

    if fastcall.load() is None:
        pytest.skip("native extension not built (python -m flowexec.runtime.build_native)")
    for change in ("none", "n_embd", "renamed", "impl", "forward set", "forward set, then deleted"):
        cfg, d = _MappedConfig(), {"config": None}
        d["config"] = cfg
        guards = (Guard("m.config.n_embd", d, (("item", "config"), ("attr", "n_embd")), 8, "eq"),
                  Guard("m.config.width", d, (("item", "config"), ("attr", "width")), 8, "eq"),
                  Guard("m.config.impl", d, (("item", "config"), ("attr", "impl")), "eager", "eq"),
                  Guard("m.forward", d, (("item", "forward"),), None, "absent"))
        gs = GuardSet(guards)
        assert [native_path(g.root, g.path)[-1][0] for g in guards] == ["dict", "attr", "attr", "item"]
        gs.attach(fastcall.guard_checker(gs))
        assert gs.native().check() == -1
        if change == "n_embd":
            cfg.n_embd = 16
        elif change == "renamed":
            object.__setattr__(cfg, "n_embd", 9)
        elif change == "impl":
            cfg._impl = "sdpa"
        elif change.startswith("forward set"):
            d["forward"] = _halve
            if change.endswith("deleted"):
                del d["forward"]
        native = gs.native().check() == -1
        python = all(same_holds(g) for g in guards)
        assert native == python == (change in ("none", "forward set, then deleted")), change


def test_native_and_python_checks_agree_on_parameter_hooks() -> None:
    """The C++ check reads a parameter's hook fields itself: it agrees with the Python getters
    for a hook added, one added then removed (an empty dict), and ``_backward_hooks = None``."""
    from flowexec.guards import tensor_hook_guards
    from flowexec.runtime import fastcall

    if fastcall.load() is None:
        pytest.skip("native extension not built (python -m flowexec.runtime.build_native)")
    for change in ("none", "hook", "hook removed", "post hook", "set None"):
        p = torch.nn.Parameter(torch.zeros(3))
        gs = GuardSet(tuple(tensor_hook_guards(p, "p")))
        gs.attach(fastcall.guard_checker(gs))
        assert len(gs) == 2 and gs.native().check() == -1
        if change == "hook":
            p.register_hook(_halve)
        elif change == "hook removed":
            p.register_hook(_halve).remove()
        elif change == "post hook":
            p.register_post_accumulate_grad_hook(lambda q: None)
        elif change == "set None":
            p._backward_hooks = None
        native = gs.native().check() == -1
        python = all(same_holds(g) for g in gs.guards)
        assert native == python == (change in ("none", "set None")), change


def same_holds(g: Guard) -> bool:
    from flowexec.guards import holds

    return holds(g)


LAST_MODE = {"ran": 0}
DONE = False


def test_python_names_fn_assigns_are_replayed_and_tensors_refused() -> None:
    def step(x):
        global DONE
        DONE = True  # a global fn sets: the compiled call sets it too
        return x * 2

    exe = flowexec.compile(step, torch.ones(2))
    global DONE
    for _ in range(2):
        DONE = False
        exe(torch.ones(2))
        assert DONE is True

    w = torch.ones(2)

    def picks(x):
        global KEPT
        KEPT = w  # a tensor bound to a global inside fn: no compiled call can re-bind it
        return x * w

    with pytest.raises(CaptureError, match="global KEPT"):
        flowexec.compile(picks, torch.ones(2))


@pytest.mark.timeout(120)
def test_a_module_rebinding_a_buffer_to_itself_trains_like_eager() -> None:
    """spectral_norm's power iteration writes ``self._u = normalize(..., out=self._u)``: the same
    buffer, written in place. It was refused as a tensor bound to a Python name."""
    from torch.nn.utils.parametrizations import spectral_norm

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(spectral_norm(torch.nn.Linear(6, 8)), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def stepper(m: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    (m1, o1), (m2, o2) = make(), make()
    eager, exe = stepper(m1, o1), flowexec.compile(stepper(m2, o2))
    for x in torch.randn(4, 5, 6):
        torch.testing.assert_close(exe(x), eager(x))
    for (n, a), b in zip(m1.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(a, b, msg=n)


def test_a_counter_on_a_plain_object_is_refused_not_frozen() -> None:
    class Counter:
        def __init__(self) -> None:
            self.calls = 0

        def bump(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x + 1

    c = Counter()
    exe = flowexec.compile(lambda x: c.bump(x) * 2)
    with pytest.raises(flowexec.CaptureError, match=r"c\.calls: 0 -> 1"):
        exe(torch.ones(2))


def test_a_counter_beside_a_tensor_is_refused_not_frozen() -> None:
    """As above, on an object that also holds a tensor (whose numbers went unguarded before)."""
    class Counter:
        def __init__(self) -> None:
            self.w = torch.ones(2)
            self.calls = 0

        def bump(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x * self.w

    c = Counter()
    exe = flowexec.compile(lambda x: c.bump(x) * 2)
    with pytest.raises(flowexec.CaptureError, match=r"c\.calls: 0 -> 1"):
        exe(torch.ones(2))


def test_a_record_the_step_makes_and_hands_to_a_helper_is_not_kept() -> None:
    """An object made by each call (an output record holding tensors) passed to a helper: not
    guarded (guarding would keep the capture run's tensors alive, and capture would refuse them
    as escaped state); the step matches eager."""
    class Out:
        def __init__(self, logits: torch.Tensor) -> None:
            self.logits = logits
            self.scale = 2.0

    def loss(o: Out, y: torch.Tensor) -> torch.Tensor:
        return (o.logits * o.scale - y).square().mean()

    w = torch.randn(4, 4, requires_grad=True)

    def fn(x, y):
        return loss(Out(x @ w), y)

    exe = flowexec.compile(fn)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    for _ in range(3):
        torch.testing.assert_close(exe(x, y), fn(x, y))


class _Shifted(torch.nn.Module):
    """Reads a number its class holds, through ``self`` and through ``type(self)``."""

    shift = 0.5  # (no instance holds one)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x) + self.shift)) * type(self).shift


def _sgd_step(model: torch.nn.Module, then: Callable[[torch.Tensor], torch.Tensor] = torch.tanh
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = then(model(x)).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def _train_twins(make: Callable[[], tuple], change: Callable[[Any], None] | None, match: str = "",
                 steps: int = 4) -> tuple[Any, list[int], list[float]]:
    """Train ``make()``'s (step, model, changed object) eagerly and compiled on the same batches;
    ``change(obj)`` is applied to both twins' objects before the third step, whose compiled call
    must warn ``match``; no other call may warn. Returns the executable, its number of programs
    after each call and the eager losses."""
    (eager, m1, o1), (step, m2, o2) = make(), make()
    exe = flowexec.compile(step)
    losses, programs = [], []
    for k, x in enumerate(torch.randn(steps, 3, 4, generator=torch.Generator().manual_seed(2))):
        if k == 2 and change is not None:
            change(o1)
            change(o2)
            with pytest.warns(flowexec.RecaptureWarning, match=match):
                got = exe(x)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error", flowexec.RecaptureWarning)
                got = exe(x)
        programs.append(sum(map(len, exe._cache.values())))
        losses.append(float(eager(x)))
        torch.testing.assert_close(float(got), losses[-1], rtol=1e-5, atol=1e-6, msg=f"step {k}")
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
    return exe, programs, losses


def test_a_class_attribute_changed_between_steps_recaptures_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_Shifted.shift = 2.0`` between two training steps: the next call captures again (its
    program had 0.5 in it) and trains as eager."""
    def make() -> tuple:
        model = _Shifted()
        return _sgd_step(model), model, _Shifted

    _, _, changed = _train_twins(make, lambda cls: monkeypatch.setattr(cls, "shift", 2.0), r"shift: 0\.5 -> 2\.0")
    monkeypatch.undo()
    _, _, unchanged = _train_twins(make, None)
    assert abs(changed[-1] - unchanged[-1]) > 1e-3  # (the change matters)


def test_a_helper_holding_a_tensor_changed_between_steps_recaptures_naming_it() -> None:
    """A helper object holding a tensor beside a number (``helper.scale = 3.0`` between two
    training steps): the next call captures again and trains as eager."""
    def make() -> tuple:
        torch.manual_seed(0)
        model, helper = torch.nn.Linear(4, 4), _Helper()
        return _sgd_step(model, helper.apply), model, helper  # (the step reaches the helper by its method alone)

    _, _, changed = _train_twins(make, lambda h: setattr(h, "scale", 3.0), r"scale: 2\.0 -> 3\.0")
    _, _, unchanged = _train_twins(make, None)
    assert abs(changed[-1] - unchanged[-1]) > 1e-3


class _ClipSGD(torch.optim.Optimizer):
    """A user's optimizer whose step reads a number it keeps itself, not in a param group."""

    def __init__(self, params: Any, clip: float) -> None:
        super().__init__(params, dict(lr=0.5))
        self.clip = clip

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.clamp(-self.clip, self.clip), alpha=-group["lr"])


def _clip_sgd_twin() -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = _ClipSGD(model.parameters(), clip=0.01)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - 1).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()
    return step, model, opt


def test_a_custom_optimizer_s_own_attribute_changed_between_steps_recaptures_naming_it() -> None:
    """``opt.clip = 0.5`` between two steps of a user's Optimizer subclass whose ``step`` reads
    ``self.clip``: the next call captures again and trains as eager; nothing else captures."""
    _, _, changed = _train_twins(_clip_sgd_twin, lambda o: setattr(o, "clip", 0.5), r"opt\.clip: 0\.01 -> 0\.5")
    exe, _, unchanged = _train_twins(_clip_sgd_twin, None, steps=5)
    assert abs(changed[-1] - unchanged[-1]) > 1e-3
    names = exe.guards.names
    assert "opt.clip" in names and not any(n.startswith("opt._optimizer") for n in names), names


def _halve(g: torch.Tensor) -> torch.Tensor:
    return g * 0.5


def _halve_grad(p: torch.Tensor) -> None:
    p.grad.mul_(0.5)


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_parameter_hook_registered_between_steps_captures_again(kind: str) -> None:
    """A hook registered on the parameters between two steps (``p.register_hook``, or a post
    accumulate grad hook) is run as eager runs it: the program made before does not run it."""
    def make() -> tuple:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        return _sgd_step(model), model, model

    def hook(model: torch.nn.Module) -> None:
        for p in model.parameters():
            if kind == "register_hook":
                p.register_hook(_halve)
            else:  # (halves the accumulated gradient in place)
                p.register_post_accumulate_grad_hook(_halve_grad)
    _, _, changed = _train_twins(make, hook, r"_backward_hooks|_post_accumulate_grad_hooks")
    _, _, unchanged = _train_twins(make, None)
    assert abs(changed[-1] - unchanged[-1]) > 1e-4


@dataclasses.dataclass
class _Record:
    """An output record the step makes on every call (a generated ``__init__``)."""

    hidden: torch.Tensor
    scale: float = 0.5


class _Loss:
    weight = 2.0  # (a class attribute of a class whose objects the step makes)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.offset = 1.0

    def value(self, r: _Record) -> torch.Tensor:
        return ((self.logits - self.offset) * r.hidden * r.scale).square().mean() * self.weight


def test_class_attributes_and_objects_holding_tensors_capture_once_when_nothing_changes() -> None:
    """Class attributes, a helper holding a tensor, and records the step makes on every call
    (holding the call's tensors, handed to methods and helpers) are guarded where they must be
    and capture one program, kept through steps where nothing changed; the guards hold no
    helper object (nor its tensors) and none of the records."""
    def make() -> tuple:
        model, helper = _Shifted(), _Helper()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = _Loss(helper.apply(torch.cat([out, out], 1))).value(_Record(out.repeat(1, 2)))
            loss.backward()
            opt.step()
            return loss.detach()
        return step, model, helper

    exe, programs, _ = _train_twins(make, None, steps=6)
    # (the first call finds no .grad and the second finds them: two programs, made silently)
    assert programs[1:] == [programs[1]] * 5, programs
    guards = exe._last.guards.guards
    names = [g.name for g in guards]
    for read in ("model.shift", "helper.scale", "_Loss.weight"):
        assert any(read in n for n in names), (read, names)
    assert not any("offset" in n or "hidden" in n or "_Record" in n for n in names), names  # (the records': fn's own)
    assert not any(isinstance(g.root, (_Helper, _Loss, _Record)) for g in guards)


def test_a_helper_holding_a_tensor_is_read_weakly_by_its_guards() -> None:
    """The guards of a helper holding a tensor do not keep it alive: replaced by another, it is
    freed, and the next call captures again with the new one's number."""
    box = {"helper": _Helper()}
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))

    def fn(x):
        return box["helper"].apply(x @ w).sum()

    exe = flowexec.compile(fn)
    x = torch.randn(3, 4)
    torch.testing.assert_close(exe(x), fn(x))
    old = weakref.ref(box["helper"])
    box["helper"] = _Helper()
    box["helper"].scale = 3.0
    gc.collect()
    assert old() is None
    with pytest.warns(flowexec.RecaptureWarning, match="scale"):
        got = exe(x)
    torch.testing.assert_close(got, fn(x))


class _Stack(torch.nn.Module):
    """Runs its first ``depth`` layers through a slice of its ModuleList (Hugging Face's
    ``self.layers[: config.num_hidden_layers]``): the slice is a ModuleList made during the run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.depth = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[: self.depth]:
            x = torch.tanh(layer(x))
        return x


def test_a_module_made_during_the_run_is_no_guarded_state() -> None:
    """Filling a module the run itself made is not a change of Python state fn read; the depth,
    read from the model, still re-captures when it changes."""
    model = _Stack()
    exe = flowexec.compile(lambda x: model(x).sum())
    x = torch.randn(5, 4)
    torch.testing.assert_close(exe(x), model(x).sum())
    model.depth = 3
    with pytest.warns(flowexec.RecaptureWarning, match="depth"):
        got = exe(x)
    torch.testing.assert_close(got, model(x).sum())


class _Scaler:
    def __init__(self) -> None:
        self.power = 2.0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x ** self.power  # a plain object's attribute, read through its method's self


def _traced_guards(monkeypatch: pytest.MonkeyPatch, hook: str) -> list[str]:
    """The guards of one capture whose frames reach the recorder by ``hook``: "native" (the C
    trace function), "python" (a Python one) or "monitoring" (sys.monitoring, Python 3.12+)."""
    from flowexec import guards
    from flowexec.capture import capture

    monkeypatch.setattr(guards, "_FRAME_HOOK", "" if hook == "monitoring" else "trace")
    if hook == "python":
        monkeypatch.setattr(guards, "_NATIVE_TRACER", {})
    _reset_globals()
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    scalers = [_Scaler(), _Scaler()]
    shifted, helper = _Shifted(), _Helper()

    def fn(x):
        y = g_helper(g_act(x @ w)) * G_SCALE + G_TABLE["bias"]
        for s in scalers:
            y = s.apply(y)
        y = helper.apply(y) + _Loss(y).value(_Record(y))  # (a record and an object made: not guarded)
        return shifted(y) ** G_OPTS.power

    before = sys.gettrace()
    cap = capture(fn, (torch.randn(2, 4),), guarded=True)
    assert sys.gettrace() is before  # the tracer the caller had (a debugger's, coverage's) is back
    return sorted(g.name for g in cap.guards.guards)


_NEEDS_MONITORING = pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is Python 3.12's")


def test_native_frame_tracer_records_what_the_python_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C trace function (runtime/csrc/codetracer.cpp) guards the same globals, closure
    values and helper objects as the Python one, and leaves the caller's trace function set."""
    from flowexec import guards
    from flowexec.runtime import fastcall

    if fastcall.load() is None:
        pytest.skip("native extension not built (python -m flowexec.runtime.build_native)")
    assert guards._NATIVE_TRACER.get("make") is not None
    native = _traced_guards(monkeypatch, "native")
    python = _traced_guards(monkeypatch, "python")
    assert native == python
    assert any("G_TABLE" in n for n in native) and any("power" in n for n in native), native
    assert {"shifted.shift", "helper.scale", "_Loss.weight"} <= set(native), native
    assert not any("offset" in n or "hidden" in n for n in native), native


@_NEEDS_MONITORING
def test_frame_starts_by_monitoring_record_what_a_trace_function_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through sys.monitoring (each code's first frame, then only those of codes whose first
    argument is guarded) a capture guards what the trace function's does: the same globals,
    closure values and both helper objects of one class."""
    python = _traced_guards(monkeypatch, "python")
    by_events = _traced_guards(monkeypatch, "monitoring")
    assert by_events == python
    assert sum("power" in n for n in by_events) >= 3, by_events  # G_OPTS and both _Scaler objects
    assert {"shifted.shift", "helper.scale", "_Loss.weight"} <= set(by_events), by_events


def test_native_frame_tracer_restores_an_outer_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorder inside another (a capture during a capture) hands the outer's C tracer back."""
    from flowexec import guards
    from flowexec.runtime import fastcall

    if fastcall.load() is None:
        pytest.skip("native extension not built (python -m flowexec.runtime.build_native)")
    monkeypatch.setattr(guards, "_FRAME_HOOK", "trace")
    outer, inner = guards.Recorder(lambda: None, active=True), guards.Recorder(lambda: None, active=True)
    before = sys.gettrace()
    with outer:
        tracer = sys.gettrace()
        assert isinstance(tracer, guards._NATIVE_TRACER["type"])
        with inner:
            assert sys.gettrace() is not tracer
        assert sys.gettrace() is tracer
        g_helper(torch.ones(1))  # still traced: the outer recorder scans the helper's code
    assert sys.gettrace() is before
    assert g_helper.__code__ in outer._seen_code


@_NEEDS_MONITORING
def test_frame_starts_reach_the_innermost_recorder_then_the_outer_again() -> None:
    """With sys.monitoring: a code the inner recorder saw (and disabled) starts again for the
    outer one once the inner ends; a user's trace function stays set throughout; the tool id
    is given back after the last recorder."""
    from flowexec import frame_starts, guards

    outer, inner = guards.Recorder(lambda: None, active=True), guards.Recorder(lambda: None, active=True)
    users = []

    def user_tracer(frame: Any, event: str, arg: Any) -> None:  # a debugger's, say
        users.append(frame.f_code.co_name)

    sys.settrace(user_tracer)
    try:
        with outer:
            assert outer._hook == "monitoring"
            with inner:
                g_helper(torch.ones(1))
            assert g_helper.__code__ in inner._seen_code and g_helper.__code__ not in outer._seen_code
            g_helper(torch.ones(1))
            assert g_helper.__code__ in outer._seen_code
            assert sys.gettrace() is user_tracer
    finally:
        sys.settrace(None)
    assert "g_helper" in users  # the user's tracer ran during the recording
    assert not frame_starts._TOOL and not frame_starts._RECORDERS
    assert sys.monitoring.get_tool(3) != "flowexec capture" and sys.monitoring.get_tool(4) != "flowexec capture"


@_NEEDS_MONITORING
def test_frame_starts_of_another_thread_are_not_the_recorder_s() -> None:
    """sys.monitoring reports every thread's frames: another thread's first frame of a code is
    passed over, so the recording thread still scans that code when it runs it."""
    import threading

    from flowexec import guards

    rec = guards.Recorder(lambda: None, active=True)

    def other_helper(x: torch.Tensor) -> torch.Tensor:
        return x * G_SCALE

    with rec:
        t = threading.Thread(target=other_helper, args=(torch.ones(1),))
        t.start()
        t.join(timeout=30)
        assert other_helper.__code__ not in rec._seen_code
        other_helper(torch.ones(1))
        assert other_helper.__code__ in rec._seen_code


def _clamp_after_step(opt, args, kwargs):  # (an optimizer step post hook)
    with torch.no_grad():
        for g in opt.param_groups:
            for p in g["params"]:
                p.clamp_(-0.05, 0.05)


@pytest.mark.parametrize("where", ["global module forward hook", "optimizer step post hook",
                                   "global optimizer step post hook"])
def test_a_hook_registered_between_calls_captures_again(where: str) -> None:
    """A hook registered between two calls (on the optimizer, or in torch's global registries
    of module and optimizer hooks, which torch's own code reads) is run as eager runs it: the
    program made before it does not run it, so the call captures again, naming the registry."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    (m1, o1), (m2, o2) = twin(net, lambda p: torch.optim.SGD(p, lr=0.5))
    nets, opts = (m1, m2), (o1, o2)
    loss = lambda out, _: out.square().mean()  # noqa: E731
    eager, exe = make_step(m1, o1, loss, set_to_none=True), flowexec.compile(make_step(m2, o2, loss, set_to_none=True),
                                                                             mode="trace")
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5, 4, generator=g) for _ in range(4)]
    handles = []
    try:
        for i, x in enumerate(xs):
            if i == 2:
                if where == "global module forward hook":
                    handles.append(torch.nn.modules.module.register_module_forward_hook(
                        lambda m, a, out: out * 0.5 if isinstance(m, torch.nn.Linear) else out))
                elif where == "optimizer step post hook":
                    handles += [o.register_step_post_hook(_clamp_after_step) for o in opts]
                else:
                    from torch.optim.optimizer import register_optimizer_step_post_hook

                    handles.append(register_optimizer_step_post_hook(_clamp_after_step))
                with pytest.warns(flowexec.RecaptureWarning, match=r"len\(.*hooks\)"):
                    got = exe(x, x)
            else:
                got = exe(x, x)
            torch.testing.assert_close(got, eager(x, x), rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}, call {i}: {m}")
    finally:
        for h in handles:
            h.remove()
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


class _DoubledTanh(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes an answer: ``torch.tanh`` returns twice its value."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.tanh else out


@pytest.mark.parametrize("captured", ["outside", "inside"])
def test_a_torch_function_mode_around_calls_gives_eager_answers(captured: str) -> None:
    """A ``TorchFunctionMode`` entered around some calls (not others) changes what eager runs:
    the program captured outside it (or inside) captures again where the modes differ."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(x)).sum()

    exe = flowexec.compile(f)
    x = torch.randn(3, 4)
    order = [False, True, True, False] if captured == "outside" else [True, False, False, True]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flowexec.RecaptureWarning)
        for k, inside in enumerate(order):
            if inside:
                with _DoubledTanh():
                    mine, eager = exe(x), f(x)
            else:
                mine, eager = exe(x), f(x)
            torch.testing.assert_close(mine, eager, rtol=1e-5, atol=1e-6, msg=lambda m: f"call {k}: {m}")
    with _DoubledTanh():
        doubled = f(x)
    assert not torch.allclose(doubled, f(x)), "the mode does not change eager's answer"


class _CopiedCfg:
    """A config whose copy a step makes, reads through a method, and trims (as Hugging Face's
    ``get_text_config`` copies and trims a config inside a forward)."""

    def __init__(self) -> None:
        self.scale, self.extra = 2.0, 1.0

    def value(self) -> float:
        return self.scale + self.extra


G_COPIED = _CopiedCfg()


@pytest.mark.parametrize("how", ["deepcopy", "copy"])
def test_an_object_the_step_copies_is_its_own_not_guarded(how: str) -> None:
    """A copy made during the run (``copy.deepcopy``/``copy.copy`` run no ``__init__``) is fn's
    own, as an object its ``__init__`` makes is: what the run reads of it and then changes is
    no guard's (before: "fn changes a Python value it reads (_CopiedCfg.extra: 1.0 -> <gone>)",
    T5 with transformers 5.17 from a source checkout). The original stays guarded."""
    import copy

    make = copy.deepcopy if how == "deepcopy" else copy.copy

    def fn(x: torch.Tensor) -> torch.Tensor:
        c = make(G_COPIED)
        v = c.value()
        del c.extra
        return x * v

    G_COPIED.scale = 2.0
    exe = flowexec.compile(fn)
    x = torch.ones(3)
    torch.testing.assert_close(exe(x), fn(x))
    G_COPIED.scale = 5.0
    with pytest.warns(flowexec.RecaptureWarning, match="scale"):
        torch.testing.assert_close(exe(x), fn(x))
    G_COPIED.scale = 2.0


def test_a_patch_made_before_flowexec_was_imported_is_guarded(monkeypatch) -> None:
    """A torch function patched before flowexec's import sits in the entries flowexec found, and
    no dispatch reports it (a user function): only its being a function from outside torch
    marks it. Putting torch's back after a capture captured nothing again before."""
    import flowexec.guards as guards

    original = F.gelu
    patched = (lambda t, approximate="none": torch.tanh(t))
    monkeypatch.setattr(F, "gelu", patched)
    monkeypatch.setitem(guards._LOOKED_UP["torch.nn.functional"], "gelu", patched)  # (as found at import)
    torch.manual_seed(0)
    lin, act = torch.nn.Linear(4, 4), torch.nn.GELU()
    exe = flowexec.compile(lambda x: act(lin(x)))
    x = torch.randn(3, 4)
    torch.testing.assert_close(exe(x), act(lin(x)))
    monkeypatch.setattr(F, "gelu", original)
    with pytest.warns(flowexec.RecaptureWarning, match="torch.nn.functional.gelu"):
        got = exe(x)
    torch.testing.assert_close(got, act(lin(x)))


def test_a_dict_s_order_is_guarded_where_its_keys_are_few_plain_values() -> None:
    """Plain keys: their order (a reordered dict with the same items fails); keys that are
    objects, or more than a check should read at every call: the length alone."""
    from flowexec.guards import MAX_SNAPSHOT, order_guard

    small = {"b": 1.0, "a": 2.0}
    where = {"d": small}
    g = order_guard("d", where, (("item", "d"),), small)
    assert (g.name, g.expected) == ("d.keys()", ("b", "a")) and same_holds(g)
    where["d"] = {"a": 2.0, "b": 1.0}
    assert where["d"] == small and not same_holds(g)
    big = {f"k{i}": i for i in range(MAX_SNAPSHOT + 1)}
    keyed = {torch.nn.ReLU(): 1.0}
    assert order_guard("big", {"big": big}, (("item", "big"),), big).name == "len(big)"
    assert order_guard("keyed", {"keyed": keyed}, (("item", "keyed"),), keyed).name == "len(keyed)"
