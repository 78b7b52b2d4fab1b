"""Measure real vLLM-CPU step times for batches of (prefix, chunk) shapes.

Runs an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend=
"uni"``, ``--dtype``: float32 by default), wraps the scheduler to record, for every engine step,
each scheduled request's ``(prefix tokens with KV, new tokens)``, and times ``LLMEngine.step()``. Workloads: single and batched
prefills of several lengths, chunked prefills (prefix > 0) and decode batches at several contexts.

Output: the profile format of ``policy/costmodel.py`` (``{"attention": true, "rows": [{"chunks":
[[prefix, tokens], ...], "ms": ...}], "meta": {...}}``), ready for ``kunserve costmodel fit``.

    python -m benchmarks.profile_cpu_steps --model models/small --out docs/benchmarks/cpu_small_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--out", default="docs/benchmarks/cpu_small_profile.json")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--mem-util", type=float, default=0.3, help="vLLM-CPU share of host memory to reserve")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a minute or so)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                    help="the engine's dtype (the regime's: bfloat16 for R1's decode-bf16-mha on a bf16 CPU)")
    a = ap.parse_args()
    if not os.path.isdir(a.model):
        raise SystemExit(f"--model {a.model}: not a directory (build one with `kunserve make-model --preset small DIR`)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV; the profile needs little
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=a.model, dtype=a.dtype, distributed_executor_backend="uni",
              max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
              enable_prefix_caching=False, disable_log_stats=True, gpu_memory_utilization=a.mem_util)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    sched = core.scheduler
    shapes: list = []
    orig = sched.schedule

    def schedule(*args, **kw):
        out = orig(*args, **kw)
        cur = []
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            cur.append([int(req.num_computed_tokens) - int(n), int(n)])  # computed is already advanced
        shapes.append(cur)
        return out

    sched.schedule = schedule
    rows = []
    seq = [0]

    def run(prompts: list[int], max_tokens: int) -> None:
        for p in prompts:
            seq[0] += 1
            toks = [(7 * seq[0] + 13 * i) % 4000 + 5 for i in range(p)]
            engine.add_request(f"r{seq[0]}", TokensPrompt(prompt_token_ids=toks),
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        while engine.has_unfinished_requests():
            n0 = len(shapes)
            t = time.perf_counter()
            engine.step()
            ms = (time.perf_counter() - t) * 1e3
            if len(shapes) > n0 and shapes[-1]:
                rows.append({"chunks": shapes[-1], "ms": ms})

    run([64, 64], 2)  # warm-up
    rows.clear()
    prefills = (32, 128, 512, 1024, 2048) if a.quick else (16, 64, 128, 256, 512, 1024, 1536, 2048)
    decode_ctx = (128, 1024) if a.quick else (64, 256, 512, 1024, 2048)
    decode_bs = (1, 8, 32) if a.quick else (1, 4, 8, 16, 32, 64)
    for _ in range(a.repeat):
        for c in prefills:
            run([c], 1)
            run([c // 2, c // 2], 1)
        for p in (1024, 3000):  # chunked prefill: prompt longer than the token budget
            run([p], 1)
        for ctx in decode_ctx:
            for b in decode_bs:
                run([ctx] * b, 6)
        run([512] * 8 + [1500], 8)  # mixed prefill + decode steps
    dtype = str(engine.model_config.dtype).removeprefix("torch.")   # what ran (``--dtype auto`` resolved)
    meta = {"model": a.model, "device": "cpu", "dtype": dtype, "max_num_batched_tokens": a.max_num_batched_tokens,
            "max_num_seqs": a.max_num_seqs, "rows": len(rows), "torch_threads": os.environ.get("OMP_NUM_THREADS"),
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "kv_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"attention": True, "rows": rows, "meta": meta}, f)
    print(f"wrote {len(rows)} profiled steps to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
