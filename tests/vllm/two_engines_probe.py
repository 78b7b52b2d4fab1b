"""Several in-process vLLM-CPU engines with different kunserve configurations in ONE process;
prints one JSON line.

Usage: python two_engines_probe.py MODEL KV_BYTES CONFIGS_JSON
CONFIGS_JSON: a list with one ``additional_config`` per engine (null: none), built in that order
and all kept alive. Each engine reports what kunserve did to it (agent, KV plan, weights, worker
extension, the env exported to child processes right after it was built), then every engine
generates the same prompts greedily, and engines with an agent remap by force, generate again and
revert.
"""

import json
import os
import sys

N_PROMPTS, PROMPT, OUTPUT = 4, 96, 24
BLOCK_SIZE = 32


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the probe reports what a stock engine answers
        return f"{type(e).__name__}: {e}"[:200]
    return None


def describe(llm) -> dict:
    vc = llm.llm_engine.vllm_config
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    pool = core.scheduler.kv_cache_manager.block_pool
    agent = core.__dict__.get("_kunserve")
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    return {
        "env_patches": os.environ.get("KUNSERVE_PATCHES", ""),
        "agent": agent is not None,
        "agent_max_kv_ratio": agent.cfg.kv_ratio if agent else None,
        "worker_extension_cls": vc.parallel_config.worker_extension_cls,
        "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
        "pool_num_gpu_blocks": pool.num_gpu_blocks,
        "pool_blocks": len(pool.blocks),
        "base_tag": getattr(core.scheduler.kv_cache_config, "kunserve_base_blocks", None),
        "kunserve_memory": getattr(runner, "_kunserve_memory", None) is not None,
        # vLLM-CPU moves linear weights into its kernel's closure (empty weight); kunserve keeps them
        "linear_weight_numel": int(qkv.weight.numel()),
        "info_error": error_of(lambda: llm.collective_rpc("kunserve_info")),
    }


if __name__ == "__main__":
    model, kv_bytes, configs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import random

    from vllm import LLM, SamplingParams

    engines, res = [], {"engines": []}
    for additional in configs:
        kwargs = dict(dtype="float32", distributed_executor_backend="uni", enforce_eager=True, seed=0,
                      max_model_len=512, block_size=BLOCK_SIZE, kv_cache_memory_bytes=kv_bytes)
        if additional is not None:
            kwargs["additional_config"] = additional
        llm = LLM(model, **kwargs)
        engines.append(llm)
        res["engines"].append(describe(llm))

    rng = random.Random(7)
    vocab = engines[0].llm_engine.model_config.get_vocab_size()
    ps = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(PROMPT)]} for _ in range(N_PROMPTS)]
    sp = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)

    def generate(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(ps, sp, use_tqdm=False)]

    for llm, rec in zip(engines, res["engines"]):
        rec["tokens"] = generate(llm)
    for llm, rec in zip(engines, res["engines"]):
        rpc = llm.collective_rpc
        if not rec["agent"]:
            rec["remap_error"] = error_of(lambda: rpc("kunserve_remap", kwargs={"alpha": 2, "slots": 1}))
            continue
        rpc("kunserve_auto", args=(False,))
        ev = rpc("kunserve_remap", kwargs={"alpha": 2, "slots": 1})[0]
        st = rpc("kunserve_state")[0]
        rec.update(remap=ev["outcome"], remapped_layers=st["remapped_layers"],
                   blocks_remapped=st["capacity"]["blocks_total"], tokens_remapped=generate(llm))
        rec["revert"] = rpc("kunserve_revert")[0]["outcome"]
        st = rpc("kunserve_state")[0]
        rec.update(phase_after=st["phase"], blocks_after=st["capacity"]["blocks_total"],
                   problems=rpc("kunserve_check")[0]["problems"])
    # every engine still serves after the others transitioned
    res["tokens_final"] = [generate(llm) for llm in engines]
    print("PROBE_RESULT " + json.dumps(res), flush=True)
