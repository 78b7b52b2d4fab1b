"""Touchpoint: which model runner an engine that moves memory runs (``VllmConfig.use_v2_model_runner``).

kunserve's KV allocation (``kv_alloc.py``), CPU linear weights (``cpu_linear.py``) and pipeline groups
(``pipeline.py``) wrap vLLM's V1 model runner (``GPUModelRunner`` in ``v1/worker/gpu_model_runner.py``;
the CPU runner inherits it). Since vLLM 0.25 the CUDA platform runs Model Runner V2
(``v1/worker/gpu/model_runner.py``) by default for the architectures it lists (Llama among them),
and vLLM's own switch, ``VLLM_USE_V2_MODEL_RUNNER`` (unset: vLLM decides; ``0``: V1; ``1``: V2),
is read through the ``VllmConfig.use_v2_model_runner`` property in every process (the engine
core's scheduler, the worker that builds the runner, the API server's input processor).

For an engine that moves memory (remap, or pipeline-group membership) the property answers V1, as
``VLLM_USE_V2_MODEL_RUNNER=0`` would, but for that engine's configuration only: a stock engine in
the same process keeps vLLM's choice, and no environment variable leaks into the processes vLLM
starts for a later engine. The worker logs which runner it builds (``runner_line``). An engine
that moves memory while ``VLLM_USE_V2_MODEL_RUNNER=1`` is set refuses in one line: nothing of
kunserve's memory path wraps Model Runner V2, and its KV would be planned growable but allocated
whole. On CPU, vLLM already runs V1 (V2 needs Triton): the property returns what it did.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_kunserve.config import KunServeConfigError, engine_config
from vllm_kunserve.integration.vllm.base import VllmPatch
from vllm_kunserve.integration.vllm.versions import params

logger = logging.getLogger("vllm.kunserve")

ENV = "VLLM_USE_V2_MODEL_RUNNER"

V2_REFUSED = (
    f"kunserve remap / drop.group_member run on vLLM's V1 model runner (GPUModelRunner), and {ENV}=1 asks for "
    f"Model Runner V2, which kunserve's KV allocation and pipeline groups do not wrap: refusing to start "
    f"(unset {ENV}, or set it to 0)")


def forced_v2(environ: Any = os.environ) -> bool:
    """Whether the user asked for Model Runner V2 outright: ``1`` (vLLM reads the variable as an
    integer), or ``true``, which vLLM itself would fail to read, taken as the same request."""
    v = str(environ.get(ENV, "")).strip().lower()
    return v in ("1", "true")


def runner_line(would_be_v2: bool) -> str:
    """The startup line naming the runner an engine that moves memory builds."""
    why = ("vLLM would have run Model Runner V2 here; kunserve selects V1 for this engine, as "
           f"{ENV}=0 would" if would_be_v2 else "vLLM's own choice on this platform")
    return f"kunserve: model runner V1 (GPUModelRunner / its CPU subclass) for this engine: {why}"


class _Property(property):
    """A property that can carry the patch tag (``property`` objects take no attributes)."""


class RunnerSelectionPatch(VllmPatch):
    name = "runner_select"
    summary = "engines that move memory run vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0 for them only)"
    requires = ("moves_memory",)

    def configure(self, cfg: Any, holder: Any) -> None:
        if cfg.moves_memory and forced_v2():
            raise KunServeConfigError(V2_REFUSED)

    def patch(self) -> None:
        VllmConfig = self.resolve("vllm.config.vllm:VllmConfig")
        logged: set[int] = set()

        def make(prop):
            fget = prop.fget
            self.check_params(fget, params("vllm.config.vllm:VllmConfig.use_v2_model_runner"),
                              "vllm.config.vllm.VllmConfig.use_v2_model_runner")

            def use_v2_model_runner(vllm_config):
                chosen = fget(vllm_config)
                cfg = engine_config(vllm_config)
                if cfg is None or not cfg.moves_memory:
                    return chosen
                if forced_v2():
                    raise KunServeConfigError(V2_REFUSED)
                if id(vllm_config) not in logged:
                    logged.add(id(vllm_config))
                    logger.info(runner_line(chosen))
                return False

            use_v2_model_runner.__wrapped__ = fget
            return _Property(use_v2_model_runner, doc=prop.__doc__)

        self.replace(VllmConfig, "use_v2_model_runner", make)
