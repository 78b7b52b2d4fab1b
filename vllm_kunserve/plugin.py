"""The ``vllm.general_plugins`` entry point, and per-engine activation.

vLLM calls :func:`register` with no arguments, once per process. It cannot tell which engine is
being built, so register() decides nothing from the engine config itself. Instead:

* In a process that builds engines (the ``LLM`` process, ``vllm serve``'s API server), register()
  wraps one function, ``EngineArgs.create_engine_config`` (the *activation gate*): every engine's
  configuration passes through it explicitly. For an engine without a ``kunserve`` key the gate
  returns vLLM's result untouched: no kunserve patch is applied and the integration package is not
  imported. For an engine with one, it validates the options (a bad key stops the engine at
  startup with a message naming it), applies the touchpoints this engine needs, lets them adjust
  this engine's arguments and config, and exports the touchpoint names to the processes vLLM starts
  next (``KUNSERVE_PATCHES``), whose register() applies them before building anything.
* The export describes exactly the engine whose configuration passed the gate last, i.e. the one
  whose processes vLLM starts next: a kunserve engine replaces it with its own touchpoints, a stock
  engine removes it. Otherwise a stock engine built after a kunserve engine in the same process
  would inherit the variables, and its engine-core and worker processes would apply touchpoints
  (and announce kunserve) although their engine has no ``kunserve`` key.
* Every touchpoint reads the configuration of the engine it is serving from the objects vLLM hands
  it (``vllm_config.additional_config``), never from process-wide state, so two engines with
  different configurations in one process each behave as configured; an engine without a
  ``kunserve`` key passes through every touchpoint unchanged.

Each process logs once::

    kunserve active: <features> (vllm <version>, patches: <list>)
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Any

from vllm_kunserve.config import KunServeConfig, config_from_additional, parse_config
from vllm_kunserve.runtime.amx import init_amx_if_present
from vllm_kunserve.runtime.hostlock import lock_if_wanted
from vllm_kunserve.runtime.parentwatch import watch_from_env

logger = logging.getLogger("vllm.kunserve")

#: touchpoints exported to the engine-core and worker processes vLLM starts after the gate ran
ENV_PATCHES = "KUNSERVE_PATCHES"
ENV_FEATURES = "KUNSERVE_FEATURES"
#: vLLM's shared-memory queue readers sleep on the writer's signal instead of spinning (integration/vllm/shm_wait.py)
ENV_SHM_SPIN = "KUNSERVE_SHM_WAIT_MS"

_lock = threading.Lock()
_state: dict[str, Any] = {"patches": [], "logged": False, "gate": None}


def register() -> None:
    """Entry point: install the activation gate; apply touchpoints an engine-building parent
    process exported (engine-core and worker processes)."""
    with _lock:
        if _state["gate"] is None:
            _install_gate()
    lock_if_wanted()  # KUNSERVE_MLOCK=1: this vLLM process's pages stay in RAM (runtime/hostlock.py)
    init_amx_if_present()  # vLLM-CPU's bf16 AMX attention faults without the tile state (runtime/amx.py)
    watch_from_env()  # launched by kunserve serve: stop when the launcher is gone (runtime/parentwatch.py)
    if os.environ.get(ENV_SHM_SPIN, "").strip():  # a host setting, for every engine (shm_wait.py)
        from vllm_kunserve.integration.vllm.shm_wait import apply_from_env

        apply_from_env()
    names = [n for n in os.environ.get(ENV_PATCHES, "").split(",") if n]
    if names:
        _apply(names, os.environ.get(ENV_FEATURES, ""))


def _install_gate() -> None:
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # pragma: no cover - vLLM missing
        _state["gate"] = False
        return
    orig = EngineArgs.create_engine_config
    if getattr(orig, "__kunserve_gate__", False):
        _state["gate"] = orig
        return

    def create_engine_config(self, *args, **kwargs):
        cfg = config_from_additional(getattr(self, "additional_config", None))  # raises on bad options
        _name_announce(cfg)
        if cfg is None:
            _export([], "")  # this engine's processes are stock, whatever engines came before
            return orig(self, *args, **kwargs)
        patches = activate(cfg)
        for p in patches:
            p.configure(cfg, self)
        vllm_config = orig(self, *args, **kwargs)
        for p in patches:
            p.configure(cfg, vllm_config)
        return vllm_config

    create_engine_config.__kunserve_gate__ = True
    create_engine_config.__wrapped__ = orig
    EngineArgs.create_engine_config = create_engine_config
    _state["gate"] = create_engine_config


def _name_announce(cfg: KunServeConfig | None) -> None:
    """Where this engine's core announces its control port to the API server's ``/kunserve/engine``
    route (``integration/vllm/endpoint.py``): a fresh file per engine built in this process, inherited
    by the engine-core process vLLM starts next. An engine that opens no control port (stock, or one
    that moves no memory, or ``control.enable`` off: ``engine_hooks._attach`` / ``_start_control``) gets
    none, so the route answers 404 at once instead of 503 for ever."""
    import tempfile
    import uuid

    from vllm_kunserve.engine.control import ANNOUNCE_ENV

    if cfg is None or not (cfg.moves_memory and cfg.control.enable):
        os.environ.pop(ANNOUNCE_ENV, None)
        return
    os.environ[ANNOUNCE_ENV] = os.path.join(tempfile.gettempdir(),
                                            f"kunserve-control-{os.getpid()}-{uuid.uuid4().hex[:8]}.json")


def activate(cfg: KunServeConfig | dict | None = None) -> list:
    """Apply the touchpoints ``cfg`` needs in this process (idempotent) and export exactly them to
    the processes vLLM starts next (this engine's). Returns the patch instances that adjust an
    engine's config."""
    if cfg is None or isinstance(cfg, dict):
        cfg = parse_config(cfg or {})
    from vllm_kunserve.integration.vllm import PATCH_CLASSES, instances

    names = [c.name for c in PATCH_CLASSES if c().wanted(cfg)]
    features = ", ".join(cfg.features())
    _apply(names, features)
    _export(names, features)
    return [p for p in instances() if p.name in names]


def _export(names: list[str], features: str) -> None:
    """What the processes vLLM starts next apply: this engine's touchpoints (none: unset)."""
    if names:
        os.environ[ENV_PATCHES] = ",".join(names)
        os.environ[ENV_FEATURES] = features
    else:
        os.environ.pop(ENV_PATCHES, None)
        os.environ.pop(ENV_FEATURES, None)


def _apply(names: list[str], features: str) -> None:
    from vllm_kunserve.integration.vllm import apply_named

    with _lock:
        _state["patches"] = apply_named(names)
        if not _state["logged"]:
            _state["logged"] = True
            _log_banner(features, _state["patches"])


def _log_banner(features: str, patches: list[str]) -> None:
    from vllm_kunserve.integration.vllm.versions import vllm_version

    msg = f"kunserve active: {features} (vllm {vllm_version()}, patches: {', '.join(patches) or 'none'})"
    # "vllm.kunserve" inherits vLLM's handler (with its process prefix) once vLLM configured
    # logging; in the main process the plugin loads before that, so write the line ourselves.
    if any(lg.handlers for lg in (logging.getLogger("vllm"), logging.getLogger())):
        logger.info(msg)
    else:
        import multiprocessing

        print(f"({multiprocessing.current_process().name} pid={os.getpid()}) INFO kunserve: {msg}",
              file=sys.stderr, flush=True)
    if os.environ.get("KUNSERVE_BANNER_FILE"):  # test hook: one line per process
        with open(os.environ["KUNSERVE_BANNER_FILE"], "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {json.dumps(msg)[1:-1]}\n")


def applied_patches() -> list[str]:
    return list(_state["patches"])
