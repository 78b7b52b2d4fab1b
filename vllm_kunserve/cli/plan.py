"""``kunserve plan KIND INPUT``: run one policy decision on a JSON input and print JSON.

KIND is drop, restore, microbatch, remap, placement, migrate or chunk; INPUT is a file or ``-`` for
stdin. Schemas: docs/policy.md. Decisions can so be inspected and replayed offline.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

KINDS = ("drop", "restore", "microbatch", "remap", "placement", "migrate", "chunk")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="policy decisions as JSON in/out: drop, restore, microbatch, remap, placement",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS, help="which decision")
    p.add_argument("input", help="JSON input file, or - for stdin (schemas in docs/policy.md)")
    p.add_argument("--indent", type=int, default=2, help="JSON indent (0: one line)")
    p.set_defaults(func=run)


def read_json(path: str) -> Any:
    if path == "-":
        text, name = sys.stdin.read(), "<stdin>"
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text, name = f.read(), path
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such input file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None


def _config(d: dict):
    from vllm_kunserve.config import parse_config

    return parse_config(d.get("config") or {})


def _cost_model(d: dict, where: str = "cost_model"):
    from vllm_kunserve.policy.costmodel import CostModel, default_model

    raw = d.get("cost_model")
    if raw is None:
        return default_model()
    if isinstance(raw, str):
        return CostModel.load(raw)
    return CostModel.from_dict(raw, where)


def plan_drop(d: dict) -> dict:
    from vllm_kunserve.policy import ClusterSnapshot, assess_overload, plan_drop as _plan
    from vllm_kunserve.policy._schema import get

    cfg = _config(d).drop
    cluster = ClusterSnapshot.from_dict(get(d, "cluster", dict, ""), "cluster")
    report = assess_overload(cluster, cfg)
    need = get(d, "need_bytes", float, "", report.need_bytes, lo=0.0)
    out = {"overload": report.to_dict()}
    # live groups merge further only with drop.regroup, as in the fleet
    out["plan"] = _plan(cluster, need, cfg.max_group_size, regroup=cfg.regroup).to_dict() if need > 0 else None
    return out


def plan_restore(d: dict) -> dict:
    from vllm_kunserve.policy import ClusterSnapshot, RestoreState, decide_restore
    from vllm_kunserve.policy._schema import get

    cfg = _config(d)
    cluster = ClusterSnapshot.from_dict(get(d, "cluster", dict, ""), "cluster")
    st = get(d, "state", dict, "", {})
    state = RestoreState(get(st, "below_since", float, "state", None))
    dec, new = decide_restore(cluster, state, cfg.restore, cfg.drop)
    return {"decision": dec.to_dict(), "state": {"below_since": new.below_since}}


def plan_microbatch(d: dict) -> dict:
    from vllm_kunserve.policy import (RequestSnapshot, lookahead_microbatches, pipeline_bubble,
                                      token_count_microbatches, work_from_requests)
    from vllm_kunserve.policy._schema import get, need_list

    cfg = _config(d).lookahead
    reqs = [RequestSnapshot.from_dict(r, f"requests[{k}]")
            for k, r in enumerate(need_list(get(d, "requests", list, ""), "requests"))]
    model = _cost_model(d)
    parts = get(d, "parts", int, "", 4, lo=1)
    stages = get(d, "stages", int, "", parts, lo=1)
    method = get(d, "method", str, "", "lookahead" if cfg.enable else "token_count")
    if method not in ("lookahead", "token_count"):
        raise ValueError(f"method={method!r}: choose lookahead or token_count")
    min_tokens = get(d, "min_tokens", int, "", cfg.min_tokens, lo=1)
    work = work_from_requests(reqs)
    mine = (lookahead_microbatches if method == "lookahead" else token_count_microbatches)(work, model, parts, min_tokens)
    other = (token_count_microbatches if method == "lookahead" else lookahead_microbatches)(work, model, parts, min_tokens)
    return {"method": method, "microbatches": [m.to_dict() for m in mine],
            "bubble": pipeline_bubble([m.cost for m in mine], stages),
            "other_method_bubble": pipeline_bubble([m.cost for m in other], stages)}


def plan_remap(d: dict) -> dict:
    from vllm_kunserve.policy import RemapInput, RemapState, decide_remap
    from vllm_kunserve.policy._schema import get

    cfg = _config(d).remap
    inp = RemapInput.from_dict(d, "input")
    st = get(d, "state", dict, "", {})
    plan, new = decide_remap(inp, cfg, RemapState(get(st, "low_since", float, "state", None)))
    return {"plan": plan.to_dict(), "state": {"low_since": new.low_since}}


def plan_placement(d: dict) -> dict:
    from vllm_kunserve.policy import lower_bound_l2, make_placer
    from vllm_kunserve.policy._schema import get, need_list, need_mapping

    cfg = _config(d).placement
    policy = get(d, "policy", str, "", cfg.policy)
    if policy not in ("mell", "best_fit", "worst_fit", "llumnix"):
        raise ValueError(f"policy={policy!r}: choose mell, best_fit, worst_fit or llumnix")
    cap = get(d, "capacity", float, "", lo=1e-9)
    placer = make_placer(policy, cap, get(d, "max_migrations", int, "", cfg.max_migrations, lo=0))
    ops = []
    for k, o in enumerate(need_list(get(d, "ops", list, ""), "ops")):
        w = f"ops[{k}]"
        o = need_mapping(o, w)
        kind = get(o, "op", str, w)
        rid = str(get(o, "request_id", (str, int), w))
        if kind == "allocate":
            ops.append(("allocate", rid, get(o, "size", float, w, lo=0.0), get(o, "affinity", int, w, None)))
        elif kind == "update":
            ops.append(("update", rid, get(o, "size", float, w, lo=0.0)))
        elif kind == "depart":
            ops.append(("depart", rid))
        else:
            raise ValueError(f"{w}.op={kind!r}: choose allocate, update or depart")
    results = []
    if get(d, "batch", bool, "", False):
        results = placer.apply_batch(ops)
    else:
        for o in ops:
            fn: Callable = getattr(placer, o[0])
            results.append(fn(*o[1:]))
    sizes = placer.sizes()
    bins = placer.bins
    instances = {str(b): ({r: s for u in v.values() for r, s in u.members.items()} if policy == "mell" else dict(v))
                 for b, v in sorted(bins.items())}
    return {"policy": policy, "results": [r.to_dict() for r in results], "instances": instances,
            "instances_used": placer.instances_used(), "lower_bound": lower_bound_l2(sizes, cap),
            "migrations": sum(len(r.migrations) for r in results)}


def plan_migrate(d: dict) -> dict:
    from vllm_kunserve.policy import MoveCandidate, choose_migration
    from vllm_kunserve.policy._schema import get, need_list, need_mapping

    cands = []
    for k, c in enumerate(need_list(get(d, "candidates", list, ""), "candidates")):
        w = f"candidates[{k}]"
        c = need_mapping(c, w)
        cands.append(MoveCandidate(str(get(c, "request_id", (str, int), w)), get(c, "src", int, w),
                                   get(c, "dst", int, w), get(c, "kv_bytes", float, w, lo=0.0),
                                   get(c, "tokens", int, w, lo=0)))
    links = {}
    for k, l in enumerate(need_list(get(d, "link_budget_bytes", list, "", []), "link_budget_bytes")):
        w = f"link_budget_bytes[{k}]"
        l = need_mapping(l, w)
        links[(get(l, "src", int, w), get(l, "dst", int, w))] = get(l, "bytes", float, w, lo=0.0)
    comp = {}
    for key, v in need_mapping(get(d, "compute_budget_ms", dict, "", {}), "compute_budget_ms").items():
        try:
            comp[int(key)] = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"compute_budget_ms.{key}={v!r}: expected instance id -> milliseconds") from None
    choices = choose_migration(cands, links, comp, get(d, "link_bytes_per_s", float, "", lo=1.0), _cost_model(d))
    return {"choices": [{"request_id": c.request_id, "method": c.method, "time_s": c.time_s} for c in choices]}


def plan_chunk(d: dict) -> dict:
    from vllm_kunserve.policy import Link, chunk_bytes
    from vllm_kunserve.policy._schema import get

    link = Link(get(d, "link_bytes_per_s", float, "", lo=1.0), get(d, "latency_s", float, "", 0.0, lo=0.0))
    stage = get(d, "stage_time_s", float, "", lo=1e-9)
    n = chunk_bytes(link, stage, get(d, "align", int, "", 1, lo=1))
    return {"chunk_bytes": n, "chunk_time_s": link.time_s(n), "stage_time_s": stage}


HANDLERS = {"drop": plan_drop, "restore": plan_restore, "microbatch": plan_microbatch, "remap": plan_remap,
            "placement": plan_placement, "migrate": plan_migrate, "chunk": plan_chunk}


def run(args: argparse.Namespace) -> int:
    from vllm_kunserve.policy._schema import need_mapping

    doc = need_mapping(read_json(args.input), "input")
    out = HANDLERS[args.kind](dict(doc))
    print(json.dumps(out, indent=args.indent or None, sort_keys=False))
    return 0
