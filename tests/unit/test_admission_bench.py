"""The admission benchmark's systems and counts (benchmarks/admission.py): vLLM's queue bound leaves an
engine room for what its KV holds, and shed requests are told from failed ones."""

from __future__ import annotations

import csv

import pytest

from benchmarks import admission

pytestmark = pytest.mark.unit


def test_vllms_bound_counts_what_the_kv_holds_plus_half_the_front_ends_queue():
    assert admission.vllm_bound(16, 12) == 20
    assert admission.vllm_bound(2, 0) == 1
    d = admission.derive(16, 30.0, 12)
    assert d["vllm-queued"]["engine_args"] == ["--max-num-queued-reqs", "20"]
    assert d["vllm-queued"]["from"] == "vllm" and d["kunserve-admit"]["from"] == "kunserve"
    for name in ("vllm-admit", "kunserve-admit"):
        args = d[name]["serve_args"]
        assert args[args.index("--admission") + 1] == "memory"
        assert args[args.index("--admission-queue") + 1] == "16" and args[args.index("--admission-wait") + 1] == "30"


def test_shed_counts_429_and_503_apart_from_other_failures(tmp_path):
    rows = [{"ok": "1", "error": ""}, {"ok": "0", "error": "HTTP 429: queue full"},
            {"ok": "0", "error": "HTTP 503: Service Unavailable"}, {"ok": "0", "error": "timeout"}]
    for rep, part in ((1, rows[:2]), (2, rows[2:])):
        f = tmp_path / "vllm-queued" / f"rep{rep}" / "requests.csv"
        f.parent.mkdir(parents=True)
        with f.open("w", newline="") as fh:
            w = csv.DictWriter(fh, ["ok", "error"])
            w.writeheader()
            w.writerows(part)
    assert admission.shed_of(tmp_path, "vllm-queued") == {"requests": 4, "completed": 1, "shed": 2, "failed": 1}
