"""What the host did to a benchmark's servers while it ran: a sampler of page faults, CPU steal and I/O wait.

A benchmark on a shared or virtual machine can be paused by the host rather than by the server:
pages reclaimed behind the processes' back (a DAMON ``pageout`` scheme, memory pressure) come back as
major faults read from disk; a hypervisor takes CPU time as steal. :class:`HostSampler` reads, every
``interval_s`` on its own thread, the machine's ``pgmajfault`` (``/proc/vmstat``), steal and iowait
(``/proc/stat``), and the major faults and run-queue wait (main thread: time runnable but
waiting for a core) of every process of the server's tree summed by process name, and writes them
as cumulative counters to a CSV. :func:`stall_windows` finds the intervals in which
no streamed token reached the client while requests were in flight; :func:`faults_in` says how many
major faults fell in given intervals, to tell a host stall from a slow server.

Linux only (``/proc``); elsewhere the sampler records nothing and says so.
"""

from __future__ import annotations

import csv
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Sequence

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _vmstat_majfault() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("pgmajfault "):
                return int(line.split()[1])
    return 0


def cpu_steal_iowait_s() -> tuple[float, float]:
    """The host's CPU steal and I/O wait so far (seconds, all cores), from ``/proc/stat``."""
    with open("/proc/stat") as f:
        parts = f.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
    return int(parts[8]) / _HZ, int(parts[5]) / _HZ


def _majflt(pid: int) -> tuple[str, int] | None:
    """(name, major faults) of one process from /proc/<pid>/stat; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    name = s[s.index("(") + 1:s.rindex(")")]
    rest = s[s.rindex(")") + 2:].split()
    return name, int(rest[9])  # field 12 of stat: majflt (rest starts at field 3)


def _runq_s(pid: int) -> float | None:
    """Seconds the process's main thread spent runnable but waiting for a CPU (/proc/<pid>/schedstat)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return []


class HostSampler:
    """Samples the host's counters and the server tree's major faults into ``path`` (CSV, cumulative).

    Times are ``time.perf_counter()`` seconds, the clock the replay client stamps requests with.
    Processes that exit keep their last count (counters never go back)."""

    def __init__(self, pid: int | None, path: Path, interval_s: float = 0.25):
        self.pid, self.path, self.interval_s = pid, Path(path), interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = os.path.exists("/proc/vmstat") and pid is not None
        self.rows: list[dict] = []

    def __enter__(self) -> "HostSampler":
        if self.available:
            self._thread = threading.Thread(target=self._loop, name="kunserve-hostwatch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.write()

    def _loop(self) -> None:
        last: dict[int, tuple[str, int]] = {}
        waits: dict[int, float] = {}
        next_tree = 0.0
        pids: list[int] = []
        while not self._stop.is_set():
            now = time.perf_counter()
            if now >= next_tree:  # the tree changes rarely (engine start, restart): list it once a second
                pids, next_tree = _tree(self.pid), now + 1.0
            for p in pids:
                v = _majflt(p)
                if v is not None:
                    last[p] = v
                    w = _runq_s(p)
                    if w is not None:
                        waits[p] = w
            steal, iowait = cpu_steal_iowait_s()
            row = {"t": round(now, 4), "pgmajfault": _vmstat_majfault(), "steal_s": steal, "iowait_s": iowait}
            for p, (name, n) in last.items():
                key = "majflt:" + name
                row[key] = row.get(key, 0) + n
                if p in waits:
                    row["runq:" + name] = round(row.get("runq:" + name, 0.0) + waits[p], 4)
            self.rows.append(row)
            self._stop.wait(self.interval_s)

    def write(self) -> None:
        if not self.rows:
            return
        keys = ["t", "pgmajfault", "steal_s", "iowait_s"]
        keys += sorted({k for r in self.rows for k in r if k not in keys})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            prev: dict[str, float] = {}
            for r in self.rows:  # a process that left the tree keeps its count: carry forward
                prev.update({k: max(v, prev.get(k, 0)) for k, v in r.items()})
                w.writerow({k: prev.get(k, 0) for k in keys})


def read_host(path: Path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def stall_windows(streams: Iterable[tuple[float, Sequence[float]]], min_gap_s: float = 0.5,
                  min_active: int = 2) -> list[tuple[float, float, int]]:
    """Intervals (start, end, requests in flight) in which no token of any stream arrived for at
    least ``min_gap_s`` while at least ``min_active`` requests were between their first and last
    token. ``streams``: (send time, token times from send) per request, on one clock."""
    spans, times = [], []
    for send, toks in streams:
        if len(toks) >= 2:
            spans.append((send + toks[0], send + toks[-1]))
            times.extend(send + t for t in toks)
    times.sort()
    out = []
    for a, b in zip(times, times[1:]):
        if b - a >= min_gap_s:
            active = sum(1 for s, e in spans if s <= a and e >= b)
            if active >= min_active:
                out.append((a, b, active))
    return out


def faults_in(rows: Sequence[dict[str, float]], windows: Sequence[tuple[float, float]],
              key: str = "pgmajfault") -> float:
    """Major faults (counter ``key``) that fell inside the windows, from the samples around each."""
    total = 0.0
    for a, b in windows:
        before = [r[key] for r in rows if r["t"] <= a]
        after = [r[key] for r in rows if r["t"] >= b]
        if before and after:
            total += after[0] - before[-1]
    return total
