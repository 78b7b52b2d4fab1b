"""Remap scenarios on a real vLLM-CPU engine, one engine per process; prints one JSON line.

Usage: python remap_probe.py MODEL SCENARIO KV_BYTES [ADDITIONAL_CONFIG_JSON|none]
Scenarios: identity (greedy outputs with remap forced at several alpha/slots vs off),
           burst (16 requests at once; preemptions, capacity before/after),
           fault-<step> (a burst whose automatic remap fails at <step>),
           faults (every step of remap and revert fails once, in turn; outputs compared),
           controller (the policy raises mid-burst).
"""

import json
import os
import sys

N_REQ, PROMPT, OUTPUT = 16, 160, 80


def prompts(vocab: int):
    import random

    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(PROMPT)]} for _ in range(N_REQ)]


def preemptions(llm) -> int:
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            return int(m.value)
    return -1


if __name__ == "__main__":
    model, scenario, kv_bytes, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kwargs = dict(dtype="float32", distributed_executor_backend="uni", enforce_eager=True, seed=0,
                  max_model_len=512, block_size=32, kv_cache_memory_bytes=kv_bytes, max_num_seqs=32,
                  disable_log_stats=False)
    if extra != "none":
        kwargs["additional_config"] = json.loads(extra)
    llm = LLM(model, **kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    sp = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
    res: dict = {"scenario": scenario}
    rpc = llm.collective_rpc
    def state():
        st = rpc("kunserve_state")[0]
        st["kv_blocks_total"] = st["capacity"]["blocks_total"]
        st["kv_blocks_base"] = st["capacity"]["blocks_base"]
        return st

    def outcomes(st):
        return [(e["event"], e["outcome"]) for e in st["events"] if e["outcome"] != "draining"]

    if scenario == "identity":
        rpc("kunserve_auto", args=(False,))
        ps = prompts(vocab)[:4]
        base = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        runs = []
        for alpha, slots in ((1, 1), (2, 1), (2, 2), (3, 2)):
            ev = rpc("kunserve_remap", kwargs={"alpha": alpha, "slots": slots})[0]
            st = state()
            from prometheus_client import REGISTRY

            gauges = {k: REGISTRY.get_sample_value(f"kunserve:{k}", {"engine": "0"})
                      for k in ("remapped_layers", "kv_blocks_total", "kv_blocks_base")}
            ngb = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
            usage = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_usage()
            out = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            w_gen = state()["workers"][0]
            rev = rpc("kunserve_revert")[0]
            st2 = state()
            runs.append({"alpha": alpha, "slots": slots, "remap": ev["outcome"], "revert": rev["outcome"],
                         "layers": st["remapped_layers"], "blocks": st["kv_blocks_total"],
                         "blocks_after": st2["kv_blocks_total"], "same": out == base, "gauges": gauges,
                         "usage_idle": usage, "num_gpu_blocks": ngb,
                         "copies": w_gen["stream"]["copies"] if w_gen["stream"] else 0,
                         "streamed_linear": w_gen["streamed_linear"],
                         "problems": rpc("kunserve_check")[0]["problems"]})
        res.update(runs=runs, base_blocks=st2["kv_blocks_base"])
    elif scenario == "faults":
        rpc("kunserve_auto", args=(False,))
        ps = prompts(vocab)[:4]
        base = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        steps = []
        remap_steps = ("rpc", "pack", "release", "slot_create", "streamer_install", "copy_plan", "map", "exhausted")
        for step in remap_steps:
            rpc("kunserve_inject_fault", args=(step,))
            ev = rpc("kunserve_remap", kwargs={"alpha": 2, "slots": 2})[0]
            out = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            st = state()
            steps.append({"op": "remap", "step": step, "outcome": ev["outcome"], "same": out == base,
                          "phase": st["phase"], "problems": rpc("kunserve_check")[0]["problems"],
                          "blocks": st["kv_blocks_total"], "base": st["kv_blocks_base"]})
        for step in ("kv_shrink", "streamer_uninstall", "slot_destroy", "reload", "rpc"):
            ok = rpc("kunserve_remap", kwargs={"alpha": 2, "slots": 2})[0]
            rpc("kunserve_inject_fault", args=(step,))
            ev = rpc("kunserve_revert")[0]
            out = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            st = state()
            rec = {"op": "revert", "step": step, "remap": ok["outcome"], "outcome": ev["outcome"],
                   "same": out == base, "phase": st["phase"], "problems": rpc("kunserve_check")[0]["problems"]}
            rec["revert_after"] = rpc("kunserve_revert")[0]["outcome"]
            rec["phase_after"] = state()["phase"]
            steps.append(rec)
        final = rpc("kunserve_remap", kwargs={"alpha": 3, "slots": 1})[0]["outcome"]
        out = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        res.update(steps=steps, final_remap=final, final_same=out == base,
                   final_revert=rpc("kunserve_revert")[0]["outcome"], final_phase=state()["phase"],
                   final_problems=rpc("kunserve_check")[0]["problems"])
    else:
        if scenario.startswith("fault-"):
            rpc("kunserve_inject_fault", args=(scenario.split("-", 1)[1],))
        if scenario == "controller":
            rpc("kunserve_inject_fault", args=("policy",), kwargs={"after": 3})
        st0 = state() if extra != "none" else None
        outs = llm.generate(prompts(vocab), sp, use_tqdm=False)
        res.update(completed=sum(1 for o in outs if len(o.outputs[0].token_ids) == OUTPUT),
                   tokens=[list(o.outputs[0].token_ids) for o in outs],
                   preemptions=preemptions(llm),
                   num_gpu_blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
        if st0 is not None:
            st1 = state()
            from prometheus_client import REGISTRY

            res.update(blocks_before=st0["kv_blocks_total"], blocks_after=st1["kv_blocks_total"],
                       phase_after=st1["phase"], events=outcomes(st1), errors=st1["errors"],
                       controller_errors=REGISTRY.get_sample_value(
                           "kunserve:controller_errors_total", {"engine": "0", "where": "tick"}),
                       max_blocks_seen=max([e.get("blocks_after", 0) for e in st1["events"]] + [0]),
                       layers_resident=all(not w["remapped_layers"] for w in st1["workers"]),
                       problems=rpc("kunserve_check")[0]["problems"])
    print("PROBE_RESULT " + json.dumps(res), flush=True)
