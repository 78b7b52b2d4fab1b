"""benchmarks/router_side_by_side.py's pure parts: the fault runs' losses (read from the client's
per-request results, a stream cut short but closed as if whole included) and their verdict; the
Mooncake workload's conversations, prompts that share a prefix exactly where the trace's blocks do,
and the reuse an infinite cache would reach."""

from __future__ import annotations

import pytest

import json

from tests.unit.benchmod import load_benchmark

pytestmark = pytest.mark.unit

TRACE = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
         "aiohttp.client_exceptions.ClientPayloadError: Response payload is not completed")


def test_losses_count_failed_and_short_answers():
    sbs = load_benchmark("router_side_by_side")
    res = {"output_lens": [256, 256, 0, 200, 256], "errors": ["", "", TRACE, "", None]}
    got = sbs.client_losses(res, 256)
    assert (got["completed"], got["failed"], got["short"], got["lost"]) == (3, 1, 1, 2)
    assert got["first_errors"] == ["aiohttp.client_exceptions.ClientPayloadError: Response payload is not completed"]
    with pytest.raises(ValueError, match="save-detailed"):
        sbs.client_losses({"completed": 5}, 256)


def test_page_says_met_only_when_kunserve_lost_nothing():
    sbs = load_benchmark("router_side_by_side")
    run = {"concurrency": 16, "prompts": 160, "median_ttft_ms": 40.0, "output_throughput": 2500.0,
           "killed_at_s": 11.5, "victim_running_at_kill": 8, "first_errors": []}
    runs = [{**run, "front": "vllm-router-rr", "rep": 1, "completed": 152, "failed": 8, "short": 0, "lost": 8},
            {**run, "front": "kunserve", "rep": 1, "completed": 160, "failed": 0, "short": 0, "lost": 0}]
    meta = {"name": "x", "command": "c", "cpu": "cpu", "cores": 2, "kv_bytes": 64 << 20, "input_len": 64,
            "output_len": 256, "prompts": {"16": 160}, "concurrency": 16, "kill_after_s": 3.0, "repeat": 1}
    an = sbs.analyse_kill(runs)
    assert an["vllm-router-rr"]["runs_with_loss"] == 1 and an["kunserve"]["lost"] == 0
    page = sbs.render_kill(meta, an)
    assert "kunserve lost 0 of 160 -> **met**; vllm-router-rr lost 8 of 160" in page
    runs[1].update(completed=159, short=1, lost=1)
    assert "kunserve lost 1 of 160 -> **missed**" in sbs.render_kill(meta, sbs.analyse_kill(runs))


class _Tok:
    """A stand-in tokenizer: token t is the word ``w<t>``."""
    vocab_size = 50
    all_special_ids = [0, 1, 2]

    def decode(self, ids):
        return " ".join(f"w{t}" for t in ids)


def test_mooncake_prompts_share_a_prefix_where_the_trace_blocks_do(tmp_path):
    sbs = load_benchmark("router_side_by_side")
    rows = [{"timestamp": 0, "hash_ids": [0, 1, 2]},        # conversation 1, turn 1
            {"timestamp": 1, "hash_ids": [0, 5]},           # a single turn: left out
            {"timestamp": 2, "hash_ids": [0, 7, 8]},        # conversation 7, turn 1
            {"timestamp": 3, "hash_ids": [0, 1, 2, 3, 4]},  # conversation 1, turn 2
            {"timestamp": 4, "hash_ids": [0, 7, 8, 9]},     # conversation 7, turn 2
            {"timestamp": 5, "hash_ids": [0, 9, *range(10, 40)]},   # over --max-blocks: left out
            {"timestamp": 6, "hash_ids": [0, 9, 41]}]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    sessions = sbs.mooncake_sessions(trace, 4, max_blocks=8)
    assert sessions == [[0, 1, 2], [0, 7, 8], [0, 1, 2, 3, 4], [0, 7, 8, 9]]
    # seen before, leading: none, block 0, blocks 0,1,2, blocks 0,7,8: 7 of 15
    assert sbs.ideal_reuse(sessions) == round(7 / 15, 3)
    with pytest.raises(ValueError, match="only 4 requests"):
        sbs.mooncake_sessions(trace, 5, max_blocks=8)
    out = tmp_path / "d.jsonl"
    sbs.mooncake_dataset(sessions, _Tok(), 4, seed=1, out=out)
    p = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert p[2].startswith(p[0]) and p[3].startswith(p[1]) and not p[1].startswith(p[0][:20])
    assert len(p[0].split()) == 3 * 4 and not any(w in ("w0", "w1", "w2") for w in " ".join(p).split())
    sbs.mooncake_dataset(sessions, _Tok(), 4, seed=2, out=out)   # another run: other texts
    assert json.loads(out.read_text().splitlines()[0])["prompt"] != p[0]


def test_engine_view_takes_the_runs_differences():
    sbs = load_benchmark("router_side_by_side")
    before = {"hits": 10.0, "queries": 20.0, "queue_s": 1.0, "queue_n": 4.0, "prefill_s": 2.0, "prefill_n": 4.0}
    after = {"hits": 40.0, "queries": 80.0, "queue_s": 7.0, "queue_n": 10.0, "prefill_s": 3.2, "prefill_n": 10.0}
    v = sbs.engine_view(before, after)
    assert v == pytest.approx({"prefix_hit_rate": 0.5, "engine_queue_ms": 1000.0, "engine_prefill_ms": 200.0})
    assert sbs.engine_view(before, dict(before)) == {"prefix_hit_rate": 0.0}   # no request finished: no means


def test_direct_clients_pool_as_one_client():
    """The straight-to-the-engines baseline: two clients' per-request results pooled into the figures
    one client over all their requests reports (a failed request, no output tokens, left out)."""
    import numpy as np

    sbs = load_benchmark("router_side_by_side")
    a = {"completed": 2, "failed": 1, "total_output_tokens": 8, "duration": 2.0,
         "ttfts": [0.01, 0.03, 0.0], "itls": [[0.002, 0.004], [0.006], []], "output_lens": [4, 4, 0]}
    b = {"completed": 1, "failed": 0, "total_output_tokens": 4, "duration": 4.0,
         "ttfts": [0.05], "itls": [[0.008, 0.010, 0.012]], "output_lens": [4]}
    got = sbs.pool_clients([a, b])
    assert (got["completed"], got["failed"], got["clients"]) == (3, 1, 2)
    assert got["output_throughput"] == 12 / 4.0   # the longer client's duration
    assert got["median_ttft_ms"] == pytest.approx(30.0)
    assert got["p99_ttft_ms"] == pytest.approx(float(np.percentile([0.01, 0.03, 0.05], 99)) * 1e3)
    assert got["median_itl_ms"] == pytest.approx(7.0)   # the median of 2, 4, 6, 8, 10, 12 ms


def test_stage_view_splits_the_clients_ttft_by_the_front_ends_clock():
    sbs = load_benchmark("router_side_by_side")
    before = {"admit": (1.0, 10), "engine": (5.0, 10), "relay": (0.1, 10)}
    after = {"admit": (1.2, 20), "engine": (7.0, 20), "relay": (0.15, 20)}
    v = sbs.stage_view(before, after, 260.0)
    assert v == pytest.approx({"admit_ms": 20.0, "engine_ms": 200.0, "relay_ms": 5.0, "unseen_ms": 35.0})
    assert sbs.stage_view(before, before, 260.0) == {}   # no streamed request in the run: nothing to split
    assert "unseen_ms" not in sbs.stage_view(before, after, None)
    ci = lambda m: {"mean": m, "lo": m - 1, "hi": m + 1}  # noqa: E731
    an = {"32": {"kunserve": {"mean_ttft_ms": ci(260.0), "admit_ms": ci(20.0), "engine_ms": ci(200.0),
                              "relay_ms": ci(5.0), "unseen_ms": ci(35.0)}},
          "1": {"kunserve": {"mean_ttft_ms": ci(12.0)}}}   # a run before the stages were recorded: no row
    page = "\n".join(sbs.stage_section(an))
    assert "| 32 | 260.0 (259.0..261.0) | 20.0 (19.0..21.0) | 200.0 (199.0..201.0) | 5.0 (4.0..6.0) |" in page
    assert "| 1 |" not in page
    assert "Reading (32 streams): 55 ms of the client's mean 260 ms (21%)" in page and "5.0 ms to pass" in page
    assert sbs.stage_section({"1": {"kunserve": {}}}) == []
    assert "taking requests in, not its relay" in page
    slow_relay = {"32": {"kunserve": {"mean_ttft_ms": ci(260.0), "admit_ms": ci(2.0), "engine_ms": ci(150.0),
                                      "relay_ms": ci(100.0), "unseen_ms": ci(8.0)}}}
    assert "wait is its relay of the first token" in "\n".join(sbs.stage_section(slow_relay))


def test_replicated_kunserve_is_described_and_checked_against_the_targets_too():
    """``kunserve-x2`` (two front ends on one port, --reuse-port): the page names it and gives it the
    targets' lines of its own beside kunserve's, each from its own means."""
    sbs = load_benchmark("router_side_by_side")
    ci = lambda m: {"mean": m, "lo": m * 0.95, "hi": m * 1.05}  # noqa: E731
    row = lambda tp, ttft, p99, itl: {"output_throughput": ci(tp), "median_ttft_ms": ci(ttft),  # noqa: E731
                                      "p99_ttft_ms": ci(p99), "median_itl_ms": ci(itl), "failed": 0}
    an = {"32": {"vllm-router-rr": row(100.0, 10.0, 20.0, 5.0), "kunserve": row(80.0, 15.0, 30.0, 1.0),
                 "kunserve-x2": row(99.0, 10.5, 21.0, 5.2)}}
    meta = {"command": "x", "cpu": "cpu", "kv_bytes": 64 << 20, "repeat": 5, "input_len": 64, "output_len": 64,
            "name": "router_side_by_side_replicas", "layout": "shared"}
    page = sbs.render(meta, an)
    assert "`kunserve-x2`, two such front ends started with `--reuse-port`" in page
    assert "- 32 streams, throughput >= 0.97x the router's better: 0.80x -> **missed**" in page
    assert "- 32 streams, kunserve-x2, throughput >= 0.97x the router's better: 0.99x -> **met**" in page
    assert "- 32 streams, kunserve-x2, median ITL within 10% of round_robin's: 1.04x -> **met**" in page
    assert "| kunserve-x2 | 99 (94..104) [0.99x] |" in page
    assert page.startswith("# kunserve serve side by side with vllm-router, and two kunserve front ends on one port")
    for f, us in (("vllm-router-rr", 30.0), ("kunserve", 90.0), ("kunserve-x2", 60.0)):
        an["32"][f]["front_cpu_us_per_token"] = ci(us)   # the reading needs the fronts' CPU
    assert "(`kunserve-x2`): at 32 streams median ITL 1.04x round_robin's (one front end 0.20x), median TTFT " \
           "1.05x (1.50x), CPU 60 us per token (90)" in sbs.render(meta, an)
    assert "the tokens bunch less) and the first tokens come sooner." in sbs.render(meta, an)
