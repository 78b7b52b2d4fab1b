"""Group transitions of two in-process vLLM-CPU engines with a fault at each step; one JSON line.

Usage: python group_fault_probe.py MODEL KV_BYTES

For every step of a join (the residency's ``release``, ``foreign_create``, ``exchange``, ``kv_free``
and the pipeline's ``connect``, ``barrier``, ``kv_chunk``, ``grown``) one member is armed to fail
there and both are asked to join (through the engine agent, as the control port does). Then, and
after a leave with a fault at each of its steps (``kv_shrink``, ``reload``, ``kv_regrow``,
``exchange``, ``foreign_destroy``, ``leave_barrier``), every member must be serving with either its
pre-transition layout or the completed one, its invariants intact, and greedy outputs the same
tokens as before any group. A member left in a group its peer did not join abandons it
(``group_leave`` ``abandon``), as the cluster's controller does.
"""

import json
import os
import sys
import time

from engine_pair import both, group_engines, half_plans

PROMPTS, OUTPUT = 4, 16
JOIN_FAULTS = [("release", 0, 0), ("connect", 1, 0), ("barrier", 0, 0), ("foreign_create", 1, 0),
               ("exchange", 0, 0), ("kv_chunk", 1, 1), ("kv_free", 0, 0), ("grown", 1, 0)]
LEAVE_FAULTS = [("kv_shrink", 0, 0), ("reload", 1, 1), ("kv_regrow", 0, 0), ("leave_barrier", 1, 0),
                ("exchange", 1, 0), ("kv_chunk", 0, 0), ("foreign_destroy", 0, 0)]
TIMEOUT_S = 15


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    model, kv_bytes = sys.argv[1], int(sys.argv[2])
    engines = group_engines(model, kv_bytes, LLM)
    import random
    rnd = random.Random(1)
    prompts = [{"prompt_token_ids": [rnd.randrange(10, 250) for _ in range(30 + 11 * i)]} for i in range(PROMPTS)]
    sp = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    def rpc(i, method, **kw):
        return engines[i].collective_rpc(method, kwargs=kw)[0]

    def both_(method, kwargs):
        return both(engines, method, kwargs)

    def snap(i):
        s = rpc(i, "kunserve_state")
        return {"phase": s["phase"], "dropped": s["dropped_layers"], "blocks": s["capacity"]["blocks_total"],
                "problems": rpc(i, "kunserve_check")["problems"]}

    before = [run(e) for e in engines]
    base = [snap(i) for i in range(2)]
    st = [rpc(i, "kunserve_state") for i in range(2)]
    L = len(st[0]["layers"])
    plans = half_plans(st, L)
    for p in plans:
        p["timeout_s"] = TIMEOUT_S
    n = [0]

    def join(tag):
        n[0] += 1
        return both_("kunserve_group_join", [{**p, "join_id": f"{tag}{n[0]}"} for p in plans])

    def leave(tag, sources=("peer", "host")):
        for i in range(2):
            rpc(i, "kunserve_group_leave", step="begin")
        n[0] += 1
        return both_("kunserve_group_leave", [{"step": "finish", "source": s, "timeout_s": TIMEOUT_S,
                                               "leave_id": f"{tag}{n[0]}"} for s in sources])

    def settle(outs):
        """Abandon where one member joined and the other did not (the controller's rule)."""
        ok = [i for i in range(2) if "error" not in outs[i]]
        if len(ok) == 1:
            rpc(ok[0], "kunserve_group_leave", step="abandon", reason="partial join (probe)")
        return ok

    res = {"layers": L, "base": base, "join": [], "leave": []}
    for step, who, after in JOIN_FAULTS:
        rpc(who, "kunserve_inject_fault", step=step, after=after)
        t0 = time.monotonic()
        outs = join("j")
        dt = time.monotonic() - t0
        ok = settle(outs)
        rpc(0, "kunserve_inject_fault", step="clear")
        rpc(1, "kunserve_inject_fault", step="clear")
        mid = [snap(i) for i in range(2)]
        same_mid = [run(e) == b for e, b in zip(engines, before)]
        if len(ok) == 2:  # completed: leave cleanly, then it must be as before
            lv = leave("jl")
        else:
            lv = None
        end = [snap(i) for i in range(2)]
        res["join"].append({"step": step, "member": who, "after": after, "seconds": round(dt, 2),
                            "outcomes": ["ok" if "error" not in o else o["error"] for o in outs],
                            "completed": len(ok) == 2, "partial": len(ok) == 1, "mid": mid, "same_mid": same_mid,
                            "clean_leave": None if lv is None else ["ok" if "error" not in o else o["error"] for o in lv],
                            "end": end, "same_end": [run(e) == b for e, b in zip(engines, before)]})
        print("join fault", step, res["join"][-1]["outcomes"], f"{dt:.1f}s", flush=True)

    for step, who, after in LEAVE_FAULTS:
        outs = join("g")
        assert all("error" not in o for o in outs), outs
        rpc(who, "kunserve_inject_fault", step=step, after=after)
        t0 = time.monotonic()
        lv = leave("l")
        dt = time.monotonic() - t0
        rpc(0, "kunserve_inject_fault", step="clear")
        rpc(1, "kunserve_inject_fault", step="clear")
        mid = [snap(i) for i in range(2)]
        same_mid = [run(e) == b for e, b in zip(engines, before)]
        ok = [i for i in range(2) if "error" not in lv[i]]
        again = None
        if len(ok) < 2:
            # a failed leave rolled back: still grouped where the leave failed; a member whose leave
            # completed while its peer's failed has its own layers back: the peer abandons
            grouped = [i for i in range(2) if mid[i]["phase"] != "base"]
            if len(grouped) == 2:  # both rolled back: the next leave (begin, finish) completes
                again = leave("la", ("host", "host"))
            for i in grouped if len(grouped) == 1 else []:
                rpc(i, "kunserve_group_leave", step="abandon", reason="peer left (probe)")
        end = [snap(i) for i in range(2)]
        res["leave"].append({"step": step, "member": who, "after": after, "seconds": round(dt, 2),
                             "outcomes": ["ok" if "error" not in o else o["error"] for o in lv],
                             "mid": mid, "same_mid": same_mid,
                             "again": None if again is None else ["ok" if "error" not in o else o["error"] for o in again],
                             "end": end, "same_end": [run(e) == b for e, b in zip(engines, before)]})
        print("leave fault", step, res["leave"][-1]["outcomes"], f"{dt:.1f}s", flush=True)
    print("PROBE_RESULT " + json.dumps(res))
    for e in engines:
        e.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
