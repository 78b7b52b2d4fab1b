"""The host sampler, the client-side stall finder, the event-loop lag watch and the memory lock
(bench/hostwatch.py, runtime/looplag.py, bench/compare.late_sends, runtime/hostlock.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import asyncio
from types import SimpleNamespace

import pytest

from vllm_kunserve.bench.compare import late_sends
from vllm_kunserve.bench.hostwatch import HostSampler, faults_in, read_host, stall_windows
from vllm_kunserve.runtime import hostlock
from vllm_kunserve.runtime.looplag import LoopLag, lag_cause

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
        assert any(k.startswith("runq:") for k in rows[0])  # each process's main thread's wait for a core
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
            "from vllm_kunserve.runtime.hostlock import lock_process_memory\n"
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

    from vllm_kunserve.runtime.gcpause import GcPauses

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

    from vllm_kunserve.runtime.gcpause import freeze_heap

    monkeypatch.setenv("KUNSERVE_GC_FREEZE", "0")
    before = gc.get_freeze_count()
    assert freeze_heap() == 0 and gc.get_freeze_count() == before
    monkeypatch.setenv("KUNSERVE_GC_FREEZE", "sometimes")
    with pytest.raises(ValueError, match="KUNSERVE_GC_FREEZE must be 1 or 0"):
        freeze_heap()
    monkeypatch.setenv("KUNSERVE_GC_FREEZE", "1")
    try:
        n = freeze_heap()
        # the frozen count it took (other threads of a test worker may move a few objects since)
        assert n > 0 and abs(gc.get_freeze_count() - n) <= max(10, n // 1000)
    finally:
        gc.unfreeze()


def _watch(block) -> dict:
    """Run a LoopLag while a callback of the loop calls ``block`` once."""
    async def main():
        lag = LoopLag(interval_s=0.01, min_s=0.05).start()
        await asyncio.sleep(0.05)
        asyncio.get_running_loop().call_soon(block)
        await asyncio.sleep(0.1)
        await lag.stop()
        return lag.view()
    return asyncio.run(main())


def test_loop_lag_tells_a_busy_loop_from_a_blocked_one():
    def spin():   # 0.3 s of this thread's own CPU time: busy however loaded the machine is
        t = time.thread_time()
        while time.thread_time() - t < 0.3:
            pass
    busy = _watch(spin)
    blocked = _watch(lambda: time.sleep(0.3))
    for v in (busy, blocked):
        assert v["ticks"] >= 5 and v["late"] >= 1
        assert v["longest"][0]["late_s"] >= 0.25  # the 0.3 s callback held the loop
    b, s = busy["longest"][0], blocked["longest"][0]
    # the totals add up the late wake-ups' running and waiting times
    assert busy["late_cpu_s"] >= b["cpu_s"] - 0.002 and blocked["late_cpu_s"] < 0.05   # (view rounds to 1 ms)
    # spinning, the thread was on a core or waiting for one (a loaded machine shares the core);
    # sleeping, it was neither for most of the 0.3 s
    assert b["cpu_s"] >= 0.05 and s["cpu_s"] < 0.05
    assert lag_cause(b) in ("busy", "no core", "mixed")
    if os.path.exists("/proc/thread-self/schedstat"):
        assert b["runq_s"] is not None and b["cpu_s"] + b["runq_s"] >= 0.2
        assert s["late_s"] - s["cpu_s"] - s["runq_s"] >= 0.2 and lag_cause(s) == "blocked"


def test_lag_cause_reads_the_larger_share():
    assert lag_cause({"late_s": 1.0, "cpu_s": 0.9, "runq_s": 0.05}) == "busy"
    assert lag_cause({"late_s": 1.0, "cpu_s": 0.1, "runq_s": 0.8}) == "no core"
    assert lag_cause({"late_s": 1.0, "cpu_s": 0.1, "runq_s": 0.1}) == "blocked"
    assert lag_cause({"late_s": 1.0, "cpu_s": 0.4, "runq_s": 0.4}) == "mixed"
    assert lag_cause({"late_s": 1.0, "cpu_s": 0.1, "runq_s": None}) == "mixed"  # no schedstat: unknown


def test_late_sends_are_attributed_to_the_loop_wake_ups_they_overlap():
    t0 = 100.0
    results = [SimpleNamespace(idx=0, arrival_s=1.0, send_s=1.001),   # on time
               SimpleNamespace(idx=1, arrival_s=2.0, send_s=2.5),     # late, loop waited for a core
               SimpleNamespace(idx=2, arrival_s=5.0, send_s=5.2),     # late, no late wake-up seen
               SimpleNamespace(idx=3, arrival_s=7.0, send_s=float("nan"))]  # never sent
    loop = {"longest": [{"start_perf_s": t0 + 2.01, "late_s": 0.48, "cpu_s": 0.01, "runq_s": 0.45},
                        {"start_perf_s": t0 + 3.5, "late_s": 0.2, "cpu_s": 0.2, "runq_s": 0.0}]}
    got = late_sends(results, {"replay_t0_perf": t0, "client_loop": loop})
    assert [r["idx"] for r in got] == [1, 2]
    assert got[0]["cause"] == "no core" and got[0]["runq_s"] == pytest.approx(0.45)
    assert got[1]["cause"] == "unseen" and got[1]["lag_s"] == pytest.approx(0.2)


def test_client_sched_runs_the_block_real_time_and_restores_or_says_why_not():
    from vllm_kunserve.bench.runner import client_sched

    before = os.sched_getscheduler(0)
    out: dict = {}
    with client_sched(False, out):
        assert os.sched_getscheduler(0) == before
    assert out == {"realtime_asked": False, "realtime": False}
    out = {}
    with client_sched(True, out):
        inside = os.sched_getscheduler(0)
        child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                               capture_output=True, text=True, check=True)
    assert os.sched_getscheduler(0) == before  # restored
    if out["realtime"]:
        assert inside & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO
        assert int(child.stdout) == os.SCHED_OTHER  # nothing it starts inherits the priority
    else:  # no root / CAP_SYS_NICE: normal priority, and the reason recorded
        assert inside == before and out["realtime_error"]
