"""The README's Python examples run as written, so the tour stays true: every ```python block
on CPU (in CI), the ```python gpu blocks where CUDA is (skipped, by name, elsewhere)."""
from __future__ import annotations

import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
_BLOCK = re.compile(r"^```(python(?: gpu)?)\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str, int]]:
    text = open(README, encoding="utf-8").read()
    return [(m.group(1), m.group(2), text[: m.start()].count("\n") + 1) for m in _BLOCK.finditer(text)]


BLOCKS = _blocks()


def test_the_readme_has_cpu_examples():
    kinds = [k for k, _, _ in BLOCKS]
    assert kinds.count("python") >= 6 and "python gpu" in kinds


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,code,line", BLOCKS, ids=[f"line{b[2]}" for b in BLOCKS])
def test_readme_example_runs(kind, code, line, capsys):
    if kind == "python gpu" and not torch.cuda.is_available():
        pytest.skip("a CUDA example (```python gpu)")
    torch.manual_seed(0)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out  # each CPU example prints what it shows
