"""benchmarks/router_side_by_side.py's fault runs: what the client lost is read from its per-request
results, a stream cut short but closed as if whole included, and the page's verdict follows."""

from __future__ import annotations

import pytest

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
