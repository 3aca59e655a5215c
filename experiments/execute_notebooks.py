r"""Re-executes the notebooks in place at full size, so their committed outputs match the code.

  python experiments/execute_notebooks.py                      # every notebook
  python experiments/execute_notebooks.py notebooks/quickstart.ipynb

Run it after any change that moves the numbers a notebook shows (its cells'
printed outputs are compared with a fresh execution by tests/test_notebooks.py,
except cells tagged "depends-on-run-size", which the test runs smaller).
"""

import pathlib
import sys

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"


def main(argv):
  paths = [pathlib.Path(p) for p in argv[1:]] or sorted(NOTEBOOKS.glob("*.ipynb"))
  for path in paths:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
      nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    nbformat.write(nb, path)
    print(f"executed {path}")
  print("rerun: python " + " ".join(["experiments/execute_notebooks.py", *argv[1:]]))


if __name__ == "__main__":
  main(sys.argv)
