"""Runs the README's tour snippet so the README stays true."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(text: str) -> list[str]:
  """The README's python blocks, except the user files (`# my_*.py`, run by tests/rl)."""
  blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
  return [b for b in blocks if not re.match(r"# my_\w+\.py", b)]


def test_readme_tour_runs(capsys):
  blocks = _python_blocks(README.read_text())
  assert len(blocks) == 1, "the README has exactly one python tour block"
  namespace: dict = {"__name__": "readme_tour"}
  exec(compile(blocks[0], str(README), "exec"), namespace)
  out = capsys.readouterr().out
  assert "'loss'" in out and "'grad_norm'" in out
  assert int(namespace["keep"].sum()) == 4  # one pivot dropped per group of 3
  sampled = namespace["out"]
  assert sampled.tokens.shape == (8, 12)
  assert list(sampled.prompt_index) == [0, 0, 0, 0, 1, 1, 1, 1]
  assert "(8, 12) [0 0 0 0 1 1 1 1]" in out
