"""The host sampler, the client-side stall finder and the memory lock (bench/hostwatch.py,
memory/hostlock.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vllm_kunserve.bench.hostwatch import HostSampler, faults_in, read_host, stall_windows
from vllm_kunserve.memory import hostlock

pytestmark = pytest.mark.unit


def test_stall_windows_finds_gaps_of_every_stream_at_once_only():
    # two streams ticking every 0.1 s from t=0..3 and t=0.05..3.05, both silent between 1.0 and 2.0
    a = [i / 10 for i in range(0, 31) if not 1.0 < i / 10 < 2.0]
    b = [i / 10 for i in range(0, 31) if not 1.0 < i / 10 < 2.0]
    # a third stream sent at 5.0 with a long gap of its own while alone
    c = [0.0, 0.1, 1.5, 1.6]
    got = stall_windows([(0.0, a), (0.05, b), (5.0, c)], min_gap_s=0.5, min_active=2)
    assert len(got) == 1
    start, end, active = got[0]
    assert start == pytest.approx(1.05) and end == pytest.approx(2.0) and active == 2
    # one stream alone never makes a stall at min_active 2; at 1 its own gap counts
    assert [round(x[1] - x[0], 2) for x in stall_windows([(5.0, c)], 0.5, 1)] == [1.4]


def test_faults_in_counts_only_inside_the_windows():
    rows = [{"t": t, "pgmajfault": f} for t, f in [(0, 0), (1, 0), (2, 50), (3, 50), (4, 80), (5, 80)]]
    assert faults_in(rows, [(1.0, 2.0)]) == 50
    assert faults_in(rows, [(1.0, 2.0), (3.0, 4.0)]) == 80
    assert faults_in(rows, [(4.0, 5.0)]) == 0
    assert faults_in(rows, [(9.0, 10.0)]) == 0  # after the samples: nothing known, nothing counted


def test_sampler_records_the_server_tree_cumulatively(tmp_path):
    if not os.path.exists("/proc/vmstat"):
        pytest.skip("needs Linux /proc")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        path = tmp_path / "host.csv"
        with HostSampler(child.pid, path, interval_s=0.05) as s:
            time.sleep(0.6)
        rows = read_host(path)
        assert len(rows) >= 5 and s.rows
        assert any(k.startswith("majflt:") for k in rows[0])
        for key in ("t", "pgmajfault", "steal_s", "iowait_s"):
            vals = [r[key] for r in rows]
            assert vals == sorted(vals), key  # counters never go back
    finally:
        child.kill()
        child.wait()


def test_sampler_without_a_process_records_nothing(tmp_path):
    with HostSampler(None, tmp_path / "h.csv") as s:
        pass
    assert not s.available and not (tmp_path / "h.csv").exists()


def test_mlock_switch_parses_strictly():
    assert hostlock.wanted({"KUNSERVE_MLOCK": "1"}) and hostlock.wanted({"KUNSERVE_MLOCK": "on"})
    assert not hostlock.wanted({}) and not hostlock.wanted({"KUNSERVE_MLOCK": "0"})
    with pytest.raises(ValueError, match="KUNSERVE_MLOCK must be 1 or 0"):
        hostlock.wanted({"KUNSERVE_MLOCK": "maybe"})


def test_locked_process_keeps_what_it_touches_locked():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if not os.path.exists("/proc/self/status") or (soft != resource.RLIM_INFINITY and os.geteuid() != 0):
        pytest.skip("needs Linux and root or an unlimited ulimit -l")
    code = ("import re\n"
            "from vllm_kunserve.memory.hostlock import lock_process_memory\n"
            "def locked():\n"
            "    return int(re.search(r'VmLck:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
            "assert lock_process_memory() and lock_process_memory()\n"
            "before = locked()\n"
            "buf = bytearray(64 << 20)\n"          # touched pages of a new mapping: locked on fault
            "print(before, locked())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after = map(int, out.stdout.split())
    assert after - before >= 60 * 1024  # kB: the 64 MiB buffer is locked


def test_gc_pauses_time_every_collection_while_installed(monkeypatch):
    import gc

    from vllm_kunserve.gcpause import GcPauses

    p = GcPauses(min_s=0.0)
    gc.disable()                                # only the explicit collections below
    try:
        with p:
            junk = [[i] for i in range(20000)]  # something to scan
            t = time.perf_counter()
            gc.collect(2)
            gc.collect(0)
        del junk
        gc.collect(2)                           # after removal: not counted
    finally:
        gc.enable()
    assert p.count == [1, 0, 1]
    (start, secs, gen), = [x for x in p.pauses if x[2] == 2]
    assert t <= start <= time.perf_counter() and secs > 0
    v = p.view()
    assert v["collections"][2] == 1 and v["longest"][0]["seconds"] >= max(s for _, s, _ in p.pauses) - 1e-4


def test_freeze_heap_obeys_its_switch(monkeypatch):
    import gc

    from vllm_kunserve.gcpause import freeze_heap

    monkeypatch.setenv("KUNSERVE_GC_FREEZE", "0")
    before = gc.get_freeze_count()
    assert freeze_heap() == 0 and gc.get_freeze_count() == before
    monkeypatch.setenv("KUNSERVE_GC_FREEZE", "sometimes")
    with pytest.raises(ValueError, match="KUNSERVE_GC_FREEZE must be 1 or 0"):
        freeze_heap()
    monkeypatch.setenv("KUNSERVE_GC_FREEZE", "1")
    try:
        n = freeze_heap()
        assert n > 0 and n == gc.get_freeze_count()
    finally:
        gc.unfreeze()
