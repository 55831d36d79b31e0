"""flowexec.verify_plan against the planner, on random programs: every pruned plan is accepted,
and leaving out any single one of its waits leaves a hazard the verifier names."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import flowexec
from flowexec.capture import capture
from flowexec.passes.verify import Hazard, HazardError, check_plan, verify_plan, without_wait
from flowexec.plan import build_plan

UNARY = ("sin", "exp", "neg", "tanh")


@st.composite
def recipes(draw):
    """A straight-line program over two inputs and one closure state tensor: unary and binary
    ops, transposes (views), in-place writes into temporaries and into the state."""
    n = draw(st.integers(2, 14))
    steps = []
    for k in range(n):
        have = 2 + len(steps)
        kind = draw(st.sampled_from(("unary", "binary", "view", "inplace", "state")))
        a, b = draw(st.integers(0, have - 1)), draw(st.integers(0, have - 1))
        steps.append((kind, a, b, draw(st.sampled_from(UNARY))))
    return tuple(steps)


def program_of(recipe):
    state = torch.randn(4, 4)

    def f(x, y):
        vals = [x, y]
        for kind, a, b, name in recipe:
            if kind == "unary":
                vals.append(getattr(torch, name)(vals[a]))
            elif kind == "binary":
                vals.append(vals[a] * 0.5 + vals[b])
            elif kind == "view":
                vals.append(vals[a].t())
            elif kind == "inplace" and a >= 2:  # a temporary written in place
                vals.append(vals[a].add_(vals[b].cos()))
            else:  # closure state read and written: ordered across calls too
                state.mul_(0.5).add_(vals[a])
                vals.append(state.sin())
        return vals[-1] + vals[-2], state.sum()

    return f, capture(f, (torch.randn(4, 4), torch.randn(4, 4))).program


@settings(max_examples=60, deadline=None)
@given(recipe=recipes(), n_streams=st.integers(2, 4), workers=st.booleans())
def test_pruned_plans_pass_and_every_wait_is_needed(recipe, n_streams, workers):
    _, prog = program_of(recipe)
    plan = build_plan(prog, streams=n_streams, workers=workers)
    assert verify_plan(prog, plan) == []
    for j, ins in enumerate(plan.instructions):
        for k in range(len(ins.waits)):
            assert verify_plan(prog, without_wait(plan, j, k)), (j, k)
    naive = build_plan(prog, streams=n_streams, workers=workers, prune=False)
    assert verify_plan(prog, naive) == []
    s = plan.stats()
    assert s["waits"] <= s["naive_waits"] == s["cross_stream_edges"] == naive.stats()["waits"]


def table(plan):
    return [(i.op.name.split(".")[1], i.stream, i.waits, i.records) for i in plan.instructions]


def test_a_view_needs_no_wait_and_its_consumer_waits_for_the_data():
    def f(x):
        a = x.sin()       # stream 0
        b = x.cos() * 2   # stream 1: b's writer
        return a + b.t()  # the transpose is metadata: only the add waits, for mul

    prog = capture(f, (torch.randn(4, 4),)).program
    plan = build_plan(prog, streams=2, workers=False)  # device streams: the host makes the view
    assert table(plan) == [
        # op     stream waits records
        ("sin",  0,     (),   ()),
        ("cos",  1,     (),   ()),
        ("mul",  1,     (),   (0,)),
        ("t",    1,     (),   ()),   # a view on stream 1 after mul: needs nothing either way
        ("add",  0,     (0,), ()),
    ]
    s = plan.stats()
    assert (s["cross_stream_edges"], s["waits"], s["naive_waits"], s["events"]) == (1, 1, 1, 1)
    # on worker threads the view object is made by stream 1's worker: the add waits for it
    # (which covers mul, earlier on that stream)
    assert [i.records for i in build_plan(prog, streams=2, workers=True).instructions] == [(), (), (), (0,), ()]


def test_naive_plan_counts_one_event_per_edge_and_pruning_saves_the_implied_ones():
    def f(x):
        a = x.sin()        # stream 0
        b = a.cos()        # stream 0
        c = x.exp()        # stream 1
        d = c * a          # stream 1, waits for a
        e = d * a          # stream 1: a is ordered already (naive: a second wait)
        return e + b       # stream 0, waits for e

    plan = build_plan(capture(f, (torch.randn(4),)).program, streams=2)
    naive = build_plan(capture(f, (torch.randn(4),)).program, streams=2, prune=False)
    s = plan.stats()
    assert s["naive_waits"] == naive.stats()["waits"] == s["cross_stream_edges"]
    assert (s["cross_stream_edges"], s["naive_waits"], s["waits"], s["events"]) == (3, 3, 2, 2), s
    assert verify_plan(naive.program, naive) == [] == verify_plan(plan.program, plan)


def test_hazards_name_the_ops_and_the_kind():
    def f(x):
        return x.sin() + x.cos()

    plan = build_plan(capture(f, (torch.randn(4),)).program, streams=2, workers=False)
    j = next(j for j, i in enumerate(plan.instructions) if i.waits)
    (h,) = [h for h in verify_plan(plan.program, without_wait(plan, j, 0)) if h.kind == "RAW"]
    assert isinstance(h, Hazard) and h.second == j and h.streams == (1, 0) and not h.next_call
    text = h.describe(plan.program)
    assert text.startswith("RAW: op #2 (stream 0) reads what op #1 (stream 1) writes") and "aten.cos" in text
    with pytest.raises(HazardError, match="1 cross-stream hazard"):
        check_plan(without_wait(plan, j, 0))


def test_a_free_before_another_streams_use_is_a_hazard():
    def f(x):
        a = x.sin()
        b = a.cos()  # a read on another stream, then freed
        return b + x

    prog = capture(f, (torch.randn(4),)).program
    plan = build_plan(prog, streams=2, workers=False)
    import dataclasses

    ins = list(plan.instructions)
    for k, i in enumerate(ins):  # drop the record_stream / release entries
        ins[k] = dataclasses.replace(i, stream_uses=())
    bare = dataclasses.replace(plan, instructions=tuple(ins))
    if any(i.stream_uses for i in plan.instructions):
        assert any(h.kind == "FREE" for h in verify_plan(prog, bare))
    wplan = build_plan(prog, streams=2, workers=True)
    assert verify_plan(prog, wplan) == []


def test_next_call_is_ordered_by_the_fork_and_join():
    s = torch.zeros(4)

    def f(x):
        s.add_(x.sin())      # state written on one stream
        return x.cos() * s   # and read on another, then written again next call

    plan = build_plan(capture(f, (torch.randn(4),)).program, streams=2, workers=True)
    assert verify_plan(plan.program, plan, calls=3) == []
    # without the fork and join model (one call at a time) nothing would order the calls: the
    # verifier checks the second call against the first
    assert {h.next_call for h in verify_plan(plan.program, plan, calls=2)} <= {False}


def test_debug_flag_verifies_every_build(monkeypatch):
    monkeypatch.setenv("FLOWEXEC_DEBUG", "1")
    import flowexec.passes.verify as v

    calls = []
    real = v.check_plan
    monkeypatch.setattr(v, "check_plan", lambda plan: (calls.append(plan), real(plan)))
    build_plan(capture(lambda x: x.sin() + x.cos(), (torch.randn(4),)).program, streams=2)
    assert len(calls) == 1
    assert flowexec.verify_plan is verify_plan
