"""What the kunserve plugin costs an engine that never drops: stock vLLM against the same engine with
the plugin enabled (as ``kunserve serve`` starts a group member), offline, on one pinned core.

Usage:
    python -m benchmarks.plugin_cost [--model models/decode-fp32-mha] [--reps 4] [--core 1]
        [--variants stock,kunserve,kunserve-no-control] [--name plugin_cost]

Why it exists (issue 34): in ``burst_value_r1_fp32.md`` kunserve's engines, never grouped, ran at
1.09x tuned stock's P50 TTFT and 1.20x its P90, with a P50 TPOT 4% above stock's. A plugin that
costs throughput while it does nothing is paid outside bursts too, so this measures it where
nothing else moves: each run is a fresh child process holding one engine (vLLM's default
multiprocess engine: an engine-core process and a worker process, both pinned to ``--core``, one
compute thread, ``KUNSERVE_SHM_WAIT_MS=1`` as the burst benchmarks run), 16 prompts of 64 tokens
prefilled (``max_tokens=1``), then the same prompts decoded for 129 tokens (their prefixes cached:
the run is ~all decode steps of batch 16). Variants, interleaved in a shuffled order per repetition:

- ``stock``: no ``kunserve`` key (the plugin is installed but does nothing);
- ``kunserve``: the engine ``kunserve serve --kunserve-config`` starts (``drop.group_member``, KV
  planned up to ``memory.max_kv_ratio`` 10x, control port on), nobody polling it;
- ``kunserve-no-control``: the same without its control port (``control.enable: false``): what the
  port's server thread costs;
- ``kunserve-in-process``: ``kunserve`` with the engine core and worker in one process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``): what the plugin's
  per-step work costs without the two processes' interplay;
- ``stock-in-process``: stock in one process, the reference for ``kunserve-in-process`` (ratios are
  taken against ``stock`` where it ran, else against this).

Each child reports its decode and prefill wall time, the CPU seconds of its engine-core and worker
processes over the decode (``psutil``), the host's CPU steal over it (``/proc/stat``: a VM's
hypervisor taking the core) and a hash of its greedy outputs (every variant must produce the same
tokens). Ratios to ``stock`` carry bootstrap 95% intervals over the repetitions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs

ENGINE_KCFG = {"drop": {"group_member": True}, "memory": {"max_kv_ratio": 10.0}, "control": {"port": 0}}
VARIANTS = {
    "stock": {"kunserve": None, "in_process": False},
    "kunserve": {"kunserve": ENGINE_KCFG, "in_process": False},
    "kunserve-no-control": {"kunserve": {**ENGINE_KCFG, "control": {"enable": False}}, "in_process": False},
    "kunserve-in-process": {"kunserve": ENGINE_KCFG, "in_process": True},
    "stock-in-process": {"kunserve": None, "in_process": True},
}
PROMPTS, PROMPT_LEN, DECODE_TOKENS = 16, 64, 129
#: KV for 6080 tokens per engine: the burst benchmarks' R1 engines (docs/benchmarks/burst_value_r1_fp32.md)
KV_BYTES = 896532480


def _tree_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's engine-core and worker processes (by their titles)."""
    import psutil

    out = {"engine_core": 0.0, "worker": 0.0, "parent": 0.0}
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            title = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            continue
        key = "engine_core" if "EngineCore" in title else "worker" if "Worker" in title else "parent"
        out[key] += t.user + t.system
    return out


def child(variant: str, model: str) -> None:
    """One measured engine (runs in a fresh process); prints ``RESULT <json>``."""
    spec = VARIANTS[variant]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec["kunserve"] is not None:
        kw["additional_config"] = {"kunserve": spec["kunserve"]}
    if spec["in_process"]:
        kw["distributed_executor_backend"] = "uni"
    llm = LLM(model=model, dtype="float32", block_size=32, kv_cache_memory_bytes=KV_BYTES, max_model_len=1024,
              enforce_eager=True, **kw)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 1000 + 10 for j in range(PROMPT_LEN)])
               for i in range(PROMPTS)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill_s = time.perf_counter() - t
    from vllm_kunserve.bench.hostwatch import cpu_steal_iowait_s

    cpu0, steal0, t = _tree_cpu(), cpu_steal_iowait_s()[0], time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=0.0),
                        use_tqdm=False)
    decode_s = time.perf_counter() - t
    cpu1, steal1 = _tree_cpu(), cpu_steal_iowait_s()[0]
    digest = hashlib.sha256(json.dumps([list(o.outputs[0].token_ids) for o in outs]).encode()).hexdigest()[:16]
    print("RESULT " + json.dumps({
        "variant": variant, "prefill_s": round(prefill_s, 3), "decode_s": round(decode_s, 3),
        "step_ms": round(1e3 * decode_s / DECODE_TOKENS, 2), "steal_s": round(steal1 - steal0, 2),
        "cpu_s": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0}, "outputs": digest}), flush=True)
    del llm


def run_child(variant: str, model: str, core: int, timeout_s: float) -> dict:
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
           "KUNSERVE_SHM_WAIT_MS": "1"}
    if VARIANTS[variant]["in_process"]:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    argv = ["taskset", "-c", str(core), sys.executable, __file__, "--child", variant, "--model", model]
    t = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        tail = "\n".join((p.stderr or p.stdout).splitlines()[-15:])
        raise SystemExit(f"plugin_cost.py: the {variant} run failed (exit {p.returncode}):\n{tail}")
    return {**json.loads(line[len("RESULT "):]), "wall_s": round(time.perf_counter() - t, 1)}


def ratio_ci(a: list[float], b: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """mean(a) / mean(b) with a bootstrap 95% interval (repetitions resampled independently)."""
    import numpy as np

    from benchmarks.common.pooled import interval

    rng = np.random.default_rng(seed)
    x, y = np.asarray(a, float), np.asarray(b, float)
    r = np.array([rng.choice(x, len(x)).mean() / rng.choice(y, len(y)).mean() for _ in range(draws)])
    return (float(x.mean() / y.mean()), *interval(r))


def report(raw: dict, md: Path, json_path: Path) -> None:
    import statistics

    from vllm_kunserve.bench.report import cpu_device, doc_header, md_table, write_doc, write_json

    runs, variants = raw["runs"], raw["variants"]
    by = {v: [r for r in runs if r["variant"] == v] for v in variants}
    ref = next((v for v in ("stock", "stock-in-process") if by.get(v)), None)
    stock = [r["decode_s"] for r in by.get(ref, [])]
    rows, summary = [], {}
    for v in variants:
        rs = by[v]
        if not rs:
            continue
        dec = [r["decode_s"] for r in rs]
        s = {"runs": len(rs), "decode_s_mean": statistics.mean(dec), "step_ms_mean": 1e3 * statistics.mean(dec) / DECODE_TOKENS,
             "prefill_s_mean": statistics.mean(r["prefill_s"] for r in rs),
             "engine_core_cpu_s": statistics.mean(r["cpu_s"]["engine_core"] for r in rs),
             "worker_cpu_s": statistics.mean(r["cpu_s"]["worker"] + (r["cpu_s"]["parent"] if VARIANTS[v]["in_process"] else 0)
                                             for r in rs),
             "steal_s": statistics.mean(r["steal_s"] for r in rs), "outputs": sorted({r["outputs"] for r in rs})}
        if stock and v != ref:
            s["decode_vs_stock"] = ratio_ci(dec, stock)
        summary[v] = s
        ratio = (f"{s['decode_vs_stock'][0]:.3f} ({s['decode_vs_stock'][1]:.3f}..{s['decode_vs_stock'][2]:.3f})"
                 if "decode_vs_stock" in s else "-")
        rows.append([v, s["runs"], f"{s['step_ms_mean']:.1f}", ", ".join(f"{d:.1f}" for d in dec), ratio,
                     f"{s['prefill_s_mean']:.2f}", f"{s['engine_core_cpu_s']:.2f}", f"{s['worker_cpu_s']:.2f}",
                     f"{s['steal_s']:.2f}"])
    identical = len({o for s in summary.values() for o in s["outputs"]}) == 1
    raw["summary"], raw["outputs_identical"] = summary, identical
    write_json(json_path, raw, indent=1, clean=False)
    lines = doc_header("What the plugin costs an engine that never drops (written by benchmarks/plugin_cost.py)",
                       "plugin_cost.py", cpu_device(f"each run pinned to core {raw['core']}, OMP_NUM_THREADS=1"),
                       json_path, __doc__.split("\n\n")[2].replace("\n", " "), args=raw.get("argv"),
                       load=raw.get("load_avg", "not recorded in the raw data"))
    lines += [f"Model `{raw['model']}` (fp32), KV for 6080 tokens; {PROMPTS} prompts of {PROMPT_LEN} tokens, "
              f"decoded for {DECODE_TOKENS} tokens. {raw['reps']} repetitions, the variants in a shuffled order each: "
              + "; ".join(", ".join(o) for o in raw["orders"]) + ".", "",
              *md_table(["variant", "runs", "decode step (ms)", "decode wall per run (s)", f"decode / {ref or 'stock'} (95%)",
                         "prefill (s)", "engine-core CPU (s)", "worker CPU (s)", "CPU steal (s)"], "lrrlrrrrr", rows), "",
              "CPU seconds over the decode: the engine-core process's and the worker's (in-process: the one process). "
              "CPU steal: the host's, over the decode (both cores).", "",
              f"Greedy outputs identical across every run of every variant: **{'yes' if identical else 'NO'}**.", ""]
    write_doc(md, lines, keep="## Reading")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "decode-fp32-mha"),
                    help="a model directory (`kunserve make-model --preset decode-fp32-mha DIR`)")
    ap.add_argument("--variants", default="stock,kunserve,kunserve-no-control,kunserve-in-process")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--core", type=int, default=1, help="the core every run is pinned to")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="one run's limit")
    ap.add_argument("--name", default="plugin_cost", help="doc name under docs/benchmarks/")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite the doc from the JSON (it quotes the measuring run's command and load)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.model)
        return 0
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        ap.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    if a.reps < 2:
        ap.error("--reps: at least 2 (the intervals resample repetitions)")
    if not 0 <= a.core < (os.cpu_count() or 1):
        ap.error(f"--core {a.core}: this host has cores 0..{(os.cpu_count() or 1) - 1}")
    md, js = ROOT / "docs" / "benchmarks" / f"{a.name}.md", ROOT / "docs" / "benchmarks" / f"{a.name}.json"
    if a.report_only:
        report(json.loads(js.read_text()), md, js)
        return 0
    if not (Path(a.model) / "config.json").is_file():
        ap.error(f"--model {a.model}: no model there (make one: kunserve make-model --preset decode-fp32-mha {a.model})")
    from vllm_kunserve.bench.report import write_json

    rng = random.Random(a.seed)
    orders = [rng.sample(variants, len(variants)) for _ in range(a.reps)]
    raw = {"model": os.path.relpath(a.model, ROOT), "core": a.core, "reps": a.reps, "variants": variants,
           "orders": orders, "runs": []}
    for rep, order in enumerate(orders, 1):
        for v in order:
            r = run_child(v, a.model, a.core, a.timeout_s)
            raw["runs"].append({**r, "rep": rep})
            print(f"rep {rep} {v}: decode {r['decode_s']:.2f} s, steal {r['steal_s']:.2f} s", flush=True)
            write_json(js, raw, indent=1, clean=False)   # progress survives an interrupted run
    raw["argv"], raw["load_avg"] = sys.argv[1:], round(os.getloadavg()[0], 2)   # the doc quotes the measuring run
    report(raw, md, js)
    print(f"wrote {md.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
