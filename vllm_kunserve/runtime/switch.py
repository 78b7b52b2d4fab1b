"""An on/off host setting read from the environment (``KUNSERVE_MLOCK``, ``KUNSERVE_AMX_INIT``,
``KUNSERVE_GC_FREEZE``)."""

from __future__ import annotations

import os

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_switch(name: str, default: bool, env: dict | None = None) -> bool:
    """``name``'s value as a switch (unset or empty: ``default``), or a ValueError naming it."""
    raw = (os.environ if env is None else env).get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ON or raw in OFF:
        return raw in ON
    raise ValueError(f"{name} must be 1 or 0, got {raw!r}")
