"""A run's raw data, one compressed file per run: ``docs/benchmarks/runs/<name>.tar.xz``.

A benchmark run leaves a folder (``compare.json``, per system and repetition ``requests.csv`` and the
per-second ``timeline.csv``, traces, ...). Its page keeps the whole folder, plus the page's own
analysis JSON as ``page.json``, in one xz-compressed tar (a 40-file R1 run: ~140 KB against 600 KB of
loose gzip files). Scripts that re-read a run (a page re-rendered, the simulator fitted to a run, the
README's headline over every comparable run) call ``run_dir`` with a folder, an archive or a run's
name and get a folder: an archive is unpacked once under ``runs/raw/<name>/`` (ignored by git).
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

from vllm_kunserve.bench.report import REPO

DOCS = REPO / "docs" / "benchmarks"
ARCHIVES = DOCS / "runs"
UNPACKED = REPO / "runs" / "raw"
SUFFIX = ".tar.xz"


def archive_of(name: str) -> Path:
    return ARCHIVES / f"{name}{SUFFIX}"


def rel_archive(name: str) -> str:
    """The archive's path as the pages name it."""
    return archive_of(name).relative_to(REPO).as_posix()


def names() -> list[str]:
    """Every archived run, by name."""
    return sorted(p.name[: -len(SUFFIX)] for p in ARCHIVES.glob(f"*{SUFFIX}"))


def pack(folder: Path, name: str, page: dict | None = None, into: Path | None = None) -> Path:
    """Write ``folder``'s files (gzipped ones stored plain: xz compresses them better) and ``page`` (the
    page's analysis JSON, as ``page.json``) into ``docs/benchmarks/runs/<name>.tar.xz``; the same files
    give the same bytes (sorted members, mtime 0)."""
    into = into or ARCHIVES
    into.mkdir(parents=True, exist_ok=True)
    out = into / f"{name}{SUFFIX}"
    members: list[tuple[str, bytes]] = []
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.relative_to(folder).as_posix()
        if rel == "page.json" and page is not None:
            continue
        data = f.read_bytes()
        if rel.endswith(".gz"):
            rel, data = rel[:-3], gzip.decompress(data)
        members.append((rel, data))
    if page is not None:
        members.append(("page.json", json.dumps(page, indent=1, default=str).encode()))
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for rel, data in sorted(members):
            info = tarfile.TarInfo(f"{name}/{rel}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return out


def unpack(name: str, into: Path | None = None) -> Path:
    """The folder of archived run ``name``, unpacked under ``into`` unless it is already there and
    newer than its archive."""
    src = archive_of(name)
    if not src.exists():
        raise FileNotFoundError(f"no archived run {name!r} ({src}); archived: {', '.join(names()) or 'none'}")
    into = into or UNPACKED
    dst = into / name
    stamp = dst / ".unpacked"
    if stamp.exists() and stamp.stat().st_mtime >= src.stat().st_mtime:
        return dst
    with tarfile.open(src, "r:xz") as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.startswith(f"{name}/") or ".." in Path(m.name).parts:
                raise ValueError(f"{src}: unexpected member {m.name!r}")
        tar.extractall(into, filter="data")
    stamp.touch()
    return dst


def run_dir(arg: str | Path) -> Path:
    """A run's folder from a folder, an archive path or an archived run's name."""
    p = Path(arg)
    if p.is_dir():
        return p
    if p.name.endswith(SUFFIX):
        return unpack(p.name[: -len(SUFFIX)])
    if not p.exists() and archive_of(p.name).exists():
        return unpack(p.name)
    raise FileNotFoundError(f"{arg}: neither a run folder nor an archived run ({ARCHIVES}/<name>{SUFFIX})")


def page(name: str) -> dict:
    """The analysis JSON a run's page was written from (``page.json`` in its archive)."""
    return json.loads((unpack(name) / "page.json").read_text())
