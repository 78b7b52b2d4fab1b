"""System definitions, launch plans, the comparison table, CLI errors, and a whole ``compare`` run
with a fake launcher kind (a small aiohttp server subprocess) standing in for ``vllm serve``."""

import json
import sys
import textwrap

import numpy as np
import pytest

from vllm_kunserve.config import parse_kunserve_config

from vllm_kunserve.bench import compare as C
from vllm_kunserve.bench import systems as S
from vllm_kunserve.bench.compare import aggregate, compare, mean_ratio, table, write_compare
from vllm_kunserve.bench.prompts import PromptFactory
from vllm_kunserve.bench.runner import BenchOptions, run_bench
from vllm_kunserve.cli.main import main
from vllm_kunserve.workload.traces import synthetic

pytestmark = pytest.mark.unit


def test_builtin_systems_and_selection():
    b = S.builtin_systems({"remap": {"enable": True}}, oracle_kv_multiplier=8)
    assert b["vllm"].additional_config is None and b["vllm"].kv_multiplier == 1
    assert b["kunserve"].additional_config == {"kunserve": {"remap": {"enable": True}}}
    assert b["oracle"].kv_multiplier == 8 and b["oracle"].additional_config is None
    assert [s.name for s in S.select_systems("oracle, vllm", b)] == ["oracle", "vllm"]
    with pytest.raises(ValueError, match="unknown system.*stok.*choose from vllm, kunserve, oracle"):
        S.select_systems("vllm,stok", b)
    with pytest.raises(ValueError, match="twice"):
        S.select_systems("vllm,vllm", b)
    with pytest.raises(ValueError, match="unknown launcher"):
        S.SystemSpec("x", launcher="k8s")
    with pytest.raises(ValueError, match="kunserve.remap.slots"):
        S.builtin_systems({"remap": {"slots": 3}})
    assert "static" not in b                      # one engine: nothing to group
    cfg = {"drop": {"trigger_ratio": 0.9}, "memory": {"max_kv_ratio": 10}}
    c = S.builtin_systems(cfg, instances=2, dispatch="least-work")
    assert c["static"].additional_config == {"kunserve": {"drop": {"trigger_ratio": 0.9, "static_group": True},
                                                          "memory": {"max_kv_ratio": 10}}}
    assert cfg == {"drop": {"trigger_ratio": 0.9}, "memory": {"max_kv_ratio": 10}}   # not mutated
    assert c["static"].num_instances == 2 and c["static"].launcher == "kunserve-serve"


def test_vllm_serve_plan():
    common = S.CommonArgs(model="/m", block_size=32, kv_cache_bytes=1000, max_model_len=512, extra_args=("--x",))
    oracle = S.builtin_systems(oracle_kv_multiplier=10)["oracle"]
    plan = S.vllm_serve_plan(oracle, common, "127.0.0.1", 1234)
    a = plan.argv
    assert a[a.index("serve") + 1] == "/m" and a[a.index("--port") + 1] == "1234"
    assert a[a.index("--kv-cache-memory-bytes") + 1] == "10000" and a[a.index("--block-size") + 1] == "32"
    assert a[a.index("--dtype") + 1] == "float32" and "--additional-config" not in a and a[-1] == "--x"
    assert plan.env["VLLM_HOST_IP"] == "127.0.0.1" and "VLLM_CPU_KVCACHE_SPACE" in plan.unset_env
    ks = S.builtin_systems({"drop": {"enable": False}})["kunserve"]
    a = S.vllm_serve_plan(ks, common, "127.0.0.1", 1).argv
    assert json.loads(a[a.index("--additional-config") + 1]) == {"kunserve": {"drop": {"enable": False}}}
    with pytest.raises(ValueError, match="one instance"):
        S.vllm_serve_plan(S.SystemSpec("c", num_instances=4), common, "h", 1)


def test_parse_kunserve_config(tmp_path):
    assert parse_kunserve_config('{"remap": {"enable": true}}') == {"remap": {"enable": True}}
    assert parse_kunserve_config('{"kunserve": {"drop": {}}}') == {"drop": {}}
    p = tmp_path / "k.json"
    p.write_text('{"remap": {"enable": tru}')
    with pytest.raises(ValueError, match="k.json: not valid JSON"):
        parse_kunserve_config(str(p))
    with pytest.raises(FileNotFoundError):
        parse_kunserve_config("nofile.json")
    with pytest.raises(ValueError, match="unknown key"):
        parse_kunserve_config('{"remapp": {}}')


def _summary(ttft50, ttft99, pre, done=10):
    return {"ttft_s": {"p50": ttft50, "p99": ttft99}, "tpot_s": {"p50": 0.01, "p99": 0.02}, "e2e_s": {"p99": 1.0},
            "preemptions": pre, "completed": done, "failed": 0, "throughput_rps": 2.0,
            "output_tokens_per_s": 50.0, "slo_attainment": {"ttft_and_tpot": {"5x": 0.9}}}


def test_aggregate_table_and_ratios():
    runs = {"vllm": [_summary(1.0, 4.0, 10), _summary(1.0, 6.0, 20)], "oracle": [_summary(0.5, 2.0, 0)] * 2}
    agg = aggregate(runs, "vllm")
    assert agg["vllm"]["ttft_p99"] == {"mean": 5.0, "min": 4.0, "max": 6.0, "n": 2, "ratio": 1.0}
    assert agg["oracle"]["ttft_p99"]["ratio"] == pytest.approx(0.4)
    assert agg["oracle"]["preemptions"]["ratio"] == 0.0
    text = table(agg, ["vllm", "oracle"], "vllm")
    line = next(ln for ln in text.splitlines() if ln.startswith("TTFT P99"))
    assert "5 [4-6]" in line and "2 (0.40x)" in line
    md = table(agg, ["vllm", "oracle"], "vllm", markdown=True)
    assert md.startswith("| metric | vllm (baseline) | oracle |")


FAKE_SERVER = textwrap.dedent('''
    import asyncio, json, os, sys
    from aiohttp import web
    port, first = int(sys.argv[1]), float(os.environ["FAKE_FIRST_S"])
    served = 0
    async def health(r):
        return web.Response(text="ok")
    async def metrics(r):
        return web.Response(text='# TYPE vllm:num_preemptions counter\\n'
                            f'vllm:num_preemptions_total{{engine="0"}} {served}\\n')
    async def comp(r):
        global served
        body = await r.json()
        resp = web.StreamResponse()
        await resp.prepare(r)
        await asyncio.sleep(first)
        for i in range(body["max_tokens"]):
            await resp.write(b'data: {"choices": [{"text": "x"}]}\\n\\n')
            await asyncio.sleep(0.005)
        await resp.write(b"data: [DONE]\\n\\n")
        served += 1
        return resp
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", comp)
    web.run_app(app, host="127.0.0.1", port=port, print=None, shutdown_timeout=1)
''')


def test_compare_end_to_end_with_fake_launcher(tmp_path, monkeypatch):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def fake_plan(spec, common, host, port):
        # the KV multiplier becomes a speed-up so the two systems differ measurably
        return S.LaunchPlan([sys.executable, str(script), str(port)], {"FAKE_FIRST_S": str(0.2 / spec.kv_multiplier)})

    monkeypatch.setitem(S.LAUNCHERS, "fake", fake_plan)
    systems = [S.SystemSpec("vllm", launcher="fake"), S.SystemSpec("oracle", launcher="fake", kv_multiplier=4)]
    common = S.CommonArgs(model="m")
    tr = synthetic(np.array([4] * 5), np.array([3] * 5), np.linspace(0, 0.4, 5), "t")
    factory = PromptFactory(vocab_size=50)

    def bench(spec, rep, endpoint, run_dir):
        opts = BenchOptions(endpoint=endpoint, model="m", warmup=0, progress=False, plots=False)
        return run_bench(tr, factory, opts, run_dir)

    res = compare(systems, common, tmp_path / "out", 2, bench, startup_timeout_s=60, log=lambda m: None)
    assert res.baseline == "vllm" and len(res.runs["vllm"]) == 2 and len(res.runs["oracle"]) == 2
    assert all(s["completed"] == 5 for rs in res.runs.values() for s in rs)
    assert all(s["server"]["exit_code"] is not None for rs in res.runs.values() for s in rs)  # stopped
    assert (tmp_path / "out/oracle/rep2/server.log").read_text().startswith("$ ")
    assert res.aggregate["vllm"]["preemptions"]["mean"] == 5  # counter delta over the replay
    r = mean_ratio(res, "oracle", "vllm", "ttft_p50")
    assert 0.15 < r < 0.6  # programmed 0.05 s vs 0.2 s
    # SLO reference is the oracle's P50 for every system
    assert res.runs["vllm"][0]["slo_reference"]["system"] == "oracle"
    assert res.runs["oracle"][0]["slo_attainment"]["ttft"]["2x"] > res.runs["vllm"][0]["slo_attainment"]["ttft"]["2x"]
    text = write_compare(tmp_path / "out", res, ["vllm", "oracle"])
    assert "TTFT P99" in text
    saved = json.loads((tmp_path / "out/compare.json").read_text())
    assert saved["aggregate"]["oracle"]["ttft_p50"]["ratio"] == pytest.approx(r)
    assert (tmp_path / "out/ttft_cdf.png").stat().st_size > 0

    # interrupted before oracle's second run finished: resumed, only that run runs again, in its place
    (tmp_path / "out/oracle/rep2/summary.json").unlink()
    ran, logs = [], []

    def counting(spec, rep, endpoint, run_dir):
        ran.append((spec.name, rep))
        return bench(spec, rep, endpoint, run_dir)
    again = compare(systems, common, tmp_path / "out", 2, counting, startup_timeout_s=60, log=logs.append,
                    resume=True)
    assert ran == [("oracle", 1)] and sum("kept from the earlier run" in m for m in logs) == 3
    assert again.orders == res.orders and [len(v) for v in again.runs.values()] == [2, 2]
    assert again.runs["vllm"][1]["ttft_s"] == res.runs["vllm"][1]["ttft_s"]
    kept = C.report.read_requests_csv(tmp_path / "out/vllm/rep1/requests.csv")
    assert [(x.idx, x.ok, x.output_tokens) for x in kept] == [(i, True, 3) for i in range(5)]
    assert all(x.ttft_s > 0 and x.token_times == [] for x in kept)
    assert again.runs["vllm"][0]["slo_reference"]["system"] == "oracle"   # recomputed over kept and new runs


def test_server_that_dies_reports_its_log(tmp_path, monkeypatch):
    monkeypatch.setitem(S.LAUNCHERS, "dead", lambda spec, common, host, port: S.LaunchPlan(
        [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]))
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*no such model"):
        compare([S.SystemSpec("vllm", launcher="dead")], S.CommonArgs(model="m"), tmp_path, 1,
                lambda *a: None, log=lambda m: None)


def test_compare_order_is_shuffled_or_fixed(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--model", "m", "--kv-capacity-tokens", "1", "--out", "o", "--order", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--systems", "vllm,foo"], "unknown system(s) foo"),
    (["--kunserve-config", "{bad"], "not valid JSON"),
    (["--trace", "/nonexistent.csv"], "no such file"),
    (["--repeat", "0"], "--repeat must be >= 1"),
    (["--tuned-max-num-seqs", "0"], "--tuned-max-num-seqs must be >= 1"),
    (["--oracle-equal-kv-multiplier", "0.5"], "--oracle-equal-kv-multiplier must be >= 1"),
    (["--systems", "vllm,vllm-tuned"], "unknown system(s) vllm-tuned"),
])
def test_compare_cli_errors(argv, needle, tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2,
                                                   "hidden_size": 64, "max_position_embeddings": 512}))
    base = ["compare", "--model", str(model), "--kv-capacity-tokens", "1024", "--out", str(tmp_path / "o"),
            "--trace", str(tmp_path / "t.csv")]
    (tmp_path / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n")
    assert main(base + argv) == 2
    assert needle in capsys.readouterr().err


def test_bench_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,x\n")
    argv = ["bench", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "o"),
            "--no-scrape", "--trace", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "bad.csv:2:3: column 'GeneratedTokens'" in err
    assert main(argv[:-2] + ["--trace", str(tmp_path / "none.csv")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(argv[:-2] + ["--format", "azure", "--window-offset", "soon"]) == 2
    assert "--window-offset" in capsys.readouterr().err


def test_variant_systems_merge_sections_over_the_kunserve_config():
    base = {"drop": {"trigger_ratio": 0.9}, "memory": {"max_kv_ratio": 10}}
    b = S.builtin_systems(base, instances=2, dispatch="least-work")
    v = S.variant_systems(['drop-only={"drop": {"transition": "reprefill"}, "lookahead": {"enable": false}}'], base, b)
    ks = v["drop-only"].additional_config["kunserve"]
    assert ks == {"drop": {"trigger_ratio": 0.9, "transition": "reprefill"}, "memory": {"max_kv_ratio": 10},
                  "lookahead": {"enable": False}}
    assert base["drop"] == {"trigger_ratio": 0.9}                     # not mutated
    assert v["drop-only"].num_instances == 2 and v["drop-only"].launcher == "kunserve-serve"
    assert [s.name for s in S.select_systems("vllm,drop-only", {**b, **v})] == ["vllm", "drop-only"]
    for bad, msg in (("x", "NAME=JSON"), ("vllm={}", "taken"), ("y={", "not valid JSON"), ('y={"drop": 1}', "sections"),
                     ('y={"drop": {"bogus": 1}}', "kunserve.drop.bogus")):
        with pytest.raises(ValueError, match=msg):
            S.variant_systems([bad], base, b)


def test_derived_systems_add_front_end_and_engine_arguments_to_another_system():
    b = S.builtin_systems({"drop": {"trigger_ratio": 0.9}}, instances=2, dispatch="least-work",
                          tuned_max_num_seqs=8)
    d = S.derived_systems(['q={"from": "vllm", "engine_args": ["--max-num-queued-reqs", "8"]}',
                           'a={"from": "kunserve", "serve_args": ["--admission", "memory"], "description": "x"}',
                           'aq={"from": "q", "serve_args": ["--admission", "memory"]}'], b)
    assert d["q"].engine_extra == ("--max-num-queued-reqs", "8") and d["q"].additional_config is None
    assert d["a"].engine_args == ("--dispatch", "least-work", "--admission", "memory") and d["a"].description == "x"
    assert d["a"].additional_config == b["kunserve"].additional_config and d["a"].num_instances == 2
    assert d["aq"].engine_extra == d["q"].engine_extra and d["aq"].engine_args[-2:] == ("--admission", "memory")
    t = S.derived_systems(['t={"from": "vllm-tuned", "engine_args": ["--x"]}'], b)["t"]
    assert t.engine_extra == ("--max-num-seqs", "8", "--x")
    for bad, msg in (("x", "NAME=JSON"), ('vllm={"from": "vllm"}', "taken"), ("y={", "not valid JSON"),
                     ('y={"serve_args": []}', '"from"'), ('y={"from": "vllm", "bogus": 1}', '"from"'),
                     ('y={"from": "nope"}', "no system 'nope'"), ('y={"from": "vllm", "engine_args": "--x"}', "lists"),
                     ('y={"from": "vllm-router", "serve_args": ["--admission", "memory"]}', "kunserve serve")):
        with pytest.raises(ValueError, match=msg):
            S.derived_systems([bad], b)


def test_cpu_times_sum_a_process_tree_by_name():
    import os
    import subprocess
    import sys

    from vllm_kunserve.bench.compare import cpu_times

    child = subprocess.Popen([sys.executable, "-c", "import time; t=time.process_time()\nwhile time.process_time()-t<0.3: pass\ntime.sleep(5)"])
    try:
        import time

        import psutil
        deadline = time.monotonic() + 30   # the child's busy 0.3 s, however loaded the host's cores are
        while sum(psutil.Process(child.pid).cpu_times()[:2]) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)

        me = cpu_times(os.getpid())
        own = sum(psutil.Process().cpu_times()[:2])
        assert all(v >= 0 for v in me.values())
        assert sum(me.values()) - own >= 0.25           # the child's busy 0.3 s is in the tree's sum
    finally:
        child.kill()
        child.wait()
    assert cpu_times(None) == {} and cpu_times(2 ** 22 + 12345) == {}


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch, capsys):
    """The port is free when picked; another process may bind it first (the server exits with
    'address already in use'): the system starts again on a new port, other failures still fail."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    ports = []

    def flaky_plan(spec, common, host, port):
        ports.append(port)
        if len(ports) == 1:
            return S.LaunchPlan([sys.executable, "-c", "import sys; print('ERROR:    [Errno 98] error while "
                                 "attempting to bind on address: address already in use'); sys.exit(1)"])
        return S.LaunchPlan([sys.executable, str(script), str(port)], {"FAKE_FIRST_S": "0.01"})

    monkeypatch.setitem(S.LAUNCHERS, "flaky", flaky_plan)
    tr = synthetic(np.array([4] * 2), np.array([3] * 2), np.linspace(0, 0.1, 2), "t")

    def bench(spec, rep, endpoint, run_dir):
        opts = BenchOptions(endpoint=endpoint, model="m", warmup=0, progress=False, plots=False)
        return run_bench(tr, PromptFactory(vocab_size=50), opts, run_dir)

    res = compare([S.SystemSpec("vllm", launcher="flaky")], S.CommonArgs(model="m"), tmp_path / "out", 1, bench,
                  startup_timeout_s=60, log=lambda m: None)
    assert len(ports) == 2 and ports[0] != ports[1]
    assert res.runs["vllm"][0]["completed"] == 2
    assert "was taken before the server bound it" in capsys.readouterr().err

    monkeypatch.setattr(C, "PORT_TRIES", 2)
    always = lambda spec, common, host, port: S.LaunchPlan(  # noqa: E731
        [sys.executable, "-c", "import sys; print('address already in use'); sys.exit(1)"])
    monkeypatch.setitem(S.LAUNCHERS, "taken", always)
    with pytest.raises(RuntimeError, match="address already in use"):
        compare([S.SystemSpec("vllm", launcher="taken")], S.CommonArgs(model="m"), tmp_path / "o2", 1, bench,
                startup_timeout_s=60, log=lambda m: None)


def test_port_taken_reads_the_startup_error():
    assert C.port_taken("ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): address "
                        "already in use")
    assert C.port_taken("kunserve serve: error: --host h --port 1: cannot listen there (Address already in use)")
    assert not C.port_taken("server exited with code 3: no such model")


def test_the_baselines_a_user_would_deploy():
    b = S.builtin_systems(instances=2, dispatch="least-work", tuned_max_num_seqs=12, oracle_equal_kv_multiplier=1.75)
    common = S.CommonArgs(model="/m", block_size=32, kv_cache_bytes=1000, max_model_len=512, extra_args=("--x",))
    tuned = S.kunserve_serve_plan(b["vllm-tuned"], common, "127.0.0.1", 9).argv
    assert tuned[-2:] == ["--max-num-seqs", "12"] and b["vllm-tuned"].additional_config is None
    assert "--max-num-seqs" not in S.kunserve_serve_plan(b["vllm"], common, "127.0.0.1", 9).argv
    eq = S.kunserve_serve_plan(b["oracle-equal"], common, "127.0.0.1", 9).argv
    assert eq[eq.index("--kv-cache-memory-bytes") + 1] == "1750"
    router = S.vllm_router_plan(b["vllm-router"], common, "127.0.0.1", 9)
    a = router.argv
    assert a[a.index("-m") + 1] == "vllm_kunserve.bench.router_fleet" and a[a.index("--instances") + 1] == "2"
    engine = a[a.index("--") + 1:]
    assert engine[engine.index("--kv-cache-memory-bytes") + 1] == "1000" and engine[-1] == "--x"
    rr = S.vllm_router_plan(b["vllm-router-rr"], common, "h", 9).argv
    assert rr[rr.index("--policy") + 1] == "round_robin" and rr.index("--policy") < rr.index("--")
    assert "vllm-tuned" not in S.builtin_systems(instances=2) and "oracle-equal" not in S.builtin_systems(instances=2)
    assert "vllm-router" not in S.builtin_systems()        # one engine: nothing to route between
    assert "not a bound" in b["static"].description


def test_each_repetition_runs_the_systems_in_an_order_of_its_own():
    systems = [S.SystemSpec(n) for n in ("a", "b", "c", "d", "e")]
    orders = [[s.name for s in C.run_order(systems, rep, 1)] for rep in range(6)]
    assert all(sorted(o) == ["a", "b", "c", "d", "e"] for o in orders)
    assert len({tuple(o) for o in orders}) > 1 and len({o[0] for o in orders}) > 1
    assert orders == [[s.name for s in C.run_order(systems, rep, 1)] for rep in range(6)]   # seeded
    assert [s.name for s in C.run_order(systems, 3, None)] == ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_shuffled_orders_are_balanced_over_each_cycle(n):
    """Over a cycle of the design (n repetitions, 2n for odd n) every system runs at every position
    equally often and right after every other system equally often; the next cycle draws another
    assignment of systems to the design. (Seed 1's fresh shuffles put one of 4 systems last in 5 of 6.)"""
    from collections import Counter

    systems = [S.SystemSpec(chr(97 + i)) for i in range(n)]
    length = n if n % 2 == 0 else 2 * n
    for seed in (1, 2):
        orders = [[s.name for s in C.run_order(systems, rep, seed)] for rep in range(2 * length)]
        for cycle in (orders[:length], orders[length:]):
            assert all(sorted(o) == sorted(x.name for x in systems) for o in cycle)
            at = Counter((name, pos) for o in cycle for pos, name in enumerate(o))
            assert set(at.values()) == {length // n}, at
            follows = Counter((a, b) for o in cycle for a, b in zip(o, o[1:]))
            assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1, follows
    four = [S.SystemSpec(x) for x in ("vllm", "kunserve", "kunserve-peak", "oracle-equal")]
    last = Counter(C.run_order(four, rep, 1)[-1].name for rep in range(4))
    assert last["oracle-equal"] == 1


def test_router_fleet_pins_each_engine_and_names_its_workers(monkeypatch):
    from vllm_kunserve.bench import router_fleet as R

    env = R.engine_environ(1, {"KUNSERVE_ENGINE_CPUS": "0|1", "X": "y"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["X"] == "y" and "KUNSERVE_ENGINE_CPUS" not in env
    assert R.engine_environ(2, {"KUNSERVE_ENGINE_CPUS": "0|1"})["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["PROMETHEUS_MULTIPROC_DIR"] != R.engine_environ(1, {})["PROMETHEUS_MULTIPROC_DIR"]
    a = R.router_argv("/bin/vllm-router", "127.0.0.1", 80, ["http://a", "http://b"], "round_robin", 81)
    assert a[a.index("--worker-urls") + 1:a.index("--worker-urls") + 3] == ["http://a", "http://b"]
    assert a[a.index("--policy") + 1] == "round_robin" and a[a.index("--prometheus-port") + 1] == "81"
    monkeypatch.setattr(R.sys, "executable", "/nonexistent/python")
    monkeypatch.setattr(R.shutil, "which", lambda _: None)
    with pytest.raises(FileNotFoundError, match="pip install vllm-router"):
        R.router_binary()
