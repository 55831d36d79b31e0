"""Graph mode's precomputed per-call checks of borrowed inputs (flowexec/runtime/borrowed.py):
the fast path must still notice every change that the full check noticed — a moved parameter,
a ``.data =`` rebinding, a staged argument on a borrowed one's storage, a new tensor object at
the captured address — and give eager's values (stand-in graphs on CPU)."""
from __future__ import annotations

import gc
import warnings

import pytest
import torch

from flowexec import RecaptureWarning
from flowexec.executable import Executable
from flowexec.runtime.borrowed import BorrowedAddresses
from helpers import assert_close_rel
from test_staging import stand_in_graphs  # noqa: F401  (a fixture: graph mode on CPU)


def _step(ps: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Writes every parameter in place (so graph mode borrows them) and reads the staged x."""
    with torch.no_grad():
        for k, p in enumerate(ps):
            p.mul_(0.5).add_(x, alpha=k + 1)
    return sum(p.sum() for p in ps) * x.sum()


def _setup(n: int = 3):
    torch.manual_seed(0)
    ps = [torch.randn(4) for _ in range(n)]
    ref = [p.clone() for p in ps]
    exe = Executable(_step, "graph", "fast", {}).compile_for([p.clone() for p in ps], torch.randn(4))
    return ps, ref, exe


def _both(exe, ps, ref, x, xref=None):
    got = exe(ps, x)
    want = _step(ref, x if xref is None else xref)
    assert_close_rel(got, want, what="loss")
    assert_close_rel(ps, ref, what="params")


def test_fast_path_runs_the_graph_borrowing_the_real_state(stand_in_graphs):  # noqa: F811
    ps, ref, exe = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        for _ in range(3):
            _both(exe, ps, ref, torch.randn(4))
    runner = exe._last.runner
    assert runner.graph_count == 2  # compile's copies, then the real parameters
    assert runner.select([*ps, torch.randn(4)], exe._state_keys) is runner._graphs[1]


def test_a_moved_parameter_is_not_read_at_its_old_address(stand_in_graphs):  # noqa: F811
    ps, ref, exe = _setup()
    _both(exe, ps, ref, torch.randn(4))
    ps[1].data = ps[1].data.clone()  # same object, new address (the old storage dies)
    # Graphs so far: compile's copies, the real parameters; a third set of addresses is staged.
    with pytest.warns(RecaptureWarning, match="different addresses"):
        _both(exe, ps, ref, torch.randn(4))
    ps[2].set_(ps[2].clone())  # the same through set_
    _both(exe, ps, ref, torch.randn(4))
    assert exe._last.runner.graph_count == 3


def test_a_new_tensor_object_at_the_captured_address_reads_and_writes_it_in_place(stand_in_graphs):  # noqa: F811
    ps, ref, exe = _setup()
    _both(exe, ps, ref, torch.randn(4))
    q = torch.empty(0).set_(ps[1].untyped_storage(), 0, (4,), (1,))  # another tensor on ps[1]'s memory
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        got = exe([ps[0], q, ps[2]], x := torch.randn(4))
    assert_close_rel(got, _step(ref, x))
    assert_close_rel(ps, ref, what="params (written through q)")
    assert exe._last.runner.graph_count == 2


def test_a_staged_argument_on_a_borrowed_ones_storage_is_noticed(stand_in_graphs):  # noqa: F811
    ps, ref, exe = _setup()
    _both(exe, ps, ref, torch.randn(4))
    # x is ps[0] itself: a write to ps[0] shows in x, which a staged copy of x would miss.
    with pytest.warns(RecaptureWarning, match="storage"):
        _both(exe, ps, ref, ps[0], ref[0])
    big = torch.randn(8)
    ps2 = [big[:4], *[p.clone() for p in ps[1:]]]
    ref2 = [p.clone() for p in ps2]
    exe = Executable(_step, "graph", "fast", {}).compile_for(ps2, torch.randn(4))  # borrows ps2 itself
    _both(exe, ps2, ref2, torch.randn(4))  # big[:4] alone on its storage among the arguments
    assert exe._last.runner.graph_count == 1
    with pytest.warns(RecaptureWarning, match="storage"):  # x = big[4:]: on borrowed ps2[0]'s storage
        _both(exe, ps2, ref2, big[4:], big[4:].clone())


def test_a_square_parameter_transposed_in_place_recaptures(stand_in_graphs):  # noqa: F811
    fn = lambda w, x: (w.add_(1.0) @ x).sum()  # noqa: E731
    w, x = torch.randn(3, 3), torch.randn(3, 2)
    exe = Executable(fn, "graph", "fast", {}).compile_for(w.clone(), x)
    wref = w.clone()
    assert_close_rel(exe(w, x), fn(wref, x))
    w.t_(), wref.t_()  # same object, same address, other strides: the tensor guard's business
    with pytest.warns(RecaptureWarning, match="stride"):
        assert_close_rel(exe(w, x), fn(wref, x))
    assert_close_rel(w, wref)


def test_borrowed_addresses_check():
    p, q, x = torch.zeros(3), torch.zeros(3), torch.zeros(2)
    check = BorrowedAddresses([p, q, x, 1.5], [True, True, False, False])
    assert check.positions == (0, 1) and check.staged == (2,)
    assert check.matches([p, q, torch.ones(2), 1.5])
    assert check.moved([p, torch.zeros(3), x, 1.5]) == [1]
    assert check.unshared([p, q, torch.ones(2), 1.5], frozenset()) is True
    assert check.unshared([p, q, q[1:], 1.5], frozenset()) is False  # staged on a borrowed storage
    state = torch.zeros(5)
    key = state.untyped_storage().data_ptr()
    assert check.unshared([p, q, state[:2], 1.5], frozenset({key})) is False  # staged on closure state
    assert check.unshared([p, q, x, 1.5], frozenset({p.untyped_storage().data_ptr()})) is None
    assert check.unshared([p, q, x, 1.5], frozenset()) is True  # (recomputed for the new state set)
    p.data = torch.zeros(3)  # the captured storage dies: the check can no longer vouch
    gc.collect()
    assert check.unshared([p, q, x, 1.5], frozenset()) is None
    # Borrowed inputs sharing a storage with each other: always the full check.
    b = torch.zeros(6)
    assert BorrowedAddresses([b[:3], b[3:]], [True, True]).unshared([b[:3], b[3:]], frozenset()) is None
