"""Executes every notebook's code cells (notebooks import rlx, never redefine it)."""

import json
import pathlib

import numpy as np
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _code(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())["cells"]
  lines = []
  for cell in cells:
    if cell["cell_type"] != "code":
      continue
    for line in "".join(cell["source"]).splitlines():
      # Shell / magic lines (`!pip ...`, `%pip ...`) are for Colab, not for this test.
      lines.append("" if line.lstrip().startswith(("!", "%")) else line)
    lines.append("")
  return "\n".join(lines)


def test_there_are_notebooks():
  assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
  source = _code(path)
  namespace: dict = {"__name__": path.stem}
  exec(compile(source, str(path), "exec"), namespace)
  out = capsys.readouterr().out
  if path.name == "objectives_tour.ipynb":
    assert "valid position     1  window [0.975, 1.051]" in out
    assert "valid position   100  window [0.779, 1.649]" in out
    assert out.count("[-1.  2.]") == 4
    np.testing.assert_array_equal(np.asarray(namespace["new_mask"]), 1.0)
