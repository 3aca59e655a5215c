"""No function body in rlx/ (its docstring excluded) is over 120 lines."""

import ast
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parents[1] / "rlx"
_LIMIT = 120


def _body_length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """Lines from the first statement after the docstring to the end of the last (comments count)."""
  body = node.body
  if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    body = body[1:]
  return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_no_function_body_is_over_120_lines():
  lengths = {}
  for path in sorted(_ROOT.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        lengths[f"{path.relative_to(_ROOT.parent)}:{node.lineno} {node.name}"] = _body_length(node)
  assert len(lengths) > 500  # every module was read
  long = {name: n for name, n in lengths.items() if n > _LIMIT}
  assert not long, f"function bodies over {_LIMIT} lines: {long}"


def test_the_count_includes_comments_and_excludes_the_docstring():
  source = 'def f():\n  """Doc.\n\n  More."""\n  a = 1\n  # a note\n\n  return a\n'
  (node,) = ast.parse(source).body
  assert _body_length(node) == 4
  (node,) = ast.parse('def g():\n  """Only a docstring."""\n').body
  assert _body_length(node) == 0
