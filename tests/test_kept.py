"""Kept programs (flowexec/kept.py): a capture kept on disk is taken by a later build only where
a capture would have made the same program, and then trains as eager does.

The cross-process tests run a training script in fresh processes on one directory of kept
programs: the first captures and keeps, a later one loads (or, where something changed, captures
again), and each is compared with eager PyTorch running the same script's steps.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import flowexec
from flowexec import kept

ROOT = Path(__file__).resolve().parents[1]

MODEL = """
import torch

SCALE = 2.0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.drop = torch.nn.Dropout(0.0)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.norm(torch.nn.functional.gelu(self.fc1(x)) * SCALE)))
"""

SCRIPT = """
import json, os, sys
import torch
import flowexec
from model import Net

torch.manual_seed(0)
model = Net()
if "sgd" in sys.argv:  # (momentum: its first step is a program of its own, which makes the buffers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
if "eval" in sys.argv:
    model.eval()


def step(x, y):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


g = torch.Generator().manual_seed(1)
data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(5)]
run = step if "eager" in sys.argv else flowexec.compile(step, mode="trace", fuse=False)
losses = []
for x, y in data:
    losses.append(run(x, y).item())
    sched.step()
print(json.dumps({"kept": getattr(run, "kept", None), "capture_run": getattr(run, "capture_run", None),
                  "first_step_capture_run": getattr(run, "first_step_capture_run", None),
                  "losses": losses, "params": [p.detach().flatten().tolist() for p in model.parameters()]}))
"""


def _run(where: Path, *argv: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(where)]),
               FLOWEXEC_KEEP_DIR=str(where / "programs"), FLOWEXEC_KEEP="1")
    done = subprocess.run([sys.executable, str(where / "train.py"), *argv], env=env, capture_output=True, text=True,
                          timeout=240, cwd=where)
    assert done.returncode == 0, f"train.py {' '.join(argv)} in {where}: {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _eager(model: str, *argv: str) -> dict:
    """The same script's eager run (``train.py eager ...``), in this process: eager PyTorch keeps
    nothing on disk and needs no process of its own, only the runs that keep and load do (a
    process started for it costs seconds of imports)."""
    mod = types.ModuleType("model")
    exec(compile(textwrap.dedent(model), "model.py", "exec"), mod.__dict__)
    out = io.StringIO()
    saved = sys.modules.get("model"), sys.argv
    sys.modules["model"], sys.argv = mod, ["train.py", "eager", *argv]
    try:
        with torch.random.fork_rng(), contextlib.redirect_stdout(out):  # (the script seeds: ours is put back)
            exec(compile(textwrap.dedent(SCRIPT), "train.py", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = saved[1]
        if saved[0] is None:
            del sys.modules["model"]
        else:
            sys.modules["model"] = saved[0]
    return json.loads(out.getvalue().strip().splitlines()[-1])


def _write(where: Path, model: str = MODEL) -> None:
    (where / "model.py").write_text(textwrap.dedent(model))
    if not (where / "train.py").exists():
        (where / "train.py").write_text(textwrap.dedent(SCRIPT))


def _same(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-5, atol=1e-6)
    for p, q in zip(a["params"], b["params"]):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-5, atol=1e-6)


CHANGED = MODEL.replace("* SCALE", "* SCALE * 0.5")


@pytest.fixture(scope="module")
def later_processes(tmp_path_factory) -> dict:
    """Four fresh processes, one after another, on one directory of kept programs: the first
    captures and keeps the step, the second loads it, the third runs it with model.eval() (a
    guard fails: it captures again) and the fourth with model.py edited (captures again). Three
    tests check their parts: each process costs seconds of imports, and a run of the first kind
    serves all three (the third and fourth each meet the program the first kept, as a later
    process of their own would; the fourth meets the third's too, refused for the same edit)."""
    where = tmp_path_factory.mktemp("kept_runs")
    _write(where)
    runs = {"first": _run(where), "second": _run(where), "eval": _run(where, "eval")}
    assert CHANGED != MODEL
    _write(where, CHANGED)
    runs["changed"] = _run(where)  # (a guard on SCALE would pass: the code that reads it changed)
    return runs


@pytest.mark.timeout(600)
def test_a_later_process_loads_the_kept_program_and_trains_as_eager(later_processes):
    first, second = later_processes["first"], later_processes["second"]
    assert first["capture_run"] == "fake" and "; kept " in first["kept"], first["kept"]
    assert second["capture_run"] == "kept" and second["kept"].startswith("loaded "), second["kept"]
    eager = _eager(MODEL)
    _same(first, eager)
    _same(second, eager)  # (the LR schedule reaches the loaded program: its values are fed)


@pytest.mark.timeout(600)
def test_a_kept_first_step_program_makes_the_optimizer_state_in_a_later_process(tmp_path):
    """SGD with momentum: the first call runs a first step's program that makes the momentum
    buffers (its outputs bound into opt.state), the second captures the steps. A later process
    loads both, and trains as eager."""
    _write(tmp_path)
    first = _run(tmp_path, "sgd")
    second = _run(tmp_path, "sgd")
    assert first["first_step_capture_run"] == "fake" and first["capture_run"] == "fake", first
    assert second["first_step_capture_run"] == "kept" and second["capture_run"] == "kept", second["kept"]
    eager = _eager(MODEL, "sgd")
    _same(first, eager)
    _same(second, eager)


@pytest.mark.timeout(600)
def test_a_guard_that_fails_in_the_later_process_captures_again(later_processes):
    later = later_processes["eval"]  # model.eval(): the capture read each module's training flag
    assert later["capture_run"] == "fake", later["kept"]
    assert "does not bind: " in later["kept"] and "training" in later["kept"], later["kept"]
    _same(later, _eager(MODEL, "eval"))


@pytest.mark.timeout(600)
def test_a_changed_source_file_captures_again(later_processes):
    later = later_processes["changed"]
    assert later["capture_run"] == "fake", later["kept"]
    # (the walk meets Net.forward's code first; the stamp of model.py would refuse it too)
    assert ".class[model, Net].method[forward] is other code" in later["kept"] \
        or "model.py changed since the program was kept" in later["kept"], later["kept"]
    _same(later, _eager(CHANGED))


def _mlp_step():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def step(x):
        opt.zero_grad(set_to_none=True)
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()
    return net, step


def test_a_second_executable_loads_what_the_first_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path))
    monkeypatch.setenv("FLOWEXEC_KEEP", "1")
    x = torch.randn(3, 4)
    net, step = _mlp_step()
    a = flowexec.compile(step, mode="trace")
    got_a = [a(x).item() for _ in range(3)]
    assert a.capture_run == "fake" and "; kept " in a.kept, a.kept
    b = flowexec.compile(step, mode="trace")
    got_b = [b(x).item() for _ in range(3)]
    assert b.capture_run == "kept" and b.kept.startswith("loaded "), b.kept
    net2, step2 = _mlp_step()
    want = [step2(x).item() for _ in range(6)]
    torch.testing.assert_close(torch.tensor(got_a + got_b), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_two_programs_of_one_key_are_both_kept(tmp_path, monkeypatch):
    """A step that keeps its gradients between calls (plain SGD, zero_grad after the step)
    makes one program where ``.grad`` is None and another where it holds last step's, both for a
    first call's key (a fresh process, a run resumed from a checkpoint): both records stay, and
    each later build loads the one whose guards hold."""
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path))
    monkeypatch.setenv("FLOWEXEC_KEEP", "1")

    def make():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x):
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()
        return net, step

    x = torch.randn(3, 4)
    net, step = make()
    got = []
    for grads in (None, "held", None, "held"):  # (a build's first call finds .grad None, or held)
        if grads is None:
            for p in net.parameters():
                p.grad = None
        exe = flowexec.compile(step, mode="trace")
        got.append(exe(x).item())
        assert ("; kept " in exe.kept) if len(got) <= 2 else exe.kept.startswith("loaded "), (len(got), exe.kept)
    assert len(os.listdir(tmp_path)) == 2
    net2, step2 = make()
    want = []
    for grads in (None, "held", None, "held"):
        if grads is None:
            for p in net2.parameters():
                p.grad = None
        want.append(step2(x).item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_state_no_path_reaches_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path))
    monkeypatch.setenv("FLOWEXEC_KEEP", "1")
    hidden = {"w": torch.randn(4)}

    def make():
        w = hidden["w"]
        return lambda x: (x * w).sum()  # (w in a closure cell: reached)

    exe = flowexec.compile(make(), mode="trace")
    exe(torch.ones(4))
    assert "; kept " in exe.kept, exe.kept

    deep = {"a": {"b": {"c": hidden}}}

    def lookup(x):  # (four containers deep: past where the walk looks)
        return (x * deep["a"]["b"]["c"]["w"]).sum()

    exe = flowexec.compile(lookup, mode="trace")
    exe(torch.ones(4))
    assert "not kept: the program binds a tensor (f32[4] cpu) that no path from fn reaches" in exe.kept, exe.kept


def test_keeping_is_on_by_default_and_off_with_flowexec_keep_0(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path))
    monkeypatch.setenv("FLOWEXEC_KEEP", "0")
    exe = flowexec.compile(lambda x: x * 2, mode="trace")
    exe(torch.ones(2))
    assert exe.kept == "off (FLOWEXEC_KEEP=0)"
    assert not os.path.exists(tmp_path / "programs") and not list(tmp_path.iterdir())
    monkeypatch.delenv("FLOWEXEC_KEEP")
    assert kept.enabled()  # (on by default)
    exe = flowexec.compile(lambda x: x * 2, mode="trace")
    exe(torch.ones(2))
    assert "; kept " in exe.kept and list(tmp_path.iterdir()), exe.kept
    monkeypatch.setenv("FLOWEXEC_KEEP", "yes")
    with pytest.raises(ValueError, match="FLOWEXEC_KEEP='yes': expected 1"):
        kept.enabled()


def test_paths_from_fn_name_parameters_and_optimizer_state():
    net, step = _mlp_step()
    step(torch.randn(3, 4))  # (SGD with momentum: state made)
    r = kept.reach(step)
    opt = step.__closure__[step.__code__.co_freevars.index("opt")].cell_contents
    assert kept.show(r.loc(net[0].weight)) == "fn.cell[net].param[0.weight]"
    assert kept.show(r.loc(opt.param_groups[0])) == "fn.cell[opt].group[0]"
    assert kept.show(r.loc(opt.state[net[2].bias]["momentum_buffer"])) == "fn.cell[opt].pstate[0, 3].item[momentum_buffer]"
    assert r.loc(torch.ones(1)) is None


def test_the_key_ignores_the_keeping_switches(monkeypatch):
    """A process started with FLOWEXEC_KEEP=1 finds what one without it kept (the switch is not
    the program's business); another environment variable is."""
    fn = lambda x: x + 1  # noqa: E731
    monkeypatch.delenv("FLOWEXEC_KEEP", raising=False)
    plain = kept.index_key(fn, ("sig",), ())
    monkeypatch.setenv("FLOWEXEC_KEEP", "1")
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", "/elsewhere")
    assert kept.index_key(fn, ("sig",), ()) == plain
    monkeypatch.setenv("SOME_SETTING", "1")
    assert kept.index_key(fn, ("sig",), ()) != plain


# --- what a step reads outside its guards: a later build with it changed must not load ---------

import functools  # noqa: E402

import numpy as np  # noqa: E402

ACT = torch.nn.functional.relu  # (read by _Scaled.forward: a library function in a global)
GAINS = {"a": 1.0, "b": 2.0}  # (read by _Scaled.forward in its order: a dict used whole)


class _Scaled(torch.nn.Module):
    shift = 0.0  # (a class attribute)

    def __init__(self, act: torch.nn.Module, temperature: float) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(4, 8), act, torch.nn.Linear(8, 2)
        self.temperature = np.float32(temperature)  # (a numpy scalar)

    def forward(self, x):
        out = self.fc2(ACT(self.act(self.fc1(x)))) * float(self.temperature) + type(self).shift
        return out * torch.tensor(list(GAINS.values()))


class _Trainer:
    def __init__(self, model, opt, clip: float) -> None:
        self.model, self.opt, self.clip = model, opt, clip
        self.weights = torch.ones(2)  # (a tensor beside the plain values: no guard on the object)

    def step(self, x):
        self.opt.zero_grad(set_to_none=True)
        loss = (self.model(x) * self.weights).square().mean() * self.clip
        loss.backward()
        self.opt.step()
        return loss.detach()


def _made(act: str = "relu", temperature: float = 1.0, scale: float = 1.0, clip: float = 1.0, how: str = "closure"):
    torch.manual_seed(0)
    model = _Scaled(torch.nn.SiLU() if act == "silu" else torch.nn.ReLU(), temperature)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "trainer":
        return _Trainer(model, opt, clip).step

    def base(x, scale=scale):  # (a default argument: LOAD_FAST, no guard)
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean() * scale
        loss.backward()
        opt.step()
        return loss.detach()
    return functools.partial(base, scale=scale) if how == "partial" else base


CHANGES = {
    "a module's class at a path": ({}, {"act": "silu"}),
    "a default argument": ({}, {"scale": 2.0}),
    "a partial's keyword": ({"how": "partial"}, {"how": "partial", "scale": 2.0}),
    "a plain object's attribute beside a tensor": ({"how": "trainer"}, {"how": "trainer", "clip": 3.0}),
    "a numpy scalar on a module": ({}, {"temperature": 2.0}),
    "a class attribute": ({}, {"shift": 0.5}),
    "a library function in a global": ({}, {"global": torch.nn.functional.gelu}),
    "a dict's order": ({}, {"gains": {"b": 2.0, "a": 1.0}}),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_value_no_guard_reads_changed_is_not_loaded(change, tmp_path, monkeypatch):
    """Found by a review that loaded a kept program after each such change and trained otherwise
    than eager (docs/kept.md): each is now part of what a later build compares."""
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path))
    monkeypatch.setenv("FLOWEXEC_KEEP", "1")
    before, after = CHANGES[change]

    def made(opts):
        opts = dict(opts)
        monkeypatch.setattr(_Scaled, "shift", opts.pop("shift", 0.0))
        monkeypatch.setitem(globals(), "ACT", opts.pop("global", torch.nn.functional.relu))
        monkeypatch.setitem(globals(), "GAINS", opts.pop("gains", {"a": 1.0, "b": 2.0}))
        return _made(**opts)

    x = torch.randn(3, 4)
    first = flowexec.compile(made(before), mode="trace")
    first(x)
    assert "; kept " in first.kept, first.kept
    again = flowexec.compile(made(before), mode="trace")
    again(x)
    assert again.kept.startswith("loaded "), again.kept  # (nothing changed: it loads)
    later = flowexec.compile(made(after), mode="trace")
    got = [later(x).item() for _ in range(3)]
    assert "does not bind" in later.kept and later.capture_run == "fake", later.kept
    eager = made(after)
    torch.testing.assert_close(torch.tensor(got), torch.tensor([eager(x).item() for _ in range(3)]))


def test_a_source_file_of_code_that_ran_is_checked_by_its_stamp(tmp_path, monkeypatch):
    """The code objects a capture ran are kept by their files' path, size and modification time:
    a file touched since refuses the program, though every object found is as it was."""
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path / "programs"))
    monkeypatch.setenv("FLOWEXEC_KEEP", "1")
    (tmp_path / "stamped_helper.py").write_text("def twice(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import stamped_helper

    def step(x):
        return stamped_helper.twice(x).sum()

    first = flowexec.compile(step, mode="trace")
    first(torch.ones(3))
    assert "; kept " in first.kept, first.kept
    st = os.stat(tmp_path / "stamped_helper.py")
    os.utime(tmp_path / "stamped_helper.py", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    later = flowexec.compile(step, mode="trace")
    assert later(torch.ones(3)).item() == 6.0
    assert "stamped_helper.py changed since the program was kept" in later.kept, later.kept


def test_a_loaded_program_checks_the_guards_it_was_kept_with(tmp_path, monkeypatch):
    """A loaded program keeps checking its guards between calls: a trainer's number beside a
    tensor (guarded through a weak reference, written as the trainer's path) and a class
    attribute, each changed between two calls, capture again naming it; every call trains as
    eager."""
    import warnings

    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path))
    monkeypatch.setenv("FLOWEXEC_KEEP", "1")
    x = torch.randn(3, 4)
    flowexec.compile(_made(how="trainer"), mode="trace")(x)
    step, eager = _made(how="trainer"), _made(how="trainer")
    again = flowexec.compile(step, mode="trace")
    got, want, warned = [], [], []
    for change in (None, "clip", "shift"):
        if change == "clip":
            step.__self__.clip = eager.__self__.clip = 3.0
        elif change == "shift":
            monkeypatch.setattr(_Scaled, "shift", 0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got.append(again(x).item())
        warned.append(" ".join(str(w.message) for w in caught if issubclass(w.category, flowexec.RecaptureWarning)))
        want.append(eager(x).item())
        if change is None:
            assert again.kept.startswith("loaded "), again.kept
    assert warned[0] == "" and "clip: 1.0 -> 3.0" in warned[1] and "shift: 0.0 -> 0.5" in warned[2], warned
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))


def test_a_flattened_op_is_kept_by_the_op_it_flattens() -> None:
    """``flowexec::flat_<op>`` (list_returns.py) is made when a capture first needs it: a kept
    program names the op it flattens, and the loading process makes it again."""
    from flowexec import kept, list_returns

    flat = list_returns.flat_op(torch.ops.aten._fused_adam.default)
    pid = kept._Writer.persistent_id(None, flat)
    assert pid == ("flat", "aten::_fused_adam", "default")
    assert kept._Reader.persistent_load(None, pid) is flat
    assert kept._Writer.persistent_id(None, torch.ops.aten.add.Tensor) == ("op", "aten::add", "Tensor")


# --- what no walk or guard reads: the replay of the step finds it ------------------------------

ORDER = {8, 16}  # (8 and 16 share a slot of a small set's table: it iterates in insertion order)


def _reads_outside(kind: str, where: Path):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad(set_to_none=True)
        out = net(x)
        if kind == "a file read in the step":
            out = out * json.loads((where / "cfg.json").read_text())["scale"]
        elif kind == "a constant from a file":
            out = out * torch.from_numpy(np.load(where / "w.npy"))
        elif kind == "the order of a set":
            for k in ORDER:
                out = out * k + 1
        loss = out.square().mean()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


READ_OUTSIDE = ["a file read in the step", "a constant from a file", "the order of a set"]


@pytest.mark.parametrize("kind", READ_OUTSIDE)
def test_what_no_check_reads_is_found_by_the_replay(kind, tmp_path, monkeypatch):
    """A kept program is taken only where the step, run again on fake tensors, dispatches what its
    capture dispatched (flowexec/op_log.py): a value read from a file, a constant loaded from
    one and a set's order (which equality ignores) are read by no guard and no walk, and each,
    changed, changes the ops or their arguments."""
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path / "programs"))
    monkeypatch.setenv("FLOWEXEC_KEEP", "1")
    (tmp_path / "cfg.json").write_text(json.dumps({"scale": 1.0}))
    np.save(tmp_path / "w.npy", np.ones(2, dtype=np.float32))
    x = torch.randn(3, 4)
    first = flowexec.compile(_reads_outside(kind, tmp_path), mode="trace")
    first(x)
    assert "; kept " in first.kept, first.kept
    again = flowexec.compile(_reads_outside(kind, tmp_path), mode="trace")
    again(x)
    assert again.kept.startswith("loaded "), again.kept  # (nothing changed: it loads)
    if kind == "a file read in the step":
        (tmp_path / "cfg.json").write_text(json.dumps({"scale": 2.0}))
    elif kind == "a constant from a file":
        np.save(tmp_path / "w.npy", np.array([1.0, 3.0], dtype=np.float32))
    else:
        monkeypatch.setitem(globals(), "ORDER", {16, 8})
        assert list(ORDER) == [16, 8] and ORDER == {8, 16}
    later = flowexec.compile(_reads_outside(kind, tmp_path), mode="trace")
    got = [later(x).item()]
    assert "is not what a capture would make now" in later.kept and later.capture_run == "fake", later.kept
    got += [later(x).item() for _ in range(2)]
    eager = _reads_outside(kind, tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor([eager(x).item() for _ in range(3)]))


# --- found by a review of the replay (2026-12-07) ----------------------------------------------

def _divides_by_a_file_constant(where: Path):
    def step(x):
        return x / torch.tensor(json.loads((where / "c.json").read_text())["c"])  # (kept by value)
    return step


def test_a_constant_kept_by_value_is_compared_by_its_bytes(tmp_path, monkeypatch):
    """-0.0 == 0.0 and nan != nan: compared as numbers, a constant of -0.0 took the program kept
    for 0.0 (x / c: inf where eager gives -inf), and one holding a NaN never loaded."""
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path / "programs"))
    (tmp_path / "c.json").write_text('{"c": [0.0, NaN]}')
    x = torch.ones(2)
    first = flowexec.compile(_divides_by_a_file_constant(tmp_path), mode="trace")
    first(x)
    assert "; kept " in first.kept, first.kept
    again = flowexec.compile(_divides_by_a_file_constant(tmp_path), mode="trace")
    again(x)
    assert again.kept.startswith("loaded "), again.kept  # (the NaN equals itself)
    (tmp_path / "c.json").write_text('{"c": [-0.0, NaN]}')
    later = flowexec.compile(_divides_by_a_file_constant(tmp_path), mode="trace")
    got = later(x)
    assert "is not what a capture would make now" in later.kept, later.kept
    assert got[0].item() == float("-inf") and got[1].isnan()


def test_a_grad_scaler_step_loads(tmp_path, monkeypatch):
    """The replay puts plain objects' attributes back where a capture does (a first or untouched
    call): holding a GradScaler's per-optimizer dict through a later call's replay, which
    update() replaces, left the run's found_inf in it, and the replay refused the step as
    leaving state behind, so its kept program never loaded."""
    monkeypatch.setenv("FLOWEXEC_KEEP_DIR", str(tmp_path / "programs"))

    def make():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu")

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()
        return step

    x, y = torch.randn(8, 16), torch.randn(8, 4)
    first = flowexec.compile(make(), mode="trace")
    got = [first(x, y).item() for _ in range(2)]
    assert "; kept " in first.kept and first.capture_run == "fake", first.kept
    later = flowexec.compile(make(), mode="trace")
    got += [later(x, y).item() for _ in range(2)]
    assert later.kept.startswith("loaded "), later.kept
    eager_a, eager_b = make(), make()
    want = [eager_a(x, y).item() for _ in range(2)] + [eager_b(x, y).item() for _ in range(2)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
