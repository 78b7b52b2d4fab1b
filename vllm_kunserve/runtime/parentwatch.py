"""An engine server that outlives the ``kunserve serve`` that launched it serves nobody.

The launcher starts each engine's ``vllm serve`` in a session of its own (so that stopping one
engine stops its whole process group, engine core included), which also means a front end killed
with SIGKILL leaves its engines running, each holding its cores, its memory and its port. The
launcher passes its pid in ``KUNSERVE_PARENT_PID``; in the process it launched (and only there:
the engine core and workers inherit the variable but have another parent), the plugin starts
:func:`watch_from_env`'s thread, which polls its parent pid. When the launcher is gone (the process
was re-parented), it stops the process group as the launcher's own ``stop()`` does: SIGINT to the
group (vLLM shuts its engine core down), then SIGKILL to whatever of the group is left after
``grace_s``. The watching thread is a daemon (a server stopping normally does not wait for it); the
one that stops the group is not, so the process does not finish exiting before its group has gone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger("vllm.kunserve")

ENV_PARENT = "KUNSERVE_PARENT_PID"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` after "pid (comm) ": state, ppid, pgrp, ...; None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def group_members(pgid: int, exclude: int | None = None) -> list[int]:
    """Live pids of process group ``pgid`` (from ``/proc``), zombies left out."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == exclude:
            continue
        fields = _stat(name)
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(name))
    return out


def _exits_after_us() -> set[int]:
    """Group members that exit only once this process has: multiprocessing's resource tracker, which
    this process started when it spawned a child (vLLM's engine core) and which stops when the last
    process holding its pipe, this one, has exited. Waiting for it would wait out the grace period
    (every orphaned ``vllm serve`` took its full ``grace_s`` to go)."""
    try:
        from multiprocessing import resource_tracker

        pid = resource_tracker._resource_tracker._pid
    except Exception:  # noqa: BLE001 - a private attribute: without it, wait for every member
        return set()
    return {pid} if pid else set()


def stop_group(grace_s: float, poll_s: float = 0.2) -> None:
    """SIGINT this process's group, then SIGKILL it (this process included) if, after ``grace_s``,
    this process's main thread still runs (it did not stop on SIGINT: a server still starting, say)
    or another member is left. Run from a non-daemon thread: the interpreter's exit waits for it, so
    it returns as soon as the main thread has finished and the rest of the group is gone (but for a
    member that exits after this process does: :func:`_exits_after_us`)."""
    me, pgid = os.getpid(), os.getpgrp()
    os.killpg(pgid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not threading.main_thread().is_alive() and not set(group_members(pgid, exclude=me)) - _exits_after_us():
            return
        time.sleep(poll_s)
    logger.warning("kunserve: process group %d still alive %.0f s after SIGINT; SIGKILL", pgid, grace_s)
    os.killpg(pgid, signal.SIGKILL)


def watch_parent(parent: int, interval_s: float = 1.0, grace_s: float = 30.0) -> threading.Thread | None:
    """Start the watcher when this process is ``parent``'s child; stop the group at once when
    ``parent`` is already gone (launched, then orphaned before it got here). Returns the thread,
    or None where nothing is watched (a grandchild, with its launcher alive)."""
    if os.getppid() != parent:
        if not _alive(parent):
            logger.warning("kunserve: launcher pid %d is gone; stopping this engine server", parent)
            _stopper(grace_s).start()
        return None

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        logger.warning("kunserve: launcher pid %d is gone; stopping this engine server", parent)
        _stopper(grace_s).start()

    t = threading.Thread(target=run, name="kunserve-parent-watch", daemon=True)
    t.start()
    return t


def _stopper(grace_s: float) -> threading.Thread:
    return threading.Thread(target=stop_group, args=(grace_s,), name="kunserve-orphan-stop", daemon=False)


def watch_from_env(interval_s: float = 1.0, grace_s: float = 30.0) -> threading.Thread | None:
    """:func:`watch_parent` for ``KUNSERVE_PARENT_PID``, once per process; None if unset."""
    raw = os.environ.get(ENV_PARENT, "").strip()
    if not raw:
        return None
    with _once_lock:
        if _once.get("pid") == os.getpid():
            return None
        _once["pid"] = os.getpid()
    try:
        parent = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_PARENT} must be a process id, got {raw!r}") from None
    return watch_parent(parent, interval_s, grace_s)


_once_lock = threading.Lock()
_once: dict[str, int] = {}

__all__ = ["ENV_PARENT", "group_members", "running", "stop_group", "watch_from_env", "watch_parent"]
