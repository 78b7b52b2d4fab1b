"""A measured run's records as its CSV files hold them (``requests.csv``: one row a request;
``timeline.csv``: one row a second), read from the file or from its gzipped copy ``<name>.gz``
(the docs keep their raw timelines gzipped)."""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path


def read_csv(path: Path | str) -> list[dict]:
    """The rows of a CSV file (every field a string, as written), or of ``<path>.gz`` where only that
    exists."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    if not path.exists() and gz.exists():
        with gzip.open(gz, "rt", newline="") as f:
            return list(csv.DictReader(io.StringIO(f.read())))
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
