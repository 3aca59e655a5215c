"""Record loading from JSONL or Parquet files (local paths or any `etils.epath` path)."""

import io
import json
import os
from collections.abc import Sequence
from typing import Any

from etils import epath

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


def _read_jsonl(path: epath.Path, task: str) -> list[dict[str, Any]]:
  text = path.read_text()
  stripped = text.lstrip()
  if stripped.startswith("["):  # a .json file holding one array of records
    try:
      records = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"Task {task!r}: {os.fspath(path)} is not valid JSON: {e}") from e
    return [_as_record(r, path, i + 1, task) for i, r in enumerate(records)]
  records = []
  for line_number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(
        f"Task {task!r}: line {line_number} of {os.fspath(path)} is not valid JSON: {e}"
      ) from e
    records.append(_as_record(record, path, line_number, task))
  return records


def _as_record(record: Any, path: epath.Path, row: int, task: str) -> dict[str, Any]:
  if not isinstance(record, dict):
    raise ValueError(
      f"Task {task!r}: record {row} of {os.fspath(path)} is a {type(record).__name__}, "
      "expected a JSON object."
    )
  return record


def _read_parquet(path: epath.Path, fields: Sequence[str], task: str) -> list[dict[str, Any]]:
  import pyarrow.parquet as pq

  data = path.read_bytes()
  if not data:
    return []
  try:
    parquet = pq.ParquetFile(io.BytesIO(data))
  except Exception as e:  # pyarrow raises ArrowInvalid, a ValueError subclass, or OSError
    raise ValueError(f"Task {task!r}: {os.fspath(path)} is not a Parquet file: {e}") from e
  names = parquet.schema_arrow.names
  missing = [f for f in fields if f not in names]
  if missing:
    raise ValueError(
      f"Task {task!r}: field {missing[0]!r} is missing from {os.fspath(path)} "
      f"(its columns are {names})."
    )
  return parquet.read(columns=list(fields)).to_pylist()


def load_records(
  path: str | os.PathLike, fields: Sequence[str], *, task: str = "task"
) -> list[dict[str, Any]]:
  """Reads records (dicts) from a JSONL / JSON-array / Parquet file and checks `fields`.

  Args:
    path: a `.jsonl`/`.ndjson`/`.json` (one JSON object per line, or one
      array) or `.parquet`/`.pq` file; any `etils.epath` path (e.g. gs://).
    fields: the keys every record must have, each non-null.
    task: the task name for error messages.

  Returns:
    The records in file order, each a dict holding at least `fields`.

  Raises:
    ValueError naming the task and the file: a missing file, an unknown
    suffix, an empty file, a malformed line, a missing or null field (named,
    with the row).
  """
  path = epath.Path(path)
  if not path.exists():
    raise ValueError(f"Task {task!r}: no file {os.fspath(path)}.")
  suffix = path.suffix.lower()
  if suffix in PARQUET_SUFFIXES:
    records = _read_parquet(path, fields, task)
  elif suffix in JSONL_SUFFIXES:
    records = _read_jsonl(path, task)
  else:
    raise ValueError(
      f"Task {task!r}: cannot read {os.fspath(path)}; expected a suffix in "
      f"{JSONL_SUFFIXES + PARQUET_SUFFIXES}."
    )
  if not records:
    raise ValueError(f"Task {task!r}: {os.fspath(path)} is empty (no records).")
  for row, record in enumerate(records, start=1):
    for field in fields:
      if field not in record:
        raise ValueError(
          f"Task {task!r}: field {field!r} is missing from record {row} of {os.fspath(path)} "
          f"(its fields are {sorted(record)})."
        )
      if record[field] is None:
        raise ValueError(
          f"Task {task!r}: field {field!r} is null in record {row} of {os.fspath(path)}."
        )
  return records
