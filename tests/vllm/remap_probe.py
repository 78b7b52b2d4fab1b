"""Remap scenarios on a real vLLM-CPU engine, one engine per process; prints one JSON line.

Usage: python remap_probe.py MODEL SCENARIO[,SCENARIO...] KV_BYTES [ADDITIONAL_CONFIG_JSON|none]
(several scenarios run in turn on one engine, each as on a fresh one: its own events and preemptions,
no cached prefixes, no failure backoff; the JSON line then maps each scenario to its facts)
Scenarios: identity (greedy outputs with remap forced at several alpha/slots vs off),
           burst (16 requests at once; preemptions, capacity before/after),
           fault-<step> (a burst whose automatic remap fails at <step>),
           faults (every step of remap and revert fails once, in turn; outputs compared),
           faults-tp2 (the same on a TP=2 engine, two worker processes; each fault armed on rank 1
           only, so rank 0 completes its half of the transition and must be rolled back),
           controller (the policy raises mid-burst),
           liveness (a large forced remap, a burst that uses the grown capacity, then demand cut to
           and held at ~0.4x the base KV: when each revert completes, outputs vs a run without remap).
"""

import json
import os
import sys
import time

N_REQ, PROMPT, OUTPUT = 16, 160, 80
#: liveness: net layers remapped (6 of 8 streamed with one slot), output tokens per request (each
#: then needs 7 blocks of 32 tokens), requests held after the cut (5 x 7 blocks: ~0.4x the 87 usable
#: base blocks), requests that replace finished ones, and the longest wait for the revert
LIVE_ALPHA, LIVE_OUTPUT, LIVE_HELD, LIVE_STEADY, LIVE_WAIT_S = 5, 40, 5, 32, 60.0


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
    scenarios = scenario.split(",")
    tp = 2 if "faults-tp2" in scenarios else 1
    if tp > 1:  # one core per worker process (vLLM-CPU's auto binding wants a NUMA node per worker)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    from vllm import LLM, SamplingParams

    kwargs = dict(dtype="float32", distributed_executor_backend="mp" if tp > 1 else "uni", enforce_eager=True,
                  seed=0, max_model_len=512, block_size=32, kv_cache_memory_bytes=kv_bytes, max_num_seqs=32,
                  disable_log_stats=False, tensor_parallel_size=tp)
    if extra != "none":
        kwargs["additional_config"] = json.loads(extra)
    llm = LLM(model, **kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    sp = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
    rpc = llm.collective_rpc
    def state():
        st = rpc("kunserve_state")[0]
        st["kv_blocks_total"] = st["capacity"]["blocks_total"]
        st["kv_blocks_base"] = st["capacity"]["blocks_base"]
        return st

    def outcomes(st):
        return [(e["event"], e["outcome"]) for e in st["events"] if e["outcome"] != "draining"]

    core = llm.llm_engine.engine_core.engine_core

    def run(scenario: str) -> dict:
        """One scenario on the engine as it stands; returns its facts."""
        res: dict = {"scenario": scenario}
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
                usage = core.scheduler.kv_cache_manager.block_pool.get_usage()
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
        elif scenario in ("faults", "faults-tp2"):
            rpc("kunserve_auto", args=(False,))
            ps = prompts(vocab)[:4]
            base = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            steps = []
            where = {"rank": tp - 1} if tp > 1 else {}  # the last worker fails, the others succeed

            def arm(step):
                armed = rpc("kunserve_inject_fault", args=(step,), kwargs=where)[0]
                return [w["rank"] for w in armed["workers"] if w["armed"]]

            def ranks(st):  # each worker's (rank, layer states, mapped blocks): ranks must agree
                return [(w["rank"], w["layers"], w["mapped_blocks"]) for w in st["workers"]]

            remap_steps = ("rpc", "pack", "release", "slot_create", "streamer_install", "copy_plan", "map", "exhausted")
            for step in remap_steps:
                armed = arm(step)
                ev = rpc("kunserve_remap", kwargs={"alpha": 2, "slots": 2})[0]
                out = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
                st = state()
                steps.append({"op": "remap", "step": step, "outcome": ev["outcome"], "same": out == base,
                              "phase": st["phase"], "problems": rpc("kunserve_check")[0]["problems"],
                              "blocks": st["kv_blocks_total"], "base": st["kv_blocks_base"], "armed": armed,
                              "workers": ranks(st)})
            for step in ("kv_shrink", "streamer_uninstall", "slot_destroy", "reload", "rpc"):
                ok = rpc("kunserve_remap", kwargs={"alpha": 2, "slots": 2})[0]
                before = ranks(state())
                armed = arm(step)
                ev = rpc("kunserve_revert")[0]
                out = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
                st = state()
                rec = {"op": "revert", "step": step, "remap": ok["outcome"], "outcome": ev["outcome"],
                       "same": out == base, "phase": st["phase"], "problems": rpc("kunserve_check")[0]["problems"],
                       "armed": armed, "workers_before": before, "workers": ranks(st)}
                rec["revert_after"] = rpc("kunserve_revert")[0]["outcome"]
                rec["phase_after"] = state()["phase"]
                steps.append(rec)
            final = rpc("kunserve_remap", kwargs={"alpha": 3, "slots": 1})[0]["outcome"]
            out = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            res.update(steps=steps, final_remap=final, final_same=out == base, tp=tp,
                       worker_pids=sorted({w["pid"] for w in state()["workers"]}),
                       final_revert=rpc("kunserve_revert")[0]["outcome"], final_phase=state()["phase"],
                       final_problems=rpc("kunserve_check")[0]["problems"])
        elif scenario == "liveness":
            import random

            agent, eng = core._kunserve, llm.llm_engine
            kcm, bs = core.scheduler.kv_cache_manager, llm.llm_engine.vllm_config.cache_config.block_size
            rng = random.Random(11)
            everything = prompts(vocab) + [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(PROMPT)]}
                                           for _ in range(LIVE_STEADY)]
            live_sp = SamplingParams(max_tokens=LIVE_OUTPUT, temperature=0, ignore_eos=True)
            rpc("kunserve_auto", args=(False,))
            # the reference: the same prompts on the same engine before any remap (batches that fit)
            ref = [list(o.outputs[0].token_ids) for k in range(0, len(everything), 8)
                   for o in llm.generate(everything[k:k + 8], live_sp, use_tqdm=False)]
            llm.reset_prefix_cache()
            base = state()["kv_blocks_base"]
            remap = rpc("kunserve_remap", kwargs={"alpha": LIVE_ALPHA, "slots": 1})[0]
            rpc("kunserve_auto", args=(True,))
            internal, added, finished, out = {}, {}, {}, {}  # by request id "r<k>"

            def add(k):
                p = everything[k % len(everything)]  # prompts come round again if the engine is fast
                internal[f"r{k}"], added[f"r{k}"] = eng.add_request(f"r{k}", p, live_sp), time.monotonic()

            def step():
                for o in eng.step():
                    if o.finished:
                        out[o.request_id], finished[o.request_id] = list(o.outputs[0].token_ids), time.monotonic()

            def top_blocks():
                return {rid: max(kcm.get_block_ids(i)[0], default=-1)
                        for rid, i in internal.items() if rid not in finished}

            for k in range(N_REQ):
                add(k)
            # the burst runs in the grown capacity until enough requests hold blocks above the base
            while sum(b >= base for b in top_blocks().values()) < LIVE_HELD:
                step()
            peak = state()
            # cut demand to ~0.4x the base, keeping the requests with the highest blocks (they drain last)
            top = top_blocks()
            ranked = sorted(top, key=lambda rid: -top[rid])
            keep, cut = ranked[:LIVE_HELD], ranked[LIVE_HELD:]
            eng.abort_request([internal[rid] for rid in cut], internal=True)
            t0, wall0 = time.monotonic(), time.time()
            nxt, ratios, agent_ratios, t_base = N_REQ, [], [], None
            while time.monotonic() - t0 < LIVE_WAIT_S:
                step()
                live = [rid for rid in internal if rid not in finished and rid not in cut]
                for _ in range(LIVE_HELD - len(live)):  # hold demand: replace each finished request
                    add(nxt)
                    nxt += 1
                # demand: blocks the live requests need to finish (the agent's own count misses
                # blocks that are draining), over the usable base
                reqs = list(core.scheduler.running) + list(core.scheduler.waiting)
                ratios.append(sum(-(-(r.num_prompt_tokens + r.max_tokens) // bs) for r in reqs) / (base - 1))
                agent_ratios.append(agent.load().demand_blocks / (base - 1))
                if agent.phase == "base" and not agent.remapped:
                    t_base = time.monotonic() - t0
                    break
            while eng.has_unfinished_requests():  # serve the rest at base capacity
                step()
            st = state()
            reverts, begin = [], None
            for e in agent.events:
                if e["event"] == "revert" and e["outcome"] == "draining":
                    begin = e
                elif e["event"] == "revert" and e["outcome"] == "ok":
                    reverts.append({"begin": round(begin["time"] - wall0, 3), "end": round(e["time"] - wall0, 3),
                                    "draining_blocks": begin["draining"], "returned": len(e["layers"]),
                                    "kept": len(e["kept"]), "transition_ms": e["ms"]})
            lifetimes = [finished[rid] - added[rid] for rid in finished]
            res.update(remap=remap["outcome"], remapped=len(remap["layers"]), base=base,
                       blocks_peak=peak["kv_blocks_total"], held_top_blocks=[top[rid] for rid in keep],
                       hold_s=agent.cfg.remap.revert_hold_s, t_base=t_base, reverts=reverts,
                       events=[e for e in outcomes(st) if e[0] != "remap"], errors=st["errors"],
                       ratio_min=min(ratios), ratio_max=max(ratios), agent_ratio_min=min(agent_ratios),
                       max_lifetime_s=max(lifetimes),
                       step_ms=sorted(agent.step_ms)[len(agent.step_ms) // 2], served=sorted(out),
                       aborted=sorted(cut), same=all(out[rid] == ref[int(rid[1:]) % len(ref)] for rid in out),
                       complete=all(len(t) == LIVE_OUTPUT for t in out.values()), phase_after=st["phase"],
                       blocks_after=st["kv_blocks_total"], problems=rpc("kunserve_check")[0]["problems"],
                       preemptions=preemptions(llm))
        else:
            if scenario.startswith("fault-"):
                rpc("kunserve_inject_fault", args=(scenario.split("-", 1)[1],))
            if scenario == "controller":
                rpc("kunserve_inject_fault", args=("policy",), kwargs={"after": 3})
            st0 = state() if extra != "none" else None
            t0, pre0 = time.time(), preemptions(llm)   # this scenario's events and preemptions only
            outs = llm.generate(prompts(vocab), sp, use_tqdm=False)
            res.update(completed=sum(1 for o in outs if len(o.outputs[0].token_ids) == OUTPUT),
                       tokens=[list(o.outputs[0].token_ids) for o in outs],
                       preemptions=preemptions(llm) - pre0,
                       num_gpu_blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
            if st0 is not None:
                st1 = state()
                st1["events"] = [e for e in st1["events"] if e["time"] >= t0]
                from prometheus_client import REGISTRY

                res.update(blocks_before=st0["kv_blocks_total"], blocks_after=st1["kv_blocks_total"],
                           phase_after=st1["phase"], events=outcomes(st1), errors=st1["errors"],
                           controller_errors=REGISTRY.get_sample_value(
                               "kunserve:controller_errors_total", {"engine": "0", "where": "tick"}),
                           max_blocks_seen=max([e.get("blocks_after", 0) for e in st1["events"]] + [0]),
                           layers_resident=all(not w["remapped_layers"] for w in st1["workers"]),
                           problems=rpc("kunserve_check")[0]["problems"])
        return res

    results = {}
    for n, name in enumerate(scenarios):
        if n:  # the next scenario starts as on a fresh engine: no backoff, no cached prefixes, auto on
            assert state()["phase"] == "base", f"{scenarios[n - 1]} left the engine {state()['phase']}"
            time.sleep(max(0.0, core._kunserve.backoff_until - time.monotonic()))
            llm.reset_prefix_cache()
            rpc("kunserve_auto", args=(True,))
        t = time.monotonic()
        results[name] = {**run(name), "wall_s": round(time.monotonic() - t, 2)}
    print("PROBE_RESULT " + json.dumps(results if len(scenarios) > 1 else results[scenarios[0]]), flush=True)
