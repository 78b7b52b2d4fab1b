"""Two models behind one `kunserve serve FLEET.json` (issue 73): each request goes to its model's
engine; an idle model lends its weight memory to the host (its layers stream from the host copy),
the busy model's engine borrows it as KV under a burst, a request for the idle model takes it back
(the borrower repays once its blocks drain; the lender reclaims). A fault at each kind of move
(lend, borrow, repay, reclaim) is rolled back on its engine and the move is made again later; every
greedy answer, whoever holds the memory, is the tokens the model gave before anything moved. A lender
killed while its memory is borrowed comes back whole: the host is over its budget and the borrower
repays, losing no request."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request

import pytest

from tests.vllm.conftest import BURST_KV_BYTES, BURST_SPEC
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster

pytestmark = pytest.mark.vllm

ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(BURST_KV_BYTES),
        "--max-model-len", "512", "--enforce-eager"]
PROMPTS = [f"model memory {i}: the idle one lends" for i in range(3)]
#: the burst on model a: 16 requests of ~160 + 96 tokens need ~1.4x its base blocks
BURST = [f"burst {i}: " + "the cache grows " * 38 for i in range(16)]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    from vllm_kunserve.tools.make_model import CheckpointSpec, build_model

    d = tmp_path_factory.mktemp("models")
    return (build_model(d / "a", CheckpointSpec(**BURST_SPEC, seed=1)),
            build_model(d / "b", CheckpointSpec(**BURST_SPEC, seed=2)))


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _complete(url: str, model: str, prompt: str, n: int = 12) -> str:
    return _post(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                           "temperature": 0})["choices"][0]["text"]


def _answers(url: str, model: str) -> list[str]:
    return [_complete(url, model, p) for p in PROMPTS]


def _wait(url: str, what, timeout: float = 120.0) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = _get(f"{url}/kunserve/status")
        if what(st):
            return st
        time.sleep(0.3)
    raise AssertionError(f"not reached in {timeout:.0f} s: {json.dumps(st.get('tenancy'))[:3000]}")


def _engine(st: dict, model: str) -> dict:
    return st["tenancy"]["engines"][f"{model}#0"]


def _arm(st: dict, model: str, step: str) -> None:
    ctl = st["models"][model]["instances"][0]["control_url"]
    _post(f"{ctl}/ops/inject_fault", {"step": step})


def _moves(st: dict, op: str, outcome: str) -> int:
    return sum(1 for e in st["tenancy"]["events"] if e["event"] == f"tenancy_{op}" and e["outcome"] == outcome)


def test_two_models_move_memory_between_them_token_identical_with_a_fault_at_each_move(two_models, tmp_path):
    a, b = two_models
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({
        "models": [{"model": str(a), "name": "a", "priority": 1}, {"model": str(b), "name": "b", "priority": 0}],
        "tenancy": {"idle_s": 6, "repay_hold_s": 120, "borrow_ratio": 0.8}}))
    log = tmp_path / "serve.log"
    cfg = {"drop": {"enable": False}, "remap": {"h2d_bandwidth_gbps": 50.0}}
    srv = KunserveCluster(str(fleet), ARGS, cfg, log_path=log, instances=1, startup_timeout_s=600,
                          extra=["--monitor-interval", "0.25", "--log-dir", str(tmp_path)])
    with srv:
        url = srv.url
        models = [m["id"] for m in _get(f"{url}/v1/models")["data"]]
        ref = {m: _answers(url, m) for m in ("a", "b")}
        st = _get(f"{url}/kunserve/status")
        _arm(st, "b", "give_back")   # b's first lend fails at its last step: rolled back, lent again later
        # a busy, b idle: b lends (after its failed first try), its answers unchanged while it streams
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            _complete(url, "a", PROMPTS[0], 2)
            time.sleep(1.0)
        st = _wait(url, lambda s: _engine(s, "b")["lent"] > 0)
        home_b = _engine(st, "b")["home_bytes"]
        lent_b = home_b - _engine(st, "b")["held_bytes"]
        _arm(st, "a", "kv_borrow")    # a's first borrow fails: its blocks stay as they were
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            burst = list(pool.map(lambda p: _complete(url, "a", p, 96), BURST))
        st = _wait(url, lambda s: _moves(s, "borrow", "ok") >= 1)
        borrowed = [e for e in st["tenancy"]["events"] if e["event"] == "tenancy_borrow" and e["outcome"] == "ok"]
        during = _answers(url, "a")
        st = _get(f"{url}/kunserve/status")
        a_borrowed_after_burst = _engine(st, "a")["borrowed_blocks"]
        # b comes back: a repays (its first repay fails at the shrink), b reclaims (its first try fails)
        _arm(st, "a", "kv_repay")
        _arm(st, "b", "reload")
        b_streamed = _answers(url, "b")   # served at once, its lent layers streamed
        st = _wait(url, lambda s: _engine(s, "b")["lent"] == 0 and _engine(s, "a")["borrowed_blocks"] == 0, 180)
        after = {m: _answers(url, m) for m in ("a", "b")}
        home_after = _engine(_get(f"{url}/kunserve/status"), "b")["held_bytes"]
        # a lender dies while its memory is borrowed: it comes back whole, so the host is over its budget
        # and the borrower repays (draining, nothing lost); the restarted lender answers as before
        _wait(url, lambda s: _engine(s, "b")["lent"] > 0)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_complete, url, "a", p, 96) for p in BURST]
            _wait(url, lambda s: _engine(s, "a")["borrowed_blocks"] > 0)
            killed = _post(f"{url}/kunserve/ops/kill?model=b", {"instance": 0})
            burst2 = [f.result() for f in futures]
        st = _wait(url, lambda s: any(e["event"] == "tenancy_repay" and "over its budget" in e["reason"]
                                      for e in s["tenancy"]["events"]), 120)
        b_restarted = _answers(url, "b")   # waits for b's engine to be back (the front end queues meanwhile)
        st = _wait(url, lambda s: _engine(s, "a")["borrowed_blocks"] == 0 and _engine(s, "b")["lent"] == 0, 180)
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        unknown = urllib.request.Request(f"{url}/v1/completions", json.dumps({"model": "c", "prompt": "x"}).encode(),
                                         {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(unknown, timeout=30)
            code = 200
        except urllib.error.HTTPError as e:
            code, body = e.code, json.loads(e.read())
    text = log.read_text()
    assert sorted(models) == ["a", "b"]
    assert ref["a"] != ref["b"]                 # two models: each request went to its own
    assert code == 404 and "`c` does not exist" in body["error"]["message"]
    assert lent_b > 0 and _moves(st, "lend", "failed") >= 1 and _moves(st, "lend", "ok") >= 1
    assert _moves(st, "borrow", "failed") >= 1 and borrowed
    assert a_borrowed_after_burst > 0 or borrowed
    assert len(burst) == len(BURST) and all(burst)   # none lost
    assert _moves(st, "repay", "failed") >= 1 and _moves(st, "repay", "ok") >= 1
    assert _moves(st, "reclaim", "failed") >= 1 and _moves(st, "reclaim", "ok") >= 1
    # token-identical: b while lent and streaming, a on borrowed memory, both after it all went back
    assert b_streamed == ref["b"] and during == ref["a"]
    assert after == ref
    assert home_after == home_b   # every byte came back
    assert killed and len(burst2) == len(BURST) and all(burst2)   # the borrower lost nothing to the lender's death
    assert b_restarted == ref["b"]
    assert _engine(st, "b")["held_bytes"] == home_b
    assert 'kunserve:tenancy_moves_total{model="b",op="lend",outcome="ok"}' in metrics
    assert 'model="a"' in metrics and 'kunserve:frontend_requests_total{model="a"' in metrics
    assert "Traceback" not in text
