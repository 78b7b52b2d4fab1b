"""What a step costs by the tokens it carries: one forward pass of T new tokens through a random
Llama (plain torch + transformers, no vLLM, no KV prefix), on the CPU or a GPU.

Usage:
    python -m benchmarks.step_tokens [--device cpu|cuda] [--preset decode-bf16|7b] [--threads 1]
        [--tokens 1,4,16,23,32,64,87,128,256,512] [--reps 15] [--eager]
        [--out docs/benchmarks/step_tokens.json] [--md docs/benchmarks/step_tokens.md]

Why it exists (issue 13): in a pipeline group each member's step passes through both members'
stages, so a prompt's prefill tokens in one member's step hold the other member's microbatch at the
shared stage. How much that costs depends on the machine balance: where a step is bound by reading
the weights, a 64-token prompt added to a decode batch is nearly free; where it is bound by compute,
each prefill token costs about what a decode token costs. The headline is the cost of adding a
64-token prompt to a step of 23 decodes (the group's per-member batch in the cluster burst), T=87
over T=23. The token rows are what a step's dense layers (projections, MLP, logits) see; attention
over a KV prefix is left out (short contexts: a small share). On CUDA each forward is replayed as a
CUDA graph, as vLLM runs its decode steps (``--eager``: without, launch-bound for small T).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from vllm_kunserve.bench.report import device_name, doc_header, md_row, md_table, rel, write_json

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs

#: model shapes: the cluster burst's CPU model (``kunserve make-model`` preset ``decode-bf16``) and a
#: Llama-2-7B-sized one (GPU only: 13 GB of bf16 weights)
PRESETS = {
    "decode-bf16": {"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 12,
                    "num_attention_heads": 24, "num_key_value_heads": 4, "vocab_size": 4096},
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
}
#: the headline pair: a 64-token prompt added to a step of 23 decodes
BASE_T, WITH_PROMPT_T = 23, 87


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"step_tokens.py: error: --tokens {text!r}: comma-separated integers") from None
    if not tokens or tokens[0] < 1:
        raise SystemExit(f"step_tokens.py: error: --tokens {text!r}: integers >= 1")
    return tokens


def build(preset: str, dev: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(**PRESETS[preset], max_position_embeddings=4096)
    with dev:
        return LlamaForCausalLM(cfg).eval().to(dtype=dtype)


def graphed(model, ids: torch.Tensor):
    """The forward of ``ids`` captured as a CUDA graph (what vLLM does for its decode steps: without
    it an eager Hugging Face forward is bound by kernel launches on the host, not by the GPU)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            model(ids, use_cache=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        model(ids, use_cache=False)
    return graph.replay


def measure(model, tokens: list[int], reps: int, warmup: int, dev: torch.device,
            graphs: bool = False) -> dict[int, list[float]]:
    """Seconds per forward of each T, the Ts interleaved (T1, T2, ..., T1, T2, ...) so that drift
    and other jobs hit every T alike."""
    vocab = model.config.vocab_size
    ids = {t: torch.randint(0, vocab, (1, t), device=dev) for t in tokens}
    if graphs:
        run = {t: graphed(model, ids[t]) for t in tokens}  # a capture that fails ends the run: no eager mix-up
    else:
        run = {t: (lambda x=ids[t]: model(x, use_cache=False)) for t in tokens}
    out: dict[int, list[float]] = {t: [] for t in tokens}
    with torch.no_grad():
        for i in range(warmup + reps):
            for t in tokens:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                run[t]()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if i >= warmup:
                    out[t].append(time.perf_counter() - t0)
    return out


def summarise(times: dict[int, list[float]]) -> dict:
    """Per T: median ms, ms per token, the median over T=1's; and the headline ratio."""
    med = {t: statistics.median(v) * 1e3 for t, v in times.items()}
    first = min(med)
    rows = [{"tokens": t, "ms": round(m, 3), "ms_per_token": round(m / t, 4), "over_one": round(m / med[first], 3),
             "spread_ms": [round(min(times[t]) * 1e3, 3), round(max(times[t]) * 1e3, 3)]}
            for t, m in sorted(med.items())]
    head = None
    if BASE_T in med and WITH_PROMPT_T in med:
        head = {"base_tokens": BASE_T, "with_prompt_tokens": WITH_PROMPT_T,
                "ratio": round(med[WITH_PROMPT_T] / med[BASE_T], 3),
                "added_ms": round(med[WITH_PROMPT_T] - med[BASE_T], 3)}
    return {"rows": rows, "prompt_in_decode_step": head}


def markdown(res: dict, out: Path) -> list[str]:
    h = res["prompt_in_decode_step"]
    lines = doc_header(
        f"Step cost by tokens per step: {res['preset']} on {res['device']}", "step_tokens.py", res["device"], out,
        f"One forward pass of T new tokens (one sequence, no KV prefix) through a random Llama, preset "
        f"`{res['preset']}` ({res['weights_mb']:.0f} MB of {res['dtype']} weights), {res['threads']} CPU thread(s)"
        f"{', each forward replayed as a CUDA graph' if res.get('cuda_graphs') else ''}; "
        f"median of {res['reps']} interleaved repetitions after {res['warmup']} warm-up. Why it matters: in a "
        f"pipeline group a prompt's prefill tokens in one member's step hold the other member's microbatch at the "
        f"shared stage (docs/benchmarks/pipeline_idle.md), so what a prefill token costs next to a decode batch "
        f"decides what a prompt costs the whole group.",
        load=res["load"])
    if h:
        lines += [f"**A 64-token prompt added to a step of {h['base_tokens']} decodes costs {h['ratio']:.2f}x that "
                  f"step** (+{h['added_ms']:.1f} ms).", ""]
    lines += md_table(["tokens per step", "ms (median)", "min..max", "ms per token", "over 1 token"], "rrlrr")
    for r in res["rows"]:
        lines.append(md_row([r["tokens"], f"{r['ms']:.2f}", f"{r['spread_ms'][0]:.2f}..{r['spread_ms'][1]:.2f}",
                             f"{r['ms_per_token']:.3f}", f"{r['over_one']:.2f}"]))
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="decode-bf16")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (the cluster burst's engines run one)")
    ap.add_argument("--tokens", default=f"1,4,16,{BASE_T},32,64,{WITH_PROMPT_T},128,256,512")
    ap.add_argument("--eager", action="store_true", help="on CUDA, no CUDA graphs (launch-bound for small T)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/step_tokens.json")
    ap.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks/step_tokens.md")
    a = ap.parse_args(argv)
    tokens = parse_tokens(a.tokens)
    if a.reps < 1 or a.warmup < 0 or a.threads < 1:
        ap.error("--reps and --threads must be >= 1, --warmup >= 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    model = build(a.preset, dev, getattr(torch, a.dtype))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    graphs = dev.type == "cuda" and not a.eager
    times = measure(model, tokens, a.reps, a.warmup, dev, graphs=graphs)
    res = {"device": device_name(dev), "preset": a.preset, "dtype": a.dtype, "threads": torch.get_num_threads(),
           "cuda_graphs": graphs, "weights_mb": weights / 1e6, "reps": a.reps, "warmup": a.warmup,
           "load": os.getloadavg()[0],
           **summarise(times), "raw_ms": {str(t): [round(x * 1e3, 3) for x in v] for t, v in times.items()}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, res, indent=1, clean=False)
    a.md.write_text("\n".join(markdown(res, a.out)))
    print(json.dumps({k: res[k] for k in ("device", "preset", "threads", "prompt_in_decode_step")}))
    print(f"wrote {rel(a.out)} and {rel(a.md)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
