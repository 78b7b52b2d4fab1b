"""Systems that ``kunserve compare`` runs side by side, and the launchers that start them.

A :class:`SystemSpec` says *what* to run (engine arguments, ``additional_config``, KV capacity
multiplier, number of instances); a launcher kind says *how* to start it. Today there is one kind,
``vllm-serve`` (one ``vllm serve`` process). A multi-instance ``kunserve serve`` cluster becomes one
more entry in :data:`LAUNCHERS` building its own command line from the same spec
(``num_instances`` > 1); the command line, process handling, health wait, log capture and
shutdown are :mod:`vllm_kunserve.cluster.fleet.launcher`'s.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from vllm_kunserve.cluster.fleet.launcher import LaunchPlan, cluster_argv, cpu_env, serve_argv
from vllm_kunserve.config import CONFIG_KEY, parse_config


@dataclass(frozen=True)
class CommonArgs:
    """What every system of one comparison shares."""

    model: str
    served_name: str = "model"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int | None = None  # base KV capacity (per instance); None: vLLM's own sizing
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    extra_args: tuple[str, ...] = ()  # passed to every system's engine
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class SystemSpec:
    name: str
    launcher: str = "vllm-serve"
    engine_args: tuple[str, ...] = ()
    additional_config: dict[str, Any] | None = None
    kv_multiplier: float = 1.0
    num_instances: int = 1
    env: tuple[tuple[str, str], ...] = ()
    description: str = ""
    engine_extra: tuple[str, ...] = ()  # given to each of its engines (e.g. a batch cap), after the common ones

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"system {self.name!r}: unknown launcher {self.launcher!r}; "
                             f"known: {', '.join(LAUNCHERS)}")
        if not self.kv_multiplier > 0:
            raise ValueError(f"system {self.name!r}: KV multiplier must be > 0, got {self.kv_multiplier}")
        if self.num_instances < 1:
            raise ValueError(f"system {self.name!r}: number of instances must be >= 1")
        if self.additional_config and CONFIG_KEY in self.additional_config:
            parse_config(self.additional_config[CONFIG_KEY])  # fail before starting anything

    def kv_bytes(self, common: CommonArgs) -> int | None:
        if common.kv_cache_bytes is None:
            return None
        return int(common.kv_cache_bytes * self.kv_multiplier)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "launcher": self.launcher, "engine_args": list(self.engine_args),
                "additional_config": self.additional_config, "kv_multiplier": self.kv_multiplier,
                "num_instances": self.num_instances, "env": dict(self.env), "description": self.description,
                "engine_extra": list(self.engine_extra)}


def builtin_systems(kunserve_config: dict[str, Any] | None = None, oracle_kv_multiplier: float = 10.0,
                    instances: int = 1, dispatch: str | None = None, tuned_max_num_seqs: int | None = None,
                    oracle_equal_kv_multiplier: float | None = None) -> dict[str, SystemSpec]:
    """Stock vLLM, kunserve and the oracle; with ``instances`` > 1 each is a ``kunserve serve``
    cluster of that many engines behind the same front end (stock engines for vllm and oracle), and
    ``static`` and ``vllm-router`` / ``vllm-router-rr`` (the same stock engines behind vllm-router,
    its default policy and round robin) join them. ``tuned_max_num_seqs`` adds ``vllm-tuned`` (stock
    with that batch cap per engine), ``oracle_equal_kv_multiplier`` adds ``oracle-equal`` (stock
    with the KV a kunserve group reaches: the same memory, no pipeline)."""
    fleet = {} if instances == 1 and dispatch is None else {
        "launcher": "kunserve-serve", "num_instances": instances,
        "engine_args": ("--dispatch", dispatch) if dispatch else ()}
    n = f"{instances} engines behind kunserve serve: " if fleet else ""
    return {
        "vllm": SystemSpec("vllm", description=n + "stock vLLM; the plugin is installed but inert (no kunserve key)",
                           **fleet),
        "kunserve": SystemSpec("kunserve", additional_config={CONFIG_KEY: dict(kunserve_config or {})},
                               description=n + "vLLM with the kunserve plugin enabled", **fleet),
        "oracle": SystemSpec("oracle", kv_multiplier=oracle_kv_multiplier,
                             description=n + f"stock vLLM with {oracle_kv_multiplier:g}x KV capacity (memory never "
                                             "overloads)", **fleet),
        **({"static": SystemSpec("static", additional_config={CONFIG_KEY: merge_sections(kunserve_config, {"drop": {"static_group": True}})},
                                 description=n + "kunserve with one pipeline group of all engines from the start "
                                                 "(static pipeline parallelism holding the freed KV: an "
                                                 "alternative configuration without transition cost, not a "
                                                 "bound: a dynamic drop can beat it)", **fleet)}
           if instances > 1 else {}),
        **({"vllm-router": SystemSpec("vllm-router", launcher="vllm-router", num_instances=instances,
                                      description=f"{instances} stock `vllm serve` engines behind vllm-router "
                                                  "(its default policy, cache_aware)"),
            "vllm-router-rr": SystemSpec("vllm-router-rr", launcher="vllm-router", num_instances=instances,
                                         engine_args=("--policy", "round_robin"),
                                         description=f"{instances} stock `vllm serve` engines behind vllm-router "
                                                     "(round_robin)")}
           if instances > 1 else {}),
        **({"vllm-tuned": SystemSpec("vllm-tuned", engine_extra=("--max-num-seqs", str(tuned_max_num_seqs)),
                                     description=n + f"stock vLLM with the batch cap --max-num-seqs "
                                                     f"{tuned_max_num_seqs} per engine", **fleet)}
           if tuned_max_num_seqs else {}),
        **({"oracle-equal": SystemSpec("oracle-equal", kv_multiplier=oracle_equal_kv_multiplier,
                                       description=n + f"stock vLLM with {oracle_equal_kv_multiplier:g}x KV "
                                                       "capacity: the KV a kunserve group reaches, without the "
                                                       "pipeline", **fleet)}
           if oracle_equal_kv_multiplier else {}),
    }


def variant_systems(items: list[str], kunserve_config: dict[str, Any] | None,
                    taken: dict[str, SystemSpec]) -> dict[str, SystemSpec]:
    """``NAME=JSON`` items: kunserve systems whose config is ``kunserve_config`` with each JSON
    section's keys merged over it (ablations); validated before anything starts."""
    base = taken["kunserve"]
    out: dict[str, SystemSpec] = {}
    for item in items:
        name, over = parse_variant(item)
        if name in taken or name in out:
            raise ValueError(f"--variant {name!r}: that system name is taken")
        out[name] = SystemSpec(name, launcher=base.launcher, engine_args=base.engine_args,
                               additional_config={CONFIG_KEY: merge_sections(kunserve_config, over)},
                               num_instances=base.num_instances,
                               description=f"kunserve with {json.dumps(over, sort_keys=True)}")
    return out


DERIVE_KEYS = {"from", "serve_args", "engine_args", "description"}


def derived_systems(items: list[str], taken: dict[str, SystemSpec]) -> dict[str, SystemSpec]:
    """``NAME=JSON`` items (``--derive``): a system made from another (``"from"``) with more ``kunserve
    serve`` arguments (``"serve_args"``: systems behind kunserve serve only) and more arguments for each
    of its engines (``"engine_args"``), e.g. stock engines with vLLM's ``--max-num-queued-reqs`` or a
    front end with ``--admission memory``; validated before anything starts."""
    out: dict[str, SystemSpec] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--derive {item!r}: expected NAME=JSON with NAME of letters, digits, - or _")
        if name in taken or name in out:
            raise ValueError(f"--derive {name!r}: that system name is taken")
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--derive {name}: not valid JSON ({e})") from None
        if not isinstance(d, dict) or set(d) - DERIVE_KEYS or "from" not in d:
            raise ValueError(f"--derive {name}: expected an object with \"from\" and any of "
                             f"{', '.join(sorted(DERIVE_KEYS - {'from'}))}, e.g. "
                             '{"from": "vllm", "serve_args": ["--admission", "memory"]}')
        base = {**taken, **out}.get(d["from"])
        if base is None:
            raise ValueError(f"--derive {name}: no system {d['from']!r} to derive from; known: "
                             f"{', '.join(sorted({**taken, **out}))}")
        serve, engine = d.get("serve_args", []), d.get("engine_args", [])
        if not all(isinstance(x, list) and all(isinstance(a, str) for a in x) for x in (serve, engine)):
            raise ValueError(f"--derive {name}: serve_args and engine_args are lists of strings")
        if serve and base.launcher != "kunserve-serve":
            raise ValueError(f"--derive {name}: serve_args need a system behind kunserve serve; {base.name!r} is "
                             f"launched by {base.launcher}")
        out[name] = SystemSpec(name, launcher=base.launcher, engine_args=base.engine_args + tuple(serve),
                               additional_config=base.additional_config, kv_multiplier=base.kv_multiplier,
                               num_instances=base.num_instances, env=base.env,
                               engine_extra=base.engine_extra + tuple(engine),
                               description=str(d.get("description") or
                                               f"{base.name} with {' '.join(serve + engine)}"))
    return out


def parse_variant(item: str) -> tuple[str, dict[str, dict]]:
    """One ``--variant NAME=JSON``: its name and its config sections, or a ValueError saying what is wrong."""
    name, sep, raw = item.partition("=")
    name = name.strip()
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--variant {item!r}: expected NAME=JSON with NAME of letters, digits, - or _")
    try:
        over = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"--variant {name}: not valid JSON ({e})") from None
    if not isinstance(over, dict) or not all(isinstance(v, dict) for v in over.values()):
        raise ValueError(f"--variant {name}: expected an object of config sections, e.g. "
                         '{"drop": {"transition": "reprefill"}}')
    return name, over


def merge_sections(kunserve_config: dict[str, Any] | None, over: dict[str, dict]) -> dict[str, Any]:
    """A copy of ``kunserve_config`` with each section of ``over`` merged key by key over its own."""
    ks = {k: dict(v) if isinstance(v, dict) else v for k, v in (kunserve_config or {}).items()}
    for sec, kv in over.items():
        ks[sec] = {**ks.get(sec, {}), **kv}
    return ks


def variant_configs(items: list[str], kunserve_config: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """A run's ``--variant NAME=JSON`` items: NAME -> the kunserve config that variant ran (the
    simulators' replays of a run)."""
    return {name: merge_sections(kunserve_config, over) for name, over in map(parse_variant, items)}


def select_systems(names: str, available: dict[str, SystemSpec]) -> list[SystemSpec]:
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    if not chosen:
        raise ValueError("--systems is empty")
    unknown = [n for n in chosen if n not in available]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(available)}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"--systems lists a system twice: {names}")
    return [available[n] for n in chosen]


# ---------------------------------------------------------------------------------- launchers
def _engine_args(spec: SystemSpec, common: CommonArgs) -> list[str]:
    args = ["--served-model-name", common.served_name, "--dtype", common.dtype,
            "--block-size", str(common.block_size), "--disable-uvicorn-access-log"]
    kv = spec.kv_bytes(common)
    if kv is not None:
        args += ["--kv-cache-memory-bytes", str(kv)]
    if common.max_model_len:
        args += ["--max-model-len", str(common.max_model_len)]
    if common.max_num_seqs:
        args += ["--max-num-seqs", str(common.max_num_seqs)]
    return [*args, *common.extra_args, *spec.engine_extra]


def _env(spec: SystemSpec, common: CommonArgs) -> dict[str, str]:
    return {**cpu_env(), **dict(common.env), **dict(spec.env)}


def vllm_serve_plan(spec: SystemSpec, common: CommonArgs, host: str, port: int) -> LaunchPlan:
    if spec.num_instances != 1:
        raise ValueError(f"system {spec.name!r}: the vllm-serve launcher runs one instance "
                         f"(num_instances={spec.num_instances}); use the kunserve-serve launcher")
    argv = serve_argv(common.model, host, port, [*_engine_args(spec, common), *spec.engine_args],
                      spec.additional_config)
    env = _env(spec, common)
    kv = spec.kv_bytes(common)
    if "PROMETHEUS_MULTIPROC_DIR" not in env:
        # a fresh directory per server: the engine core's kunserve:* gauges then reach /metrics
        env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kunserve-prom-")
    # VLLM_CPU_KVCACHE_SPACE overrides --kv-cache-memory-bytes on CPU: drop it so capacity is ours
    return LaunchPlan(argv, env, unset_env=("VLLM_CPU_KVCACHE_SPACE",) if kv is not None else ())


def kunserve_serve_plan(spec: SystemSpec, common: CommonArgs, host: str, port: int) -> LaunchPlan:
    """``kunserve serve`` with ``num_instances`` engines; ``spec.engine_args`` are front-end options
    (e.g. ``--dispatch``), the common arguments go to every engine. The fleet gives each engine its
    own Prometheus directory and drops ``VLLM_CPU_KVCACHE_SPACE`` where the KV bytes are set."""
    kunserve = (spec.additional_config or {}).get(CONFIG_KEY)
    argv = cluster_argv(common.model, host, port, spec.num_instances, _engine_args(spec, common), kunserve,
                        extra=spec.engine_args)
    kv = spec.kv_bytes(common)
    return LaunchPlan(argv, _env(spec, common), unset_env=("VLLM_CPU_KVCACHE_SPACE",) if kv is not None else ())


def vllm_router_plan(spec: SystemSpec, common: CommonArgs, host: str, port: int) -> LaunchPlan:
    """``num_instances`` stock ``vllm serve`` engines behind vllm-router (``bench/router_fleet.py``);
    ``spec.engine_args`` are its options (``--policy``), the common arguments go to every engine."""
    argv = [sys.executable, "-m", "vllm_kunserve.bench.router_fleet", common.model, "--instances",
            str(spec.num_instances), "--host", host, "--port", str(port), *spec.engine_args,
            "--", *_engine_args(spec, common)]
    kv = spec.kv_bytes(common)
    return LaunchPlan(argv, _env(spec, common), unset_env=("VLLM_CPU_KVCACHE_SPACE",) if kv is not None else ())


LAUNCHERS: dict[str, Callable[[SystemSpec, CommonArgs, str, int], LaunchPlan]] = {
    "vllm-serve": vllm_serve_plan,
    "kunserve-serve": kunserve_serve_plan,
    "vllm-router": vllm_router_plan,
}
