"""Reading the markdown tables that the benchmark scripts print (for their smoke tests)."""


def rows(table: str, header: str) -> dict[str, list[str]]:
  """The rows of the markdown table under `header`: first cell -> the other cells."""
  block = table.split(header, 1)[1].split("\n\n", 2)[1]
  out = {}
  for line in block.splitlines()[2:]:
    cells = [c.strip() for c in line.strip("|").split("|")]
    out[cells[0]] = cells[1:]
  return out
