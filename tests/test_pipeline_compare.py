"""`flowexec schedules`: schedules compared by simulation before anything runs, against the
bubble and activation formulas and as a readable table; a user's plan file checked beside them."""
from __future__ import annotations

import os
import shlex

import pytest

from flowexec.cli import main
from flowexec.pipeline import interleaved_1f1b
from flowexec.pipeline.compare import compare

pytestmark = pytest.mark.timeout(60)

TABLE = """
2 ranks, 4 micro-batches; a micro-batch through a rank's layers costs F 1, I 1, W 1 (B = I + W); a message 0
schedule         stages a rank     step  bubble  activations held, rank 0 1 ...
FThenB                       1       15   20.0%  4 4
1F1B                         1       15   20.0%  2 1
Eager1F1B                    1       15   20.0%  3 1
Interleaved1F1B              2     13.5   11.1%  2.5 1.5
ZBH1                         1       13    7.7%  2 2
ZBV                          2     12.5    4.0%  2 2

eager1f1b:
rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
"""


def test_the_table_for_two_ranks(capsys):
    assert main(["schedules", "--ranks", "2", "--micro", "4", "--show", "eager1f1b"]) == 0
    assert capsys.readouterr().out.strip() == TABLE.strip()


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16), (3, 6)])
def test_rows_follow_the_formulas(p, m):
    rows = {r.name: r for r in compare(p, m)}
    for name in ("FThenB", "1F1B", "Eager1F1B"):
        assert rows[name].bubble == pytest.approx((p - 1) / (m + p - 1))
    assert rows["FThenB"].activations == (m,) * p
    assert rows["1F1B"].activations == tuple(float(min(p - r, m)) for r in range(p))
    assert rows["Eager1F1B"].activations == tuple(float(min(2 * (p - r) - 1, m)) for r in range(p))
    # Interleaved1F1B (v = 2) on the same layers: jobs of half the cost, a bubble divided by v
    assert rows["Interleaved1F1B"].stages_per_rank == 2
    assert rows["Interleaved1F1B"].bubble == pytest.approx(((p - 1) / 2) / (m + (p - 1) / 2))
    assert rows["ZBH1"].makespan == pytest.approx(3 * m + (p - 1))  # idle (p-1)(T_F+T_I-T_W)
    assert rows["ZBV"].makespan == pytest.approx(3 * m + (p - 1) / 2)  # only the fill, of half-size forwards


def test_a_latency_costs_1f1b_more_than_eager_1f1b():
    rows = {r.name: r for r in compare(2, 8, latency=0.1)}
    assert rows["Eager1F1B"].makespan == pytest.approx(27.2)  # 27 + 2 messages: the fill and the drain
    assert rows["1F1B"].makespan > rows["Eager1F1B"].makespan + 0.5


def test_a_schedule_that_does_not_fit_says_why(capsys):
    assert main(["schedules", "--ranks", "4", "--micro", "9"]) == 0
    out = capsys.readouterr().out
    assert "Interleaved1F1B  does not fit: " in out and "8 or 10 do" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert rows["ZBH1"][:3] == ["1", "30", "10.0%"]  # the others still compared: idle (p-1)(T_F+T_I-T_W)
    assert main(["schedules", "--ranks", "4", "--micro", "9", "--show", "interleaved1f1b"]) == 0
    with pytest.raises(ValueError) as why:
        interleaved_1f1b(4, 9)
    assert capsys.readouterr().out.endswith(f"interleaved1f1b:\ndoes not fit: {why.value}\n")  # the table stays


def test_a_plan_file_is_checked_and_compared_at_its_sizes(tmp_path, capsys):
    mine = tmp_path / "mine.txt"
    mine.write_text("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n")
    assert main(["schedules", "--plan", str(mine)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 ranks, 2 micro-batches")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:9]}
    assert rows["mine.txt"] == ["1", "9", "33.3%", "2", "1"] == rows["1F1B"]  # the file's row: 1F1B's order
    assert "rank 0: 0F0 0F1 0B0 0B1" in out


def test_bad_input_is_named(tmp_path, capsys):
    stuck = tmp_path / "stuck.txt"
    stuck.write_text("rank 0: 0B0 0F0\nrank 1: 1F0 1B0\n")
    assert main(["schedules", "--plan", str(stuck)]) == 2
    assert f"{stuck}: plan deadlocks: rank 0 waits at 0B0 for 0F0" in capsys.readouterr().err
    assert main(["schedules", "--costs", "1,2"]) == 2
    assert "--costs takes three finite numbers T_F,T_I,T_W" in capsys.readouterr().err
    ok = tmp_path / "ok.txt"
    ok.write_text("rank 0: 0F0 0B0\nrank 1: 1F0 1B0\n")
    assert main(["schedules", "--plan", str(ok), "--ranks", "3"]) == 2
    assert "has 2 ranks and 1 micro-batches, but --ranks 3 was given" in capsys.readouterr().err
    assert main(["schedules", "--plan", str(tmp_path / "missing.txt")]) == 2
    assert "No such file" in capsys.readouterr().err
    assert main(["schedules", "--show", "dualpipe"]) == 2
    assert "unknown schedule 'dualpipe'" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--ranks", "0"], "--ranks must be at least 1, got 0"),
    (["--micro", "0"], "--micro must be at least 1, got 0"),
    (["--costs", "nan,1,1"], "--costs takes three finite numbers"),
    (["--costs", "inf,1,1"], "--costs takes three finite numbers"),
    (["--costs=-1,1,1"], "none negative"),
    (["--costs", "0,0,1"], "T_F + T_I above 0"),
    (["--latency", "nan"], "--latency must be a finite number >= 0, got nan"),
    (["--latency", "-1"], "--latency must be a finite number >= 0, got -1.0"),
])
def test_bad_options_are_named(args, says, capsys):
    assert main(["schedules", *args]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("text, says", [
    ("rank 0: 0F0 0B0\nrank 1:\n", "every rank must hold as many stages to compare on a rank's costs, got rank 0: 1, "
                                    "rank 1: 0"),
    ("rank 0: 0F0 0B0\nrank 1: 1F0 2F0 2B0 1B0\n", "got rank 0: 1, rank 1: 2"),
    ("rank 0: 0OPT\n", "the plan has no forward or backward jobs"),
])
def test_plans_that_cannot_be_compared_are_named(tmp_path, capsys, text, says):
    plan = tmp_path / "p.txt"
    plan.write_text(text)
    assert main(["schedules", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert says in err and "p.txt" in err


def test_plan_files_of_other_sizes_or_encodings_and_one_name(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("rank 0: 0F0 0B0\nrank 1: 1F0 1B0\n")
    b.write_text("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n")
    assert main(["schedules", "--plan", str(a), "--plan", str(b)]) == 2
    assert f"{b} has 2 ranks and 2 micro-batches, {a} 2 and 1" in capsys.readouterr().err
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"rank 0: 0F0 0B0 \xe9\n")
    assert main(["schedules", "--plan", str(latin)]) == 2
    assert f"{latin}: 'utf-8' codec can't decode" in capsys.readouterr().err
    (tmp_path / "d1").mkdir(), (tmp_path / "d2").mkdir()
    same = [tmp_path / "d1" / "x.txt", tmp_path / "d2" / "x.txt"]
    for f in same:
        f.write_text(a.read_text())
    assert main(["schedules", "--plan", str(same[0]), "--plan", str(same[1])]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:10]]
    assert str(same[0]) in names and str(same[1]) in names  # two rows, by path


def test_the_example_in_the_docs_is_what_the_command_prints(capsys):
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "pipeline.md")) as f:
        doc = f.read()
    block = doc[doc.index("$ flowexec schedules"):]
    block = block[:block.index("```")]
    command, shown = block.split("\n", 1)
    assert main(shlex.split(command)[2:]) == 0
    assert capsys.readouterr().out.strip() == shown.strip()
