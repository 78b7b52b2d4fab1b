"""Two in-process vLLM-CPU engines pull both memory levers in the order ``policy.levers`` gives: each
remaps first (streams some layers, their memory becomes KV), then the two join a pipeline group from
there (a streamed layer the peer runs is dropped, the others stream on), leave it (back remapped by
the layers each kept streaming) and revert; before that, a group joined from remapped is abandoned
by both (a lost peer). Prints one JSON line.

Usage: python levers_probe.py MODEL KV_BYTES

Greedy outputs of the same prompts are recorded at each stage. Before the good join, a join with a
fault at the residency's ``unstream`` step (engine b) and one at ``streamer_install`` (engine a) must
leave both engines remapped as they were (a member that joined abandons, as the controller does).
"""

import json
import os
import sys

from engine_pair import both, group_engines, half_plans

PROMPTS, OUTPUT = 5, 20
TIMEOUT_S = 15
# the agents' own decisions stay on (they publish their remap room), held off by an hour-long revert hold
EXTRA = {"remap": {"enable": True, "max_fraction": 0.75, "h2d_bandwidth_gbps": 50.0, "revert_hold_s": 3600.0}}


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    model, kv_bytes = sys.argv[1], int(sys.argv[2])
    engines = group_engines(model, kv_bytes, LLM, extra=EXTRA)
    import random
    rnd = random.Random(2)
    prompts = [{"prompt_token_ids": [rnd.randrange(10, 250) for _ in range(30 + 17 * i)]} for i in range(PROMPTS)]
    sp = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    def rpc(i, method, *args, **kw):
        return engines[i].collective_rpc(method, args=args, kwargs=kw)[0]

    def snap(i):
        s = rpc(i, "kunserve_state")
        return {"phase": s["phase"], "streamed": s["remapped_layers"], "slots": s["slots"],
                "dropped": s["dropped_layers"], "blocks": s["capacity"]["blocks_total"],
                "room": s["remap_room_bytes"], "problems": rpc(i, "kunserve_check")["problems"]}

    before = [run(e) for e in engines]
    stages = {"base": [snap(i) for i in range(2)]}
    L = len(rpc(0, "kunserve_state")["layers"])
    # lever 1: each engine remaps (evenly spaced layers: both halves hold some)
    remaps = [rpc(i, "kunserve_remap", alpha=2, slots=1) for i in range(2)]
    stages["remapped"] = [snap(i) for i in range(2)]
    same = {"remapped": [run(e) == b for e, b in zip(engines, before)]}
    st = [rpc(i, "kunserve_state") for i in range(2)]
    plans = half_plans(st, L)
    for p in plans:
        p["timeout_s"] = TIMEOUT_S
    faults = []
    for k, (who, step) in enumerate(((1, "unstream"), (0, "streamer_install"))):
        rpc(who, "kunserve_inject_fault", step=step)
        outs = both(engines, "kunserve_group_join", [{**p, "join_id": f"f{k}"} for p in plans])
        rpc(0, "kunserve_inject_fault", step="clear")
        rpc(1, "kunserve_inject_fault", step="clear")
        ok = [i for i in range(2) if "error" not in outs[i]]
        if len(ok) == 1:   # the controller's rule: a member whose peer did not join abandons
            rpc(ok[0], "kunserve_group_leave", step="abandon", reason="partial join (probe)")
        faults.append({"step": step, "who": who, "errors": ["error" in o for o in outs],
                       "after": [snap(i) for i in range(2)],
                       "same": [run(e) == b for e, b in zip(engines, before)]})
    # lever 2: the group, joined from remapped
    joins = both(engines, "kunserve_group_join", [{**p, "join_id": "j"} for p in plans])
    stages["grouped"] = [snap(i) for i in range(2)]
    same["grouped"] = [run(e) == b for e, b in zip(engines, before)]
    # down: the group goes first, the remap after
    for i in range(2):
        rpc(i, "kunserve_group_leave", step="begin")
    leaves = both(engines, "kunserve_group_leave", [{"step": "finish", "source": s, "timeout_s": TIMEOUT_S,
                                                     "leave_id": "l"} for s in ("peer", "host")])
    stages["left"] = [snap(i) for i in range(2)]
    same["left"] = [run(e) == b for e, b in zip(engines, before)]
    reverts = [rpc(i, "kunserve_revert") for i in range(2)]
    import time
    for _ in range(100):   # a revert drains first (the blocks above the base), then finishes on a tick
        if all(rpc(i, "kunserve_state")["phase"] == "base" for i in range(2)):
            break
        for e in engines:
            run(e)
        time.sleep(0.05)
    stages["reverted"] = [snap(i) for i in range(2)]
    same["reverted"] = [run(e) == b for e, b in zip(engines, before)]
    # remapped again, a group joined from there whose peer is lost: each member abandons it (layers back
    # from the host copies, requests recomputed) and is remapped by the layers it kept streaming
    [rpc(i, "kunserve_remap", alpha=2, slots=1) for i in range(2)]
    stages["remapped2"] = [snap(i) for i in range(2)]
    st = [rpc(i, "kunserve_state") for i in range(2)]
    plans2 = half_plans(st, L)
    abandon_joins = both(engines, "kunserve_group_join", [{**p, "timeout_s": TIMEOUT_S, "join_id": "a"} for p in plans2])
    abandons = [rpc(i, "kunserve_group_leave", step="abandon", reason="peer lost (probe)") for i in range(2)]
    stages["abandoned"] = [snap(i) for i in range(2)]
    same["abandoned"] = [run(e) == b for e, b in zip(engines, before)]
    print("PROBE_RESULT " + json.dumps({
        "layers": L, "remaps": remaps, "joins": joins, "abandon_joins": abandon_joins, "abandons": abandons, "leaves": leaves, "reverts": reverts, "faults": faults,
        "stages": stages, "same": same, "plans": [p["drop"] for p in plans]}), flush=True)
    for e in engines:
        e.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
