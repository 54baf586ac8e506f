"""Reading trace CSVs with errors that name the file and line."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from pathlib import Path

from computepool.core.errors import InvalidInput


def traces_dir() -> Path:
    """Where the public traces live: $CPOOL_TRACES, else ../shared/traces beside the project."""
    env = os.environ.get("CPOOL_TRACES")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent.parent / "shared" / "traces"
        if (parent / "pyproject.toml").exists() and cand.exists():
            return cand
    return Path.cwd().parent / "shared" / "traces"


def read_rows(path: str | Path, required: list[str]) -> Iterator[tuple[str, dict[str, str]]]:
    """Yield (where, row) for each data row, where = "file:line". Checks the header first."""
    path = Path(path)
    try:
        fh = path.open(newline="", encoding="utf-8")
    except OSError as e:
        raise InvalidInput(str(path), f"cannot open: {e.strerror or e}") from None
    with fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        missing = [c for c in required if c not in header]
        if missing:
            raise InvalidInput(
                f"{path}:1",
                f"missing column(s) {', '.join(missing)} (header has {', '.join(header) or 'nothing'})",
            )
        for row in reader:
            yield f"{path}:{reader.line_num}", row


def int_field(row: dict[str, str], col: str, where: str, *, minimum: int = 0) -> int:
    raw = (row.get(col) or "").strip()
    try:
        value = int(raw)
    except ValueError:
        raise InvalidInput(where, f"column {col}: expected a whole number, got {raw!r}") from None
    if value < minimum:
        raise InvalidInput(where, f"column {col}: must be at least {minimum}, got {value}")
    return value


def float_field(row: dict[str, str], col: str, where: str, *, minimum: float = 0.0) -> float:
    raw = (row.get(col) or "").strip()
    try:
        value = float(raw)
    except ValueError:
        raise InvalidInput(where, f"column {col}: expected a number, got {raw!r}") from None
    if not value >= minimum:
        raise InvalidInput(where, f"column {col}: must be at least {minimum}, got {raw}")
    return value
