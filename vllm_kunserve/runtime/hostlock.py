"""Keep a process's pages in RAM: ``mlockall`` so the host cannot reclaim them behind its back.

A serving process that goes quiet in part of its memory (code paths run once a minute, a library's
rarely used pages, the KV blocks of an idle engine) can lose those pages to host reclaim: memory
pressure or a proactive scheme such as DAMON's ``pageout`` (on by default on some cloud VMs). The
next touch is a major fault read from disk, and every stream of the engine waits for it. Locking
the process's memory (llama.cpp's ``--mlock``) makes those pages unevictable. ``MCL_ONFAULT`` locks
pages as they are touched instead of populating every reserved mapping up front, so a process that
reserves far more address space than it uses does not balloon.

``KUNSERVE_MLOCK=1`` asks for it: the plugin applies it in every vLLM process it loads in (API
server, engine core, workers), ``kunserve serve`` in the front end and the benchmarks in the replay
client. It needs ``CAP_IPC_LOCK`` or a large enough ``ulimit -l``; where the kernel refuses, the
process runs unlocked and says why (a lock is a latency aid, never a reason not to serve).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from vllm_kunserve.runtime.switch import env_switch

logger = logging.getLogger(__name__)

ENV = "KUNSERVE_MLOCK"
MCL_CURRENT, MCL_FUTURE, MCL_ONFAULT = 1, 2, 4  # <sys/mman.h> on Linux
_done: dict[int, bool] = {}


def wanted(env: dict | None = None) -> bool:
    return env_switch(ENV, False, env)


def lock_process_memory() -> bool:
    """``mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT)`` once per process; True when locked."""
    pid = os.getpid()
    if pid in _done:
        return _done[pid]
    ok = False
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
            # MCL_FUTURE under a finite limit would make later allocations fail: refuse instead
            logger.warning("kunserve: not locking memory: ulimit -l is %d bytes (needs unlimited or root)", soft)
            _done[pid] = False
            return False
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT) == 0:
            ok = True
        else:
            err = ctypes.get_errno()
            logger.warning("kunserve: mlockall failed (%s); this process runs with reclaimable memory",
                           os.strerror(err))
    except (OSError, AttributeError) as e:  # no libc / no mlockall (not Linux)
        logger.warning("kunserve: mlockall unavailable here (%s)", e)
    _done[pid] = ok
    return ok


def lock_if_wanted() -> bool:
    return lock_process_memory() if wanted() else False


__all__ = ["ENV", "lock_if_wanted", "lock_process_memory", "wanted"]
