"""A multi-model fleet's memory moves (issue 73): the decision (policy.tenancy), the fleet file, the
router's dispatch by model and its merged metrics."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from vllm_kunserve.cluster.fleet.fleetfile import from_models, parse_fleet
from vllm_kunserve.cluster.frontend.models import ModelRouter, add_label
from vllm_kunserve.config import RemapConfig, TenancyConfig
from vllm_kunserve.policy.remap import ModelLayers, lend_plan
from vllm_kunserve.policy.tenancy import (TenancyState, TenancyView, TenantEngine, TenantModel, decide_tenancy,
                                          host_free_bytes)

pytestmark = pytest.mark.unit

MB = 1 << 20
CFG = TenancyConfig(idle_s=30.0, repay_hold_s=5.0)


def layers(name, prio=None, prefill_ms=2.0):
    # 16 layers of 64 MB; a decode layer 0.5 ms, a prefill layer 2 ms; 32 GB/s: a layer streams in 2 ms
    return ModelLayers(name, 16, 64 * MB, 0.5, prefill_ms, priority=prio)


def engine(model, **kw):
    d = dict(key=f"{model}#0", model=model, host="h", ready=True, phase="base", demand_blocks=10,
             capacity_blocks=100, base_blocks=100, max_blocks=400, block_bytes=MB, held_bytes=1500 * MB,
             home_bytes=1500 * MB, round_bytes=4 * MB)
    d.update(kw)
    return TenantEngine(**d)


def view(models, engines, now=100.0):
    return TenancyView(tuple(models), tuple(engines), 32e9, True, now)


def test_an_idle_model_lends_down_to_the_threshold_its_next_prefill_streams_in_time():
    ms = [TenantModel("a", layers("a"), inflight=2), TenantModel("b", layers("b"), idle_s=60.0)]
    moves, _ = decide_tenancy(view(ms, [engine("a"), engine("b")]), CFG)
    assert [(m.op, m.engine) for m in moves] == [("lend", "b#0")]
    plan = lend_plan(replace(layers("b"), active=False), 32e9, RemapConfig())
    assert moves[0].params == {"layers": list(plan.layers), "slots": plan.slots}
    # the prefill bound: a 2 ms load hides behind ~1 prefill layer; a longer prefill lets it give more
    longer = lend_plan(replace(layers("b", prefill_ms=8.0), active=False), 32e9, RemapConfig(max_fraction=1.0))
    shorter = lend_plan(replace(layers("b", prefill_ms=1.0), active=False), 32e9, RemapConfig(max_fraction=1.0))
    assert shorter.alpha < plan.alpha <= longer.alpha < 16
    # nothing lends twice, nor while active, nor a model whose engine borrowed
    moves, _ = decide_tenancy(view(ms, [engine("a"), engine("b", lent_layers=5, held_bytes=1300 * MB)]), CFG)
    assert moves == ()


def test_an_idle_model_that_still_borrows_repays_first_then_lends():
    a = engine("a", capacity_blocks=101, borrowed_blocks=1, held_bytes=1501 * MB, demand_blocks=0)
    ms = [TenantModel("a", layers("a"), idle_s=60.0), TenantModel("b", layers("b"), inflight=3)]
    moves, _ = decide_tenancy(view(ms, [a, engine("b")]), CFG)
    assert [(m.op, m.engine, m.params) for m in moves] == [("repay", "a#0", {"blocks": 100})]
    moves, _ = decide_tenancy(view(ms, [replace(a, capacity_blocks=100, borrowed_blocks=0, held_bytes=1500 * MB),
                                        engine("b")]), CFG)
    assert [(m.op, m.engine) for m in moves] == [("lend", "a#0")]


def test_inactive_models_lend_lowest_priority_first():
    ms = [TenantModel(n, layers(n, prio), idle_s=60.0) for n, prio in (("x", 5), ("y", 0), ("z", 2))]
    moves, _ = decide_tenancy(view(ms, [engine(n) for n in "xyz"]), CFG)
    assert [m.engine for m in moves] == ["y#0", "z#0", "x#0"]


def test_a_busy_engine_borrows_what_is_free_and_no_more():
    a = engine("a", demand_blocks=400)
    b = engine("b", lent_layers=5, held_bytes=1300 * MB)   # b gave 200 MB
    ms = [TenantModel("a", layers("a"), inflight=9), TenantModel("b", layers("b"), idle_s=60.0)]
    moves, _ = decide_tenancy(view(ms, [a, b]), CFG)
    (mv,) = moves
    assert mv.op == "borrow" and mv.engine == "a#0"
    assert mv.params["blocks"] == 100 + (200 * MB - 4 * MB) // MB   # the host's free memory, less the rounding
    assert host_free_bytes([replace(a, held_bytes=a.held_bytes + 196 * MB), b]) >= 0
    # a smaller shortage borrows what it needs and a quarter more (its headroom); under the threshold, nothing
    moves, _ = decide_tenancy(view(ms, [replace(a, demand_blocks=108), b]), CFG)
    assert moves[0].params["blocks"] == 150   # ceil(108 x 1.25 / 0.9)
    moves, _ = decide_tenancy(view(ms, [replace(a, demand_blocks=80), b]), CFG)
    assert moves == ()


def test_a_returning_model_takes_its_memory_back_borrowers_repay_first():
    a = engine("a", demand_blocks=150, capacity_blocks=296, held_bytes=1696 * MB)   # borrowed 196 blocks
    a = replace(a, borrowed_blocks=196)
    b = engine("b", lent_layers=5, held_bytes=1300 * MB)
    ms = [TenantModel("a", layers("a"), inflight=9), TenantModel("b", layers("b"), inflight=1)]
    moves, _ = decide_tenancy(view(ms, [a, b]), CFG)
    (mv,) = moves
    assert mv.op == "repay" and mv.engine == "a#0" and mv.params["blocks"] == 296 - 196
    # repaying now: no further repay, no borrow, b waits
    moves, _ = decide_tenancy(view(ms, [replace(a, repaying=True), b]), CFG)
    assert moves == ()
    # repaid: b reclaims
    moves, _ = decide_tenancy(view(ms, [replace(a, capacity_blocks=100, borrowed_blocks=0, held_bytes=1500 * MB), b]),
                              CFG)
    assert [(m.op, m.engine) for m in moves] == [("reclaim", "b#0")]


def test_a_host_over_its_budget_takes_memory_back_and_a_busy_engine_is_skipped():
    a = engine("a", capacity_blocks=300, borrowed_blocks=200, held_bytes=1700 * MB, demand_blocks=250)
    b = engine("b")   # restarted at home while its memory was borrowed: the host is 200 MB over
    ms = [TenantModel("a", layers("a"), inflight=9), TenantModel("b", layers("b"), inflight=0, idle_s=1.0)]
    moves, _ = decide_tenancy(view(ms, [a, b]), CFG)
    assert [(m.op, m.engine, m.params["blocks"]) for m in moves] == [("repay", "a#0", 100)]
    assert decide_tenancy(view(ms, [replace(a, busy=True), b]), CFG)[0] == ()
    assert decide_tenancy(view(ms, [a, replace(b, busy=True)]), CFG)[0] == ()   # the host's memory is unknown


def test_a_borrower_whose_demand_stays_low_repays_after_the_hold():
    a = engine("a", capacity_blocks=150, borrowed_blocks=50, held_bytes=1550 * MB, demand_blocks=20)
    b = engine("b", lent_layers=5, held_bytes=1300 * MB)
    ms = [TenantModel("a", layers("a"), inflight=1), TenantModel("b", layers("b"), idle_s=60.0)]
    moves, st = decide_tenancy(view(ms, [a, b], now=100.0), CFG)
    assert moves == () and st.low_since == {"a#0": 100.0}
    moves, st = decide_tenancy(view(ms, [replace(a, demand_blocks=90), b], now=102.0), CFG, state=st)
    assert moves == () and st.low_since == {}   # the demand rose: the hold starts again
    _, st = decide_tenancy(view(ms, [a, b], now=103.0), CFG, state=st)
    moves, _ = decide_tenancy(view(ms, [a, b], now=108.0), CFG, state=st)
    assert [(m.op, m.params["blocks"]) for m in moves] == [("repay", 100)]


def test_fleet_files_are_checked_in_one_line_naming_the_key():
    entries, ten = parse_fleet({"models": [{"model": "/m/a", "name": "a", "instances": 2, "priority": 1},
                                           "/m/b"], "tenancy": {"idle_s": 5}})
    assert [(e.name, e.instances, e.priority) for e in entries] == [("a", 2, 1), ("/m/b", None, None)]
    assert ten.idle_s == 5
    for raw, where in ((json.dumps({"models": []}), "non-empty list"), ("{", "not valid JSON"),
                       ({"models": ["a"], "x": 1}, "unknown key 'x'"),
                       ({"models": [{"model": "a", "gpu": 1}]}, "models[0]: unknown key 'gpu'"),
                       ({"models": [{"name": "a"}]}, "models[0].model"),
                       ({"models": [{"model": "a", "instances": 0}]}, "models[0].instances"),
                       ({"models": [{"model": "a", "priority": "high"}]}, "models[0].priority"),
                       ({"models": ["a", "a"]}, "given twice"),
                       ({"models": ["a"], "tenancy": {"idle_s": -1}}, "kunserve.tenancy.idle_s"),
                       ({"models": ["a"], "tenancy": {"wait": 1}}, "wait")):
        with pytest.raises(ValueError) as e:
            parse_fleet(raw)
        assert where in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="given twice"):
        from_models(["a", "a"], 1)


class FakeFront:
    def __init__(self, name):
        self.name = name
        self.models_body = json.dumps({"object": "list", "data": [{"id": name}]}).encode()
        self.seen = []

    async def app(self, scope, receive, send):
        if scope["path"] == "/metrics":
            body = (f'# HELP kunserve:x A thing\n# TYPE kunserve:x counter\nkunserve:x_total{{kind="k"}} '
                    f'{len(self.name)}.0\n').encode()
        else:
            msg = await receive()
            self.seen.append(json.loads(msg["body"]))
            body = json.dumps({"model": self.name}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _call(router, method, path, body=b"", query=b""):
    out = {}

    async def run():
        sent = False

        async def rx():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)

        async def tx(msg):
            if msg["type"] == "http.response.start":
                out["status"] = msg["status"]
            else:
                out["body"] = out.get("body", b"") + msg.get("body", b"")
        await router({"type": "http", "method": method, "path": path, "query_string": query, "headers": []}, rx, tx)
    asyncio.run(run())
    return out["status"], out.get("body", b"").decode()


def test_the_router_sends_each_request_to_its_models_front_end_and_refuses_unknown_models():
    fa, fb = FakeFront("a"), FakeFront("bb")
    arrived = []

    class Ten:
        registry = None

        def arrived(self, m):
            arrived.append(m)
    router = ModelRouter({"a": (fa, fa.app), "bb": (fb, fb.app)}, None)
    router.tenancy = Ten()
    router.tenancy.registry = __import__("prometheus_client").CollectorRegistry()
    assert _call(router, "POST", "/v1/completions", b'{"model": "bb", "prompt": "x"}') == (200, '{"model": "bb"}')
    assert _call(router, "POST", "/v1/chat/completions", b'{"model": "a", "messages": []}')[0] == 200
    assert fb.seen == [{"model": "bb", "prompt": "x"}] and len(fa.seen) == 1 and arrived == ["bb", "a"]
    code, body = _call(router, "POST", "/v1/completions", b'{"model": "c", "prompt": "x"}')
    assert code == 404 and "`c` does not exist" in body and "NotFoundError" in body
    code, body = _call(router, "POST", "/v1/completions", b'{"prompt": "x"}')
    assert code == 400 and "'model' is required" in body
    assert _call(router, "POST", "/v1/completions", b"[1")[0] == 400
    assert _call(router, "POST", "/kunserve/ops/drop", b"{}")[0] == 400   # which model's?
    code, body = _call(router, "GET", "/v1/models")
    assert [d["id"] for d in json.loads(body)["data"]] == ["a", "bb"]
    code, text = _call(router, "GET", "/metrics")
    assert text.count("# TYPE kunserve:x counter") == 1
    assert 'kunserve:x_total{model="a",kind="k"} 1.0' in text and 'kunserve:x_total{model="bb",kind="k"} 2.0' in text


def test_add_label_keeps_families_whole_across_texts():
    fam, meta = {}, {}
    add_label('# TYPE t gauge\nt 1\nt{x="1"} 2\n', "model", 'q"', fam, meta)
    add_label('# TYPE t gauge\nt 3\n', "model", "r", fam, meta)
    assert meta["t"] == ["# TYPE t gauge"]
    assert fam["t"] == ['t{model="q\\""} 1', 't{model="q\\"",x="1"} 2', 't{model="r"} 3']


def test_serve_refuses_a_bad_fleet_file_or_flags_in_one_line_before_starting_anything(tmp_path, capsys):
    from vllm_kunserve.cli.main import main

    bad = tmp_path / "fleet.json"
    cases = [({"models": [{"model": "/m/a", "replicas": 2}]}, [], "models[0]: unknown key 'replicas'"),
             ({"models": ["/m/a", "/m/a"]}, [], "given twice"),
             ({"models": ["/m/a"], "tenancy": {"idle_s": 0}}, [], "kunserve.tenancy.idle_s"),
             ({"models": ["/m/a", "/m/b"]}, ["--max-instances", "3"], "--max-instances with several models"),
             ({"models": ["/m/a", "/m/b"]}, ["--served-model-name", "x"], "--served-model-name with several models")]
    for raw, extra, want in cases:
        bad.write_text(json.dumps(raw))
        assert main(["serve", str(bad), "--port", "18765", *extra]) == 2, want
        err = capsys.readouterr()
        assert want in err.err and len(err.err.strip().splitlines()) == 1, err.err
        assert "[kunserve] starting" not in err.out
    assert main(["serve", "/m/a", str(bad), "--port", "18765"]) == 2   # a fleet file names every model
    assert "a fleet file" in capsys.readouterr().err


def test_kunserve_status_shows_each_hosts_memory_and_each_model():
    from vllm_kunserve.cli.status import render

    st = {"models": {"a": {"dispatch": "least-work", "served_models": ["a"], "instances": []},
                     "b": {"dispatch": "least-work", "served_models": ["b"], "instances": []}},
          "tenancy": {"hosts": {"h": {"budget_bytes": 600 * MB, "free_bytes": 0}},
                      "models": {"a": {"active": True}, "b": {"active": False}},
                      "engines": {"a#0": {"held_bytes": 380 * MB, "home_bytes": 300 * MB, "lent": 0,
                                          "borrowed_blocks": 40, "repaying": False, "blocks": 83, "demand": 90},
                                  "b#0": {"held_bytes": 220 * MB, "home_bytes": 300 * MB, "lent": 24,
                                          "borrowed_blocks": 0, "repaying": False, "blocks": 43, "demand": 0}}}}
    text = render(st)
    assert "host h  budget 600.0 MiB  free 0 B" in text or "host h  budget 600.0 MiB" in text
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip().startswith(("a#0", "b#0"))}
    assert rows["a#0"][1] == "yes" and rows["b#0"][1] == "no" and "24" in rows["b#0"]
    assert "model a" in text and "model b" in text
    assert "static split" in render({"models": {"a": st["models"]["a"]}, "tenancy": None})
