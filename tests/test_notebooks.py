"""Executes every notebook in a real Jupyter kernel (nbclient), as a user would.

Notebooks import rlx and never redefine it. They are committed with their
outputs (so the plots show on GitHub and Colab without running); this test
also checks that they are. `RLX_NOTEBOOK_SMALL=1` is set in the kernel's
environment so a notebook that trains can shrink its run for the test.
"""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

# Extra code run in the notebook's kernel after its own cells, per notebook.
CHECKS = {
  "objectives_tour.ipynb": (
    "import numpy as np\n"
    "np.testing.assert_array_equal(np.asarray(new_mask), 1.0)\n"
    "print('checks passed')"
  ),
}

# Text each notebook must print when executed.
EXPECTED_TEXT = {
  "objectives_tour.ipynb": [
    "valid position     1  window [0.975, 1.051]",
    "valid position   100  window [0.779, 1.649]",
  ],
}


def _text(nb) -> str:
  parts = []
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      if out.get("output_type") == "stream":
        parts.append(out["text"])
      elif "data" in out and "text/plain" in out["data"]:
        parts.append(out["data"]["text/plain"])
  return "".join(parts)


# Cells whose outputs depend on the run size (RLX_NOTEBOOK_SMALL shrinks them):
# tagged so in the notebook's cell metadata; every other cell must print in the
# test exactly what the committed notebook shows, so committed outputs that no
# longer match the code fail (re-execute with experiments/execute_notebooks.py).
RUN_SIZE_TAG = "depends-on-run-size"


def _cell_texts(nb) -> list[str]:
  """The printed text of each code cell not tagged `RUN_SIZE_TAG`."""
  out = []
  for cell in nb.cells:
    if cell.cell_type != "code" or RUN_SIZE_TAG in cell.get("metadata", {}).get("tags", []):
      continue
    out.append(
      "".join(o["text"] for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    )
  return out


def _images(nb) -> int:
  return sum(
    "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
  )


def _cells_missing_their_plot(nb) -> list[int]:
  """Code cells that call plt.show() but have no image output."""
  return [
    i
    for i, cell in enumerate(nb.cells)
    if cell.cell_type == "code"
    and "plt.show()" in cell.source
    and not any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))
  ]


def test_there_are_notebooks():
  assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_outputs(path):
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(c.get("execution_count") for c in code), "run every cell before committing"
  assert _images(nb) >= 1, "the committed notebook shows at least one plot"
  assert not _cells_missing_their_plot(nb), "cells that plot were committed without their plot"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_a_kernel(path, monkeypatch):
  monkeypatch.setenv("RLX_NOTEBOOK_SMALL", "1")
  nb = nbformat.read(path, as_version=4)
  committed = _cell_texts(nb)
  if path.name in CHECKS:
    nb.cells.append(nbformat.v4.new_code_cell(CHECKS[path.name]))
  client = NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
  )
  client.execute(env=dict(os.environ))
  text = _text(nb)
  fresh = _cell_texts(nb)[: len(committed)]
  for i, (a, b) in enumerate(zip(committed, fresh, strict=True)):
    assert a == b, f"cell {i}: the committed output differs from the current code's:\n{a}\n{b}"
  for expected in EXPECTED_TEXT.get(path.name, []):
    assert expected in text
  if path.name in CHECKS:
    assert "checks passed" in text
  assert _images(nb) >= 1
  assert not _cells_missing_their_plot(nb)  # e.g. a library call switched the backend
