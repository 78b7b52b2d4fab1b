"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` with no arguments, once per process, from a few known places: the
engine arguments (``EngineArgs.__post_init__``, main process), the engine core
(``EngineCore.__init__``) and the worker (``WorkerWrapperBase.init_worker``), plus places that
carry no engine config (CLI parser construction, the model-registry subprocess). Each of the
engine-bearing callers holds the configuration in a local variable, so :func:`register` reads the
caller's ``additional_config`` from there (:func:`find_additional_config`).

The plugin stays **inert** unless that ``additional_config`` holds a ``kunserve`` key: nothing is
imported from the integration package and nothing is patched. When enabled it validates the
options (a bad key stops the engine at startup with a message naming it), applies the
version-gated patch classes and logs once per process::

    kunserve active: <features> (vllm <version>, patches: <list>)

Programs that build engines in-process after vLLM already loaded plugins without a kunserve
config (vLLM loads general plugins once per process) can call :func:`activate` explicitly.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from vllm_kunserve.config import KunServeConfig, config_from_additional

logger = logging.getLogger("vllm.kunserve")

_lock = threading.Lock()
_state: dict[str, Any] = {"config": None, "patches": None, "logged": False}

#: how far up the stack register() looks for the caller's engine configuration
_MAX_FRAMES = 8


def _additional_from_obj(obj: Any) -> Any:
    """additional_config from a VllmConfig, EngineArgs or a worker wrapper holding one."""
    if obj is None:
        return None
    if hasattr(obj, "additional_config") and hasattr(obj, "model"):  # EngineArgs / VllmConfig-like
        return obj.additional_config
    inner = getattr(obj, "vllm_config", None)
    if inner is not None and hasattr(inner, "additional_config"):
        return inner.additional_config
    return None


def find_additional_config(start_depth: int = 2) -> tuple[bool, Any, Any]:
    """Look at the callers of ``load_general_plugins`` for the engine being built.

    Returns ``(found, additional_config, holder)`` where ``holder`` is the ``VllmConfig`` or
    ``EngineArgs`` being built; ``found`` is False when the caller carries no engine configuration
    (CLI parser, registry subprocess).
    """
    try:
        frame = sys._getframe(start_depth)
    except ValueError:
        return False, None, None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        loc = frame.f_locals
        cfg = loc.get("vllm_config")
        if cfg is not None and hasattr(cfg, "additional_config"):
            return True, cfg.additional_config, cfg
        self_obj = loc.get("self")
        if self_obj is not None and type(self_obj).__name__ in ("EngineArgs", "AsyncEngineArgs"):
            return True, _additional_from_obj(self_obj), self_obj
        frame = frame.f_back
    return False, None, None


def register() -> None:
    """Entry point: inert unless the engine being built asks for kunserve."""
    found, additional, holder = find_additional_config()
    if not found:
        return
    cfg = config_from_additional(additional)  # raises KunServeConfigError on bad options
    if cfg is None:
        return
    activate(cfg, holder)


def activate(cfg: KunServeConfig | dict | None = None, holder: Any = None) -> list[str]:
    """Enable kunserve in this process: apply the supported patches once and log the banner.

    ``holder`` is the engine configuration being built (``EngineArgs`` or ``VllmConfig``), if any.
    Idempotent. Returns the names of the applied patches.
    """
    if cfg is None or isinstance(cfg, dict):
        from vllm_kunserve.config import parse_config

        cfg = parse_config(cfg or {})
    with _lock:
        if _state["patches"] is None:
            from vllm_kunserve.integration.vllm import apply_all

            _state["patches"] = apply_all(cfg)
        _state["config"] = cfg
        if holder is not None:
            from vllm_kunserve.integration.vllm import on_engine_config

            on_engine_config(cfg, holder)
        if not _state["logged"]:
            _state["logged"] = True
            _log_banner(cfg, _state["patches"])
    return list(_state["patches"])


def _log_banner(cfg: KunServeConfig, patches: list[str]) -> None:
    from vllm_kunserve.integration.vllm.base import vllm_version

    msg = (f"kunserve active: {', '.join(cfg.features())} "
           f"(vllm {vllm_version()}, patches: {', '.join(patches) or 'none'})")
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
            f.write(f"{os.getpid()} {msg}\n")


def active_config() -> KunServeConfig | None:
    """The config this process was activated with, or None when the plugin is inert here."""
    return _state["config"]


def applied_patches() -> list[str]:
    return list(_state["patches"] or [])
