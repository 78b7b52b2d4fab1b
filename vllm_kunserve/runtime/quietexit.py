"""Leave the interpreter without its teardown, once everything the process owns is stopped.

Triton's compiled extension (nanobind) prints some 100 ``nanobind: leaked ...`` lines while the
interpreter tears down, after whatever the process printed last: pytest's summary (``.ci/run``
promises it as the last line) or ``make demo``'s results. The lines report objects freed by the
exit itself, nothing a user can act on. :func:`quiet_exit` flushes the standard streams and ends
the process with ``os._exit``, skipping that teardown (and the ``atexit`` handlers: call it only
after every engine, server and file the process owns is closed). ``KUNSERVE_QUIET_EXIT=0`` keeps
the ordinary exit (to see the lines, or an atexit handler's work).
"""

from __future__ import annotations

import os
import sys

ENV = "KUNSERVE_QUIET_EXIT"


def wanted(env: dict | None = None) -> bool:
    return (os.environ if env is None else env).get(ENV, "1") != "0"


def quiet_exit(status: int) -> None:
    """Flush stdout and stderr, then end the process with ``status`` (no interpreter teardown)."""
    if not wanted():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(int(status))
