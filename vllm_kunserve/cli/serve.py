"""``kunserve serve MODEL --instances N``: N vLLM engines behind one OpenAI-compatible endpoint.

    kunserve serve MODEL [--instances N] [--backend local|ray] [--host 127.0.0.1] [--port 8000]
                         [--dispatch POLICY]
                         [--kunserve-config JSON|FILE] [any vLLM engine argument ...]
    kunserve serve MODEL --engine-url URL [--engine-url URL ...] [--engine-control-url URL ...] [--reuse-port]
    kunserve serve MODEL_A MODEL_B ... | FLEET.json [--kunserve-config JSON|FILE] [...]

With ``--engine-url`` kunserve starts no engine: it fronts engines started elsewhere (a
deployment's pods), watches their ``/health``, and a dead one rejoins when it answers again; it
cannot kill or restart them. MODEL is what they serve (the front end's tokenizer). With
``--reuse-port`` several such front ends over the same engines listen on one port, and the kernel
spreads the connections over them, as replicas of a router are run: on cores the engines keep busy
one front end's single event loop reads its streams late (``docs/benchmarks/cluster.md``).

Everything this command does not know is a vLLM engine argument, checked by vLLM's own ``vllm
serve`` parser before any engine starts and passed to every engine. With ``--kunserve-config``
the engines run the kunserve plugin (each with a control port the front end polls); without it
they are stock vLLM engines (the baseline), still behind the same front end, monitor and dispatch.
Several models (repeated, or a fleet file: docs/multi_model.md) run a front end each behind the one
endpoint, routed by the request's ``model``; with ``--kunserve-config`` an idle model lends its weight
memory to the busy ones' KV. Ctrl-C stops the front end and every engine. The dispatch policies (``--dispatch``) are listed
below, from the registry (``policy/dispatch/registry.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys

_OWN = ("--host", "--port", "--additional-config")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve N vLLM engines behind one OpenAI-compatible endpoint",
                       description=__doc__, epilog=options_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model path or name (as for vllm serve); several (MODEL_A MODEL_B ...), or a fleet "
                                 "file (.json), serve several models behind the one endpoint")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def options_help() -> str:
    """``kunserve serve --help``'s list of this command's own options, each with its default (they
    are parsed in a second stage, after MODEL, so the first parser cannot show them)."""
    text = _options().format_help()
    body = text.split("\n\n", 1)[1] if "\n\n" in text else text   # without the usage line
    return ("kunserve serve's options (every other argument is a vLLM engine argument, checked by "
            "`vllm serve`'s parser and passed to every engine; see `vllm serve --help`):\n\n" + body)


def _options() -> argparse.ArgumentParser:
    from vllm_kunserve.cluster.fleet.backends import BACKENDS, RAY_PLACEMENTS
    from vllm_kunserve.policy.dispatch import DEFAULT_DISPATCH, DISPATCH, describe

    p = argparse.ArgumentParser(prog="kunserve serve MODEL", add_help=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--instances", type=int, default=1, help="engines to start")
    p.add_argument("--max-instances", type=int, default=None, metavar="N",
                   help="an elastic fleet: start up to N engines as the demand rises, drain and stop them as it falls "
                        "(unset: --instances, a fixed fleet)")
    p.add_argument("--min-instances", type=int, default=None, metavar="N",
                   help="an elastic fleet never drains below N engines (unset: --instances)")
    p.add_argument("--elastic", default=None, metavar="JSON",
                   help="an elastic fleet's thresholds, holds and drain budget (docs/config.md, `elastic`)")
    p.add_argument("--host-memory-share", type=float, default=MEMORY_HEADROOM, metavar="FRACTION",
                   help="local CPU engines with no memory flag divide this share of the host's available memory "
                        "(the rest: the front end, the engines' own growth, the OS)")
    p.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0],
                   help="local: one process per engine on this machine; ray: one Ray actor per engine")
    p.add_argument("--engine-url", action="append", default=[], metavar="URL",
                   help="front engines started elsewhere (repeat per engine; e.g. Kubernetes pods' vllm serve): "
                        "kunserve starts none, --instances is their count, the engine arguments are not used")
    p.add_argument("--engine-control-url", action="append", default=[], metavar="URL",
                   help="with --engine-url, in the same order: a kunserve engine's control port (stock engines: omit)")
    p.add_argument("--reuse-port", action="store_true",
                   help="with --engine-url: other kunserve serve front ends over the same engines may listen on this "
                        "port too (SO_REUSEPORT: the kernel spreads new connections over them; same user only); each "
                        "keeps its own dispatch view, breakers and /metrics. Not with --kunserve-config: one front "
                        "end forms the groups")
    p.add_argument("--ray-address", default=None, help="Ray cluster address; unset: start a local Ray")
    p.add_argument("--ray-num-cpus", type=float, default=1.0, help="CPUs each engine's actor reserves")
    p.add_argument("--ray-resources", default=None, metavar="JSON",
                   help="custom Ray resources each engine's actor reserves, e.g. '{\"engine_slot\": 1}' (the nodes "
                        "that offer them take the engines)")
    p.add_argument("--ray-placement", choices=RAY_PLACEMENTS, default=RAY_PLACEMENTS[0],
                   help="spread: engines on distinct Ray nodes where Ray can (a node's loss takes the fewest); "
                        "pack: fill a node first (pipeline groups form only within a node)")
    p.add_argument("--host", default="127.0.0.1", help="front end address")
    p.add_argument("--port", type=int, default=8000, help="front end port")
    p.add_argument("--dispatch", choices=DISPATCH, default=DEFAULT_DISPATCH, metavar="POLICY",
                   help=f"dispatch policy: {describe(None)}")
    p.add_argument("--kunserve-config", default=None, help="the kunserve section: inline JSON or a JSON file; unset: stock vLLM engines")
    p.add_argument("--monitor-interval", type=float, default=0.5, help="seconds between engine polls")
    p.add_argument("--max-concurrency", type=int, default=1024, help="requests upstream at once")
    p.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request may wait for a slot")
    p.add_argument("--admission", choices=("off", "memory"), default="off",
                   help="memory: a request the fleet cannot hold even after every drop it may still make waits in "
                        "a bounded queue (ordered by the x-kunserve-priority header, lower first), past it 429 with "
                        "Retry-After; off: every request goes to an engine (vLLM's own preemption)")
    p.add_argument("--admission-queue", type=int, default=256, help="--admission memory: requests that may wait")
    p.add_argument("--admission-wait", type=float, default=60.0,
                   help="--admission memory: seconds a request may wait in the queue before its 429")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds of engine silence before giving up")
    p.add_argument("--first-byte-timeout", type=float, default=60.0,
                   help="seconds a streamed request waits for an engine's response head before it is retried "
                        "on another engine (the engine is counted as failing)")
    p.add_argument("--retry-backoff", type=float, default=0.05,
                   help="base of the exponential backoff with full jitter between retries of one request (s)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each engine may take to start")
    p.add_argument("--no-restart", action="store_true", help="do not restart engines that die")
    p.add_argument("--log-dir", default="", help="engine logs; empty: the temp directory")
    p.add_argument("--token", default=None, help="bearer token for /kunserve/ops and the engines' control ports "
                                                 "; unset: the environment's KUNSERVE_CONTROL_TOKEN")
    p.add_argument("--engine-api-key", default=None, metavar="KEY",
                   help="with --engine-url: the key the front end sends the attached engines (their own vllm serve "
                        "--api-key), where it differs from the front end's; vLLM's --api-key (or VLLM_API_KEY) is "
                        "what the front end's /v1 routes ask of clients and what engines it starts are given")
    return p


def api_keys(engine_ns: argparse.Namespace, environ=os.environ) -> list[str]:
    """The keys vLLM's ``vllm serve`` would accept with these engine arguments: ``--api-key`` (one or
    more), else ``VLLM_API_KEY`` (vLLM's own precedence); empty: no key."""
    return [k for k in (getattr(engine_ns, "api_key", None) or [environ.get("VLLM_API_KEY")]) if k]


def check_engine_args(model: str, engine_args: list[str]) -> argparse.Namespace:
    """vLLM's own ``vllm serve`` parser over the engine arguments (a clear error, nothing started);
    returns what it parsed."""
    for a in engine_args:
        if a.split("=", 1)[0] in _OWN:
            raise ValueError(f"{a.split('=', 1)[0]}: set by kunserve serve (front end --host/--port; "
                             f"use --kunserve-config for the kunserve section)")
    from vllm_kunserve.integration.vllm.base import VllmPatch
    from vllm_kunserve.integration.vllm.versions import check_supported, located, vllm_version

    check_supported(vllm_version())  # one line naming the supported range
    # vllm serve's parser moved: entrypoints.openai (0.26-0.28), .launchers (0.29-0.32), .common (0.33-)
    make_arg_parser = VllmPatch.resolve(located("make_arg_parser"))
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())

    def error(msg: str):
        raise ValueError(f"engine arguments: {msg}")
    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args([model, *engine_args])


def check_url(u: str) -> None:
    """An engine URL: http(s)://host[:port][/path], the port a number in 1..65535."""
    from urllib.parse import urlsplit

    what = f"--engine-url / --engine-control-url {u!r}"
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{what}: an http:// or https:// URL")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{what}: the port must be a number in 1..65535") from None
    if not parts.hostname:
        raise ValueError(f"{what}: no host")
    if port == 0:
        raise ValueError(f"{what}: the port must be a number in 1..65535")
    if parts.query or parts.fragment:
        raise ValueError(f"{what}: no query or fragment (the engine's base URL)")


def parse(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    opts, engine_args = _options().parse_known_args(args.rest)
    if opts.engine_control_url and not opts.engine_url:
        raise ValueError("--engine-control-url needs --engine-url (the engines it belongs to)")
    if opts.engine_api_key is not None and not opts.engine_url:
        raise ValueError("--engine-api-key needs --engine-url: engines kunserve serve starts are given vLLM's "
                         "--api-key (or VLLM_API_KEY), and the front end sends them that")
    if opts.engine_api_key is not None and not opts.engine_api_key.strip():
        raise ValueError("--engine-api-key: empty")
    if opts.reuse_port and not opts.engine_url:
        raise ValueError("--reuse-port needs --engine-url: front ends sharing a port front the same engines, "
                         "started elsewhere (each kunserve serve without it starts engines of its own)")
    if opts.reuse_port and opts.kunserve_config is not None:
        raise ValueError("--reuse-port with --kunserve-config: cluster drop needs one front end that sees every "
                         "request to form groups; run one front end (drop --reuse-port) or stock engines")
    if opts.engine_url:
        from vllm_kunserve.cluster.fleet.backends import ATTACH

        if "--instances" in args.rest and opts.instances != len(opts.engine_url):
            raise ValueError(f"--instances {opts.instances} but {len(opts.engine_url)} --engine-url: attached engines "
                             "are counted by their URLs (drop --instances)")
        if len(opts.engine_control_url) > len(opts.engine_url):
            raise ValueError(f"{len(opts.engine_control_url)} --engine-control-url for {len(opts.engine_url)} "
                             "--engine-url")
        from vllm_kunserve.cluster.fleet.backends import BACKENDS

        # the default backend (local) is harmless to name; another, or a Ray address, would be ignored
        named = [f"--backend {opts.backend}"] if opts.backend != BACKENDS[0] else []
        named += ["--ray-address"] if opts.ray_address else []
        if named:
            raise ValueError(f"{named[0]} with --engine-url: attached engines were started elsewhere, kunserve "
                             "starts none (drop one of them)")
        for u in opts.engine_url + opts.engine_control_url:
            check_url(u)
        for name, urls in (("--engine-url", opts.engine_url), ("--engine-control-url", opts.engine_control_url)):
            seen = [u.rstrip("/") for u in urls]
            dup = next((u for i, u in enumerate(seen) if u in seen[:i]), None)
            if dup:
                raise ValueError(f"{name} {dup} given twice: one engine, one URL")
        opts.instances, opts.backend = len(opts.engine_url), ATTACH
    if not 0 < opts.host_memory_share <= 1:
        raise ValueError(f"--host-memory-share must be in (0, 1], got {opts.host_memory_share:g}")
    if opts.instances < 1 or opts.instances > 256:
        raise ValueError(f"--instances must be 1..256, got {opts.instances}")
    elastic_flags = [f for f, v in (("--max-instances", opts.max_instances), ("--min-instances", opts.min_instances),
                                    ("--elastic", opts.elastic)) if v is not None]
    if opts.engine_url and elastic_flags:
        raise ValueError(f"{elastic_flags[0]} with --engine-url: attached engines were started elsewhere, so kunserve "
                         "serve cannot start or stop them")
    opts.max_instances = opts.instances if opts.max_instances is None else opts.max_instances
    opts.min_instances = opts.instances if opts.min_instances is None else opts.min_instances
    if not 1 <= opts.min_instances <= opts.instances <= opts.max_instances <= 256:
        raise ValueError(f"--min-instances {opts.min_instances}, --instances {opts.instances}, --max-instances "
                         f"{opts.max_instances}: need 1 <= min <= instances <= max <= 256")
    if opts.elastic is not None and opts.max_instances == opts.min_instances:
        raise ValueError("--elastic: the fleet is fixed (set --max-instances above --min-instances)")
    if opts.max_instances > opts.min_instances:
        from vllm_kunserve.config import KunServeConfigError, parse_elastic

        try:
            opts.elastic = parse_elastic(opts.elastic)
        except KunServeConfigError as e:
            raise ValueError(f"--elastic: {e}") from None
    if not 0 < opts.port < 65536:
        raise ValueError(f"--port must be 1..65535, got {opts.port}")
    if opts.monitor_interval <= 0 or opts.max_concurrency < 1:
        raise ValueError("--monitor-interval must be > 0 and --max-concurrency >= 1")
    if opts.first_byte_timeout <= 0 or opts.retry_backoff < 0:
        raise ValueError("--first-byte-timeout must be > 0 and --retry-backoff >= 0")
    if opts.admission_queue < 0 or not opts.admission_wait > 0:
        raise ValueError(f"--admission-queue must be >= 0 and --admission-wait > 0, got {opts.admission_queue} and "
                         f"{opts.admission_wait:g}")
    from vllm_kunserve.engine.control import TOKEN_ENV, is_loopback

    token = opts.token or os.environ.get(TOKEN_ENV)
    if not is_loopback(opts.host) and not token:
        raise ValueError(f"--host {opts.host} is reachable from other machines: set --token (or {TOKEN_ENV}) so "
                         f"that /kunserve/ops and the engines' control ports refuse requests without it")
    from vllm_kunserve.cluster.fleet.backends import RAY_PLACEMENTS

    opts.ray_resources = ray_resources(opts.ray_resources)
    if opts.backend != "ray" and (opts.ray_resources or opts.ray_placement != RAY_PLACEMENTS[0]):
        raise ValueError("--ray-resources and --ray-placement place Ray actors: they need --backend ray")
    if opts.backend == "ray" and opts.ray_address and opts.kunserve_config is not None and not token:
        raise ValueError(f"--backend ray --ray-address {opts.ray_address}: the engines' control ports listen on their "
                         f"nodes' addresses, reachable from other machines; set --token (or {TOKEN_ENV})")
    return opts, engine_args


def ray_resources(raw: str | None) -> dict[str, float]:
    """``--ray-resources``: a JSON object of resource names and positive amounts, or one line saying why not."""
    if not raw:
        return {}
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"--ray-resources: not valid JSON ({e})") from None
    if (not isinstance(d, dict) or not all(isinstance(k, str) and k for k in d)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in d.values())):
        raise ValueError(f"--ray-resources: expected an object of resource names and amounts > 0, e.g. "
                         f"'{{\"engine_slot\": 1}}', got {raw[:80]!r}")
    if {"CPU", "GPU", "memory"} & set(d):
        raise ValueError("--ray-resources: CPU, GPU and memory are Ray's built-in resources, not custom ones (CPUs: "
                         "--ray-num-cpus)")
    return {k: float(v) for k, v in d.items()}


#: the engine arguments (and environment) with which the user sizes an engine's memory themselves
_MEMORY_FLAGS = ("--gpu-memory-utilization", "--kv-cache-memory-bytes", "--kv-cache-memory")
_MEMORY_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: the share of the host's available memory the engines divide among them (the rest: the front end,
#: the engines' own growth, the OS)
MEMORY_HEADROOM = 0.9
GiB = 1 << 30


def weight_bytes(model: str) -> int:
    """The bytes of a local model directory's weight files (0 where the model is not a directory)."""
    from pathlib import Path

    d = Path(model)
    if not d.is_dir():
        return 0
    return sum(f.stat().st_size for pat in ("*.safetensors", "*.bin", "*.pt") for f in d.glob(pat))


def memory_split(instances: int, engine_args: list[str], *, device: str, backend: str, available: int, total: int,
                 weights: int, env: dict | None = None, share: float = MEMORY_HEADROOM) -> tuple[list[str], str]:
    """The engine arguments that divide one host's memory among the ``instances`` engines
    ``kunserve serve`` starts on it, and the line that says so.

    vLLM on CPU sizes each engine's memory as ``--gpu-memory-utilization`` (0.92 by default) of the
    whole host, so the second of two engines cannot start. Unless the user sized the engines
    (``--gpu-memory-utilization``, ``--kv-cache-memory-bytes`` or ``VLLM_CPU_KVCACHE_SPACE``),
    each of N local CPU engines gets ``share`` (``--host-memory-share``, default ``MEMORY_HEADROOM``) of
    the available memory / N, as a utilization of the host; a share that cannot hold the model's
    weights and some KV is refused before anything starts. One engine keeps vLLM's own default; GPU engines size themselves per
    device, and Ray engines may be on other hosts: both are left as they are."""
    env = os.environ if env is None else env
    given = any(a.split("=", 1)[0] in _MEMORY_FLAGS for a in engine_args) or bool(env.get(_MEMORY_ENV))
    if given or instances < 2 or device != "cpu" or backend != "local":
        return [], ""
    per = share * available / instances
    need = weights + max(256 << 20, weights // 10) if weights else 0
    if per < need:
        raise ValueError(f"--instances {instances}: each engine would get {per / GiB:.2f} GiB of the {available / GiB:.1f} "
                         f"GiB this host has available, less than the model's {weights / GiB:.2f} GiB of weights and "
                         f"a KV cache; start fewer engines, or size them with --kv-cache-memory-bytes")
    util = max(0.001, int(per / total * 1000) / 1000)
    line = (f"[kunserve] memory: {instances} engines share {share:.0%} of the {available / GiB:.1f} GiB "
            f"available (of {total / GiB:.1f} GiB): each --gpu-memory-utilization {util:g} ({util * total / GiB:.2f} GiB "
            f"for its weights{f' ({weights / GiB:.2f} GiB)' if weights else ''}, runtime and KV cache); pass "
            f"--gpu-memory-utilization or --kv-cache-memory-bytes to choose")
    return ["--gpu-memory-utilization", f"{util:g}"], line


def device_split(instances: int, *, device: str, backend: str, devices: int, env: dict | None = None
                 ) -> tuple[dict[str, str], str]:
    """On a CUDA host, one engine per device: the engine environment that gives engine i GPU i
    (``KUNSERVE_ENGINE_GPUS``), and the line that says so. Left alone where the user chose
    (``KUNSERVE_ENGINE_GPUS`` or ``CUDA_VISIBLE_DEVICES`` set), for one engine, off CUDA and on Ray
    (Ray assigns devices); more engines than devices is refused, naming the setting to share them."""
    from vllm_kunserve.cluster.fleet.spec import ENGINE_GPUS

    env = os.environ if env is None else env
    if device != "cuda" or backend != "local" or instances < 2 or env.get(ENGINE_GPUS) or env.get("CUDA_VISIBLE_DEVICES"):
        return {}, ""
    if instances > devices:
        raise ValueError(f"--instances {instances}: this host has {devices} GPU(s), one engine each; to share them, "
                         f"set {ENGINE_GPUS} (e.g. {'|'.join(str(i % max(devices, 1)) for i in range(instances))}) and "
                         f"size each engine with --gpu-memory-utilization")
    gpus = "|".join(str(i) for i in range(instances))
    return {ENGINE_GPUS: gpus}, (f"[kunserve] devices: one GPU per engine (engine i on GPU i of {devices}); set "
                                 f"{ENGINE_GPUS} to choose")


def _tokenizer(name: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # the engines still check lengths themselves
        logging.getLogger("kunserve.serve").warning("no local tokenizer (%s): prompt lengths are checked by the engines", e)
        return None


def build(model: str, opts: argparse.Namespace, engine_args: list[str], engine_ns: argparse.Namespace,
          progress=None, engine_env: dict[str, str] | None = None):
    """The fleet and front end (not started); ``engine_ns`` is :func:`check_engine_args`'s parse."""
    from vllm_kunserve.cluster.fleet.backends import make_backend
    from vllm_kunserve.cluster.fleet.fleet import Fleet
    from vllm_kunserve.cluster.fleet.spec import EngineSpec
    from vllm_kunserve.cluster.frontend.app import FrontEnd
    from vllm_kunserve.config import parse_config, parse_kunserve_config

    kunserve = parse_kunserve_config(opts.kunserve_config) if opts.kunserve_config is not None else None
    keys = api_keys(engine_ns)
    token = opts.token if opts.token is not None else os.environ.get("KUNSERVE_CONTROL_TOKEN", "")
    if kunserve is not None and token:
        kunserve = {**kunserve, "control": {**kunserve.get("control", {}), "token": token}}
    spec = EngineSpec(model, tuple(engine_args), kunserve, env=dict(engine_env or {}),
                      startup_timeout_s=opts.startup_timeout, log_dir=opts.log_dir)
    if opts.engine_url:
        from vllm_kunserve.cluster.fleet.backends import AttachBackend

        backend = AttachBackend(opts.engine_url, opts.engine_control_url)
    else:
        backend = make_backend(opts.backend, "127.0.0.1", opts.ray_address, opts.ray_num_cpus, opts.ray_resources,
                               opts.ray_placement)
    fleet = Fleet(spec, opts.instances, backend, restart=not opts.no_restart, progress=progress,
                  max_instances=opts.max_instances)
    cfg = parse_config(kunserve)
    from vllm_kunserve.cluster.control.migration import placement_planner

    # a periodic dispatch policy's moves each period (MELL's migrations, cluster.control.migration); also
    # armed for a run-time switch to one (/kunserve/ops/dispatch), idle under the other policies
    planner = placement_planner(cfg.placement)
    front = FrontEnd(fleet, dispatch=opts.dispatch, monitor_interval_s=opts.monitor_interval,
                     max_concurrency=opts.max_concurrency, queue_timeout_s=opts.queue_timeout,
                     request_timeout_s=opts.request_timeout, first_byte_timeout_s=opts.first_byte_timeout,
                     retry_backoff_s=opts.retry_backoff, token=token,
                     tokenizer=_tokenizer(engine_ns.tokenizer or model), plan_migrations=planner,
                     kunserve_cfg=cfg if kunserve is not None else None, api_keys=keys,
                     engine_api_key=opts.engine_api_key or (keys[0] if keys else ""), admission=opts.admission,
                     admission_queue=opts.admission_queue, admission_wait_s=opts.admission_wait,
                     elastic=opts.elastic if opts.max_instances > opts.min_instances else None,
                     min_instances=opts.min_instances)
    return fleet, front


def attach_line(fleet, drop_on: bool) -> str:
    """What ``kunserve serve --engine-url`` found on the engines it attached: which are kunserve
    engines (a control port, typed or announced by the engine) and whether cluster drop runs."""
    found = getattr(fleet.backend, "found", {})
    parts = [f"{e.index}: " + (f"control {e.control_url} ({'--engine-control-url' if found.get(e.index) == 'flag' else 'from the engine'})"
                               if e.control_url else found.get(e.index, "stock"))
             for e in fleet.engines]
    n = sum(1 for e in fleet.engines if e.control_url)
    tail = ("" if not n else " cluster drop: on (--kunserve-config)" if drop_on else
            " cluster drop: off (pass --kunserve-config, '{}' for the defaults, to let these engines form groups)")
    return f"[kunserve] attached engines: {'; '.join(parts)}.{tail}"


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The front end's listening socket, bound now: before any engine starts, so that a port in
    use fails at once with a clear error, and no engine's own ports (vLLM picks free ones while
    it starts, which takes tens of seconds) can take it meanwhile. uvicorn serves on it.
    ``reuse_port``: other sockets of this user bound with it share the port (``SO_REUSEPORT``)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); "
                         f"nothing was started") from exc
    sock.set_inheritable(False)  # the engines started after it must not hold it
    return sock


def leading_models(args: argparse.Namespace) -> list[str]:
    """MODEL and the models that follow it before the first option (``kunserve serve A B --port 8000``);
    they leave ``args.rest``."""
    models = [args.model]
    while args.rest and not args.rest[0].startswith("-"):
        models.append(args.rest.pop(0))
    return models


def run(args: argparse.Namespace) -> int:
    from vllm_kunserve.cluster.fleet.fleetfile import is_fleet_file

    models = leading_models(args)
    if len(models) > 1 or is_fleet_file(models[0]):
        return run_fleet(args, models)
    return run_one(args)


def run_fleet(args: argparse.Namespace, models: list[str]) -> int:
    """Several models behind one endpoint: a front end per model (its own engines), one router, and
    with ``--kunserve-config`` the tenancy controller that moves memory between them."""
    import copy
    import dataclasses
    import threading

    import uvicorn

    from vllm_kunserve.cluster.fleet.fleetfile import from_models, is_fleet_file, load_fleet
    from vllm_kunserve.cluster.fleet.launcher import SERVING_LINE, StartupExited
    from vllm_kunserve.cluster.fleet.spec import ENGINE_CPUS, ENGINE_GPUS, cpu_split
    from vllm_kunserve.cluster.frontend.app import build_app
    from vllm_kunserve.cluster.frontend.models import ModelRouter
    from vllm_kunserve.config import TenancyConfig, parse_config

    files = [m for m in models if is_fleet_file(m)]
    if files and len(models) > 1:
        raise ValueError(f"a fleet file ({files[0]}) names every model: give it alone, not with "
                         f"{next(m for m in models if m != files[0])}")
    opts, engine_args = parse(args)
    for flag, bad in (("--engine-url", opts.engine_url), ("--max-instances", opts.max_instances != opts.instances),
                      ("--min-instances", opts.min_instances != opts.instances), ("--backend ray", opts.backend == "ray")):
        if bad:
            raise ValueError(f"{flag} with several models: a multi-model fleet runs local engines of a fixed size")
    if any(a.split("=", 1)[0] == "--served-model-name" for a in engine_args):
        raise ValueError("--served-model-name with several models: each model's name is its own (a fleet file's "
                         "\"name\")")
    if is_fleet_file(models[0]):
        entries, tenancy = load_fleet(models[0])
        entries = [dataclasses.replace(e, instances=e.instances or opts.instances) for e in entries]
    else:
        entries, tenancy = from_models(models, opts.instances), TenancyConfig()
    sock = listen_socket(opts.host, opts.port, opts.reuse_port)
    fleets, fronts = [], {}
    try:
        parsed = {e.name: check_engine_args(e.model, [*engine_args, *e.engine_args]) for e in entries}
        import psutil
        from vllm.platforms import current_platform

        total = sum(e.instances for e in entries)
        vm = psutil.virtual_memory()
        extra, line = memory_split(total, engine_args, device=current_platform.device_type, backend=opts.backend,
                                   available=vm.available, total=vm.total,
                                   weights=max(weight_bytes(e.model) for e in entries), share=opts.host_memory_share)
        gpu_env: dict[str, str] = {}
        if current_platform.device_type == "cuda":
            import torch

            gpu_env, gpu_line = device_split(total, device="cuda", backend=opts.backend,
                                             devices=torch.cuda.device_count())
            line = "\n".join(x for x in (line, gpu_line) if x)
        cpu_env, cpu_line = cpu_split(total, device=current_platform.device_type, backend=opts.backend,
                                      cpus=sorted(os.sched_getaffinity(0)))
        for ln in (line, cpu_line):
            if ln:
                print(ln, flush=True)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        first = 0
        for e in entries:
            o = copy.copy(opts)
            o.instances = o.max_instances = o.min_instances = e.instances
            o.elastic = None
            env = {}
            for key, src in ((ENGINE_CPUS, cpu_env), (ENGINE_GPUS, gpu_env)):
                split = src.get(key) or os.environ.get(key)   # ours, or the user's own
                if split:   # this model's engines take the next runs of the split
                    parts = split.split("|")
                    env[key] = "|".join(parts[(first + i) % len(parts)] for i in range(e.instances))
            first += e.instances
            fleet, front = build(e.model, o, [*engine_args, *e.engine_args, *extra, "--served-model-name", e.name],
                                 parsed[e.name], engine_env=env)
            front.freeze_gc = True
            fleets.append(fleet)
            fronts[e.name] = front
        kind = "kunserve" if opts.kunserve_config is not None else "stock vLLM"
        print(f"[kunserve] starting {len(entries)} models ({', '.join(f'{e.name}: {e.instances}' for e in entries)}) "
              f"on {kind} engines ...", flush=True)
        errors: list[BaseException] = []

        def start(f) -> None:
            try:
                f.start()
            except BaseException as exc:   # noqa: BLE001 - reported below, every fleet stopped
                errors.append(exc)
        threads = [threading.Thread(target=start, args=(f,), daemon=True) for f in fleets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            e0 = errors[0]
            raise ValueError(e0.one_line() if isinstance(e0, StartupExited) else str(e0)) from None
        tenancy_ctl = None
        if opts.kunserve_config is not None:
            from vllm_kunserve.cluster.control.tenancy import TenancyController

            cfg = parse_config(next(iter(fronts.values())).fleet.spec.kunserve)
            tenancy_ctl = TenancyController(fronts, tenancy, {e.name: e.priority for e in entries}, cfg.remap)
        keys = api_keys(next(iter(parsed.values())))
        router = ModelRouter({n: (f, build_app(f)) for n, f in fronts.items()}, tenancy_ctl, tuple(keys))
        config = uvicorn.Config(router, host=opts.host, port=opts.port, log_level="warning", timeout_keep_alive=30)
        server = uvicorn.Server(config)
        print(f"{SERVING_LINE} {total} instance(s) of {len(entries)} models at http://{opts.host}:{opts.port} "
              f"(models: {', '.join(fronts)}; memory moves between them: "
              f"{'on' if tenancy_ctl else 'off (stock engines: a static split)'})", flush=True)
        server.run(sockets=[sock])
    finally:
        if fleets:
            print("[kunserve] stopping engines ...", flush=True)
        for f in fleets:
            f.stop()
        sock.close()
    return 0


def run_one(args: argparse.Namespace) -> int:
    import uvicorn

    from vllm_kunserve.cluster.frontend.app import build_app
    from vllm_kunserve.cluster.fleet.launcher import SERVING_LINE, StartupExited

    opts, engine_args = parse(args)
    sock = listen_socket(opts.host, opts.port, opts.reuse_port)
    try:
        engine_ns = check_engine_args(args.model, engine_args)
        import psutil
        from vllm.platforms import current_platform

        vm = psutil.virtual_memory()
        extra, line = memory_split(opts.max_instances, engine_args, device=current_platform.device_type,
                                   backend=opts.backend, available=vm.available, total=vm.total,
                                   weights=weight_bytes(args.model), share=opts.host_memory_share)
        if extra:   # vLLM's own flag, already checked by the parse above; nothing it parsed changes
            engine_args = [*engine_args, *extra]
            print(line, flush=True)
        gpu_env, gpu_line = {}, ""
        if current_platform.device_type == "cuda" and not opts.engine_url:
            import torch

            gpu_env, gpu_line = device_split(opts.max_instances, device="cuda", backend=opts.backend,
                                             devices=torch.cuda.device_count())
        from vllm_kunserve.cluster.fleet.spec import cpu_split

        cpu_env, cpu_line = cpu_split(opts.max_instances, device=current_platform.device_type, backend=opts.backend,
                                      cpus=sorted(os.sched_getaffinity(0)))
        for ln in (gpu_line, cpu_line):
            if ln:
                print(ln, flush=True)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        fleet, front = build(args.model, opts, engine_args, engine_ns, engine_env={**gpu_env, **cpu_env})
        from vllm_kunserve.runtime.hostlock import lock_if_wanted

        lock_if_wanted()  # KUNSERVE_MLOCK=1 (inherited by the engines, whose plugin locks them too)
        front.freeze_gc = True  # gc.freeze() once started (KUNSERVE_GC_FREEZE=0 to measure without)
        kind = "kunserve" if fleet.spec.kunserve is not None else "stock vLLM"
        if opts.engine_url:
            print(f"[kunserve] attaching {opts.instances} engine(s) started elsewhere: {', '.join(opts.engine_url)}",
                  flush=True)
        else:
            print(f"[kunserve] starting {opts.instances} {kind} engine(s) on the {opts.backend} backend"
                  + (f" (elastic: {opts.min_instances} to {opts.max_instances})" if front.elastic else "") + " ...",
                  flush=True)
        try:
            fleet.start()
        except StartupExited as e:   # one line, no traceback (the fleet has stopped every engine)
            raise ValueError(e.one_line()) from None
        if opts.engine_url:
            print(attach_line(fleet, opts.kunserve_config is not None), flush=True)
        try:
            app = build_app(front)
            config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning", timeout_keep_alive=30)
            server = uvicorn.Server(config)
            print(f"{SERVING_LINE} {opts.instances} instance(s) at http://{opts.host}:{opts.port} "
                  f"(dispatch {opts.dispatch}; status: kunserve status --url http://{opts.host}:{opts.port})",
                  flush=True)
            server.run(sockets=[sock])
        finally:
            print("[kunserve] stopping engines ...", flush=True)
            fleet.stop()
    finally:
        sock.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    from vllm_kunserve.cli.main import main

    sys.exit(main(["serve", *sys.argv[1:]]))
