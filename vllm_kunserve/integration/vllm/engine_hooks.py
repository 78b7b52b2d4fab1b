"""Touchpoint: ``vllm.v1.engine.core.EngineCore`` (engine-core process).

- ``_initialize_effective_attention_block_size``: ``EngineCore.__init__`` calls it right after the
  scheduler is built (before the ready handshake reports ``num_gpu_blocks``). For an engine whose
  own config enables remap we attach the :class:`~vllm_kunserve.engine.agent.EngineAgent` (with
  the scheduler view that hides the KV blocks above the base) and start its control port.
  (``__init__`` itself cannot be wrapped: vLLM loads plugins from inside it.) vLLM 0.26-0.30 have
  no such method: there ``__init__`` calls no method of its own after building the scheduler, so
  the agent attaches when ``__init__`` assigns ``self.scheduler`` (the same point), through a data
  descriptor on the class (:class:`_AttachOnScheduler`).
- ``step`` / ``step_with_batch_queue``: run under the agent (control operations between steps, the
  control tick, step timing).
- ``collective_rpc``: names in ``ENGINE_METHODS`` are answered by the agent (they move scheduler
  and workers together); everything else goes to the workers as before. An engine without a
  ``kunserve`` key refuses every ``kunserve_*`` name as if its workers had none: vLLM mixes the
  worker extension into the worker *class* (``WorkerWrapperBase.init_worker``), so once a kunserve
  engine started in a process, the workers of every later engine there carry our methods too.
- ``shutdown``: stops the control port.

Engines without an agent pass straight through every wrapper but that refusal.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from vllm_kunserve.config import KunServeConfigError, engine_config
from vllm_kunserve.integration.vllm.base import VllmPatch
from vllm_kunserve.integration.vllm.versions import params, release

logger = logging.getLogger("vllm.kunserve")

_CORE = "vllm.v1.engine.core:EngineCore"


def agent_of(core: Any):
    return core.__dict__.get("_kunserve")


#: what a group member on CUDA says at startup (issue 38: no CUDA data path validated in vLLM yet)
CUDA_GROUP_REFUSED = (
    "kunserve drop.group_member: pipeline groups have run inside vLLM on CPU only (on CUDA the stage link "
    "ran at mechanism level and the FlashAttention glue against recorded structures, never inside vLLM); "
    "refusing to start on a CUDA platform (set drop.allow_unvalidated_cuda=true to start anyway)")


#: a group joins one worker per engine (its stage server, KV views and dropped layers are one rank's)
GROUP_TP_REFUSED = (
    "kunserve drop.group_member: a pipeline group member runs one worker (tensor_parallel_size 1); "
    "refusing to start with tensor parallelism")


def platform_device() -> str:
    """vLLM's current platform's device type (``cpu``, ``cuda``, ...); ``unknown`` if it cannot tell."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type or "unknown")
    except Exception:  # pragma: no cover - vLLM missing or its platform detection failed
        return "unknown"


def check_group_device(cfg: Any, device: str) -> None:
    """Refuse a pipeline group member on CUDA unless ``drop.allow_unvalidated_cuda`` is set."""
    if cfg.drop.group_member and device == "cuda" and not cfg.drop.allow_unvalidated_cuda:
        raise KunServeConfigError(CUDA_GROUP_REFUSED)


class EngineCorePatch(VllmPatch):
    name = "engine_core"
    summary = "attach the engine agent and its control port, run steps under it, route kunserve RPCs"
    requires = ("moves_memory",)

    def configure(self, cfg: Any, holder: Any) -> None:
        """Streaming uses forward hooks and side copies, and a pipeline group replaces dropped layers'
        forwards: both need eager execution, so no CUDA graph is captured for such an engine (a graph
        replays the kernels of the layers it captured, whatever has left since). A group member runs
        without cascade attention (vLLM's default; a peer's span carries one plan, ``attn_meta.py``),
        and refuses a CUDA platform unless told otherwise (:func:`check_group_device`)."""
        if not cfg.moves_memory:
            return
        check_group_device(cfg, platform_device())
        parallel = getattr(holder, "parallel_config", holder)
        if cfg.drop.group_member and (getattr(parallel, "tensor_parallel_size", 1) or 1) > 1:
            raise KunServeConfigError(GROUP_TP_REFUSED)
        if hasattr(holder, "enforce_eager"):  # EngineArgs: still time to switch it on
            if not holder.enforce_eager:
                logger.info("kunserve: remap and pipeline groups replace layer forwards; enabling enforce_eager "
                            "(no CUDA graphs for this engine)")
                holder.enforce_eager = True
            if cfg.drop.group_member and getattr(holder, "disable_cascade_attn", True) is False:
                logger.info("kunserve: a pipeline group member runs without cascade attention; "
                            "setting disable_cascade_attn")
                holder.disable_cascade_attn = True
            return
        model_config = getattr(holder, "model_config", None)
        if model_config is not None and not model_config.enforce_eager:
            raise KunServeConfigError(
                "kunserve remap / drop.group_member: weight streaming and pipeline groups need eager execution; "
                "start vLLM with --enforce-eager (or LLM(..., enforce_eager=True))")
        backend = getattr(getattr(holder, "attention_config", None), "backend", None)
        backend = getattr(backend, "name", backend)   # vLLM's AttentionBackendEnum, or None: vLLM's choice
        if cfg.drop.group_member and backend not in (None, "FLASH_ATTN") and platform_device() == "cuda":
            raise KunServeConfigError(
                f"kunserve drop.group_member on CUDA: a pipeline group's spans carry FlashAttention metadata only "
                f"(attn_meta.py); refusing attention backend {backend} (leave it to vLLM's choice or FLASH_ATTN)")
        if cfg.drop.group_member and getattr(model_config, "disable_cascade_attn", True) is False:
            raise KunServeConfigError(
                "kunserve drop.group_member: a pipeline group runs without cascade attention; "
                "start vLLM without --no-disable-cascade-attn")

    def patch(self) -> None:
        EngineCore = self.resolve(_CORE)

        def make_init_hook(orig):
            def _initialize_effective_attention_block_size(core, *a, **kw):
                out = orig(core, *a, **kw)
                _attach(core)
                return out
            return _initialize_effective_attention_block_size

        def make_step(orig):
            def step(core, *a, **kw):
                agent = agent_of(core)
                if agent is None:
                    return orig(core, *a, **kw)
                return agent.run_step(lambda: orig(core, *a, **kw))
            return step

        def make_rpc(orig):
            def collective_rpc(core, method, timeout=None, args=(), kwargs=None):
                from vllm_kunserve.engine.agent import ENGINE_METHODS

                agent = agent_of(core)
                if isinstance(method, str) and method.startswith("kunserve_") and agent is None \
                        and engine_config(core.vllm_config) is None:
                    raise AttributeError(f"{method}: kunserve is not enabled on this engine "
                                         "(no 'kunserve' key in its additional_config)")
                if isinstance(method, str) and method in ENGINE_METHODS:
                    if agent is None:
                        raise RuntimeError(f"{method}: kunserve remap is not enabled on this engine")
                    return [_engine_method(agent, method, args or (), kwargs or {})]
                if agent is None:
                    return orig(core, method, timeout, args, kwargs)
                with agent.lock:  # never beside a transition's worker RPCs
                    return orig(core, method, timeout, args, kwargs)
            return collective_rpc

        def make_shutdown(orig):
            def shutdown(core, *a, **kw):
                core._kunserve_stopped = True
                srv = core.__dict__.pop("_kunserve_control", None)
                if srv is not None:
                    srv.stop()
                return orig(core, *a, **kw)
            return shutdown

        hooks = [("step", make_step), ("step_with_batch_queue", make_step), ("collective_rpc", make_rpc),
                 ("shutdown", make_shutdown)]
        if release() < (0, 31):  # vLLM 0.26-0.30: no _initialize_effective_attention_block_size (0.31 added it)
            if not isinstance(EngineCore.__dict__.get("scheduler"), _AttachOnScheduler):
                EngineCore.scheduler = _AttachOnScheduler()
                self._saved.append((EngineCore, "scheduler", _AttachOnScheduler.REMOVE))
        else:
            hooks.insert(0, ("_initialize_effective_attention_block_size", make_init_hook))
        for attr, make in hooks:
            self.replace(EngineCore, attr, make, params=params(f"{_CORE}.{attr}"))

    def revert(self) -> None:
        added = [s for s in self._saved if s[2] is _AttachOnScheduler.REMOVE]
        self._saved = [s for s in self._saved if s[2] is not _AttachOnScheduler.REMOVE]
        super().revert()
        for owner, attr, _ in added:
            delattr(owner, attr)


class _AttachOnScheduler:
    """vLLM 0.26-0.30: ``EngineCore.scheduler`` as a data descriptor. ``__init__`` assigns it right
    after building the scheduler (where 0.31+ calls ``_initialize_effective_attention_block_size``);
    the first assignment attaches the agent (:func:`_attach`). Reads return the instance's value."""

    REMOVE = object()   # revert: delete the descriptor (EngineCore had no class attribute)

    def __get__(self, core: Any, owner: Any = None) -> Any:
        if core is None:
            return self
        try:
            return core.__dict__["scheduler"]
        except KeyError:
            raise AttributeError("scheduler") from None

    def __set__(self, core: Any, value: Any) -> None:
        first = "scheduler" not in core.__dict__
        core.__dict__["scheduler"] = value
        if first:
            _attach(core)


def _engine_method(agent: Any, method: str, args: tuple, kwargs: dict) -> Any:
    """``collective_rpc("kunserve_*")`` in process: the same operations as the control port."""
    op = method[len("kunserve_"):]
    if op == "state":
        with agent.lock:
            agent._publish()
            st = dict(agent.control_state())
            st["workers"] = agent._workers("kunserve_memory_state")
            return st
    if op == "remap":
        params = dict(kwargs)
        if args:
            params.setdefault("alpha", args[0])
        if len(args) > 1:
            params.setdefault("slots", args[1])
    elif op == "auto":
        params = {"enable": bool(args[0] if args else kwargs.get("enable", True))}
    elif op == "inject_fault":
        params = {"step": args[0] if args else kwargs.get("step"), **{k: v for k, v in kwargs.items() if k != "step"}}
    else:
        params = dict(kwargs)
    with agent.lock:
        return agent.call(op, params)


def _attach(core: Any) -> None:
    from vllm_kunserve.integration.vllm import metrics
    from vllm_kunserve.integration.vllm.kv_plan import base_blocks
    from vllm_kunserve.integration.vllm.scheduler_view import SchedulerView

    vc = core.vllm_config
    cfg = engine_config(vc)
    base = base_blocks(getattr(core.scheduler, "kv_cache_config", None))
    if cfg is None or not cfg.moves_memory or base is None:
        return
    from vllm_kunserve.engine.agent import EngineAgent

    label = str(getattr(vc.parallel_config, "data_parallel_rank", 0) or 0)
    view = SchedulerView(core.scheduler, base, vc.cache_config, cfg.remap.growth_tokens)

    def workers(method: str, *args, **kwargs) -> list:
        return core.model_executor.collective_rpc(method, args=args, kwargs=kwargs)

    agent = EngineAgent(cfg, view, workers, label=label, metrics=metrics.get(), wake=lambda: _wake(core),
                        info={"model": str(vc.model_config.model), "hidden_size": vc.model_config.get_hidden_size(),
                              "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens})
    core._kunserve = agent
    if hasattr(core.scheduler, "kunserve_pace"):  # the group scheduler (integration.vllm.scheduler)
        core.scheduler.kunserve_pace = agent.group_pace
        core.scheduler.kunserve_grouped = agent.is_grouped
    _start_control(core, agent, cfg)
    _idle_ticker(core, agent, cfg)


def _start_control(core: Any, agent: Any, cfg: Any) -> None:
    if not cfg.control.enable:
        return
    from vllm_kunserve.engine.control import ControlServer

    srv = ControlServer(agent, host=cfg.control.host, port=cfg.control.port, token=cfg.control.token or None)
    url = srv.start()
    core._kunserve_control = srv
    agent.info["control_url"] = url
    agent._publish()
    from vllm_kunserve.integration.vllm.endpoint import announce

    try:
        where = announce(url)   # for vllm serve's /kunserve/engine route (an attached front end finds it)
    except OSError as e:   # the route then answers 503; the engine serves as before
        where = None
        logger.warning("kunserve control port not announced: %s", e)
    logger.info("kunserve control port: %s (engine %s)%s", url, agent.label,
                f", announced in {where}" if where else "")


def _wake(core: Any) -> None:
    """Make an idle ``EngineCoreProc`` loop run once (it blocks on its input queue while idle)."""
    queue_ = getattr(core, "input_queue", None)
    if queue_ is None:
        return
    from vllm.v1.engine import EngineCoreRequestType

    queue_.put_nowait((EngineCoreRequestType.WAKEUP, None))


def _idle_ticker(core: Any, agent: Any, cfg: Any) -> None:
    """While the engine is idle and layers are streamed, tick the agent now and then (an idle
    ``EngineCoreProc`` never steps, so the revert hold time would never expire otherwise). The
    tick runs on the engine thread through ``_idle_state_callbacks``."""
    period = max(0.05, cfg.remap.revert_hold_s / 4)

    def idle_tick(c: Any) -> None:
        if c.scheduler.get_num_unfinished_requests() == 0:
            with agent.lock:
                agent.tick()
                agent._publish()

    def loop() -> None:
        while not core.__dict__.get("_kunserve_stopped"):
            threading.Event().wait(period)
            # EngineCore.__init__ creates these after the agent is attached; in-process engines
            # (no input queue) have no idle loop to wake
            callbacks = getattr(core, "_idle_state_callbacks", None)
            if callbacks is None or getattr(core, "input_queue", None) is None:
                continue
            if agent.phase != "base" and agent.auto and core.scheduler.get_num_unfinished_requests() == 0:
                callbacks.append(idle_tick)
                _wake(core)

    threading.Thread(target=loop, name="kunserve-idle", daemon=True).start()
