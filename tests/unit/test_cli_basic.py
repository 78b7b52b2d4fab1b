import json
import subprocess
import sys

import pytest

from vllm_kunserve import __version__
from vllm_kunserve.cli.main import main

pytestmark = pytest.mark.unit


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_doctor_reports_entry_point_and_backends(capsys):
    rc = main(["doctor", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["plugin_entry_point"]["registered"] is True
    assert info["plugin_entry_point"]["value"] == "vllm_kunserve.plugin:register"
    assert rc == 0
    assert set(info["memory_backends"]) == {"host", "cuda"}
    assert info["python"].count(".") == 2
    ep = info["endpoint_plugin"]
    assert ep["registered"] is True and ep["value"] == "vllm_kunserve.integration.vllm.endpoint:KunserveEndpoint"
    assert ep["loadable"] is True


def test_doctor_says_whether_vllm_serve_loads_the_endpoint_plugin(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    main(["doctor", "--json"])
    assert json.loads(capsys.readouterr().out)["endpoint_plugin"]["loaded_by_vllm_serve"] is False
    monkeypatch.setenv("VLLM_PLUGINS", "other, kunserve")
    main(["doctor", "--json"])
    assert json.loads(capsys.readouterr().out)["endpoint_plugin"]["loaded_by_vllm_serve"] is True


@pytest.mark.parametrize("argv, needle", [
    (["make-model", "X", "--hidden", "100"], "head_dim"),
    (["make-model", "X", "--heads", "3", "--kv-heads", "2", "--hidden", "96"], "multiple of --kv-heads"),
    (["make-model", "X", "--layers", "0"], "--layers must be positive"),
])
def test_make_model_rejects_bad_shapes(argv, needle, capsys, tmp_path):
    argv[1] = str(tmp_path / "m")
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_unknown_command_is_an_argparse_error():
    r = subprocess.run([sys.executable, "-m", "vllm_kunserve.cli.main", "frobnicate"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_make_model_tiny_loads_in_transformers(tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["make-model", str(tmp_path / "tiny"), "--preset", "tiny"]) == 0
    meta = json.loads(capsys.readouterr().out)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    ids = tok("the memory cache layer", return_tensors="pt").input_ids
    assert ids.shape[1] >= 2 and int(ids.max()) < model.config.vocab_size
    assert model.config.head_dim in (32, 64)
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert abs(n_bytes - meta["weight_mb"] * 2**20) / n_bytes < 0.01


def test_serve_refuses_a_port_in_use_before_starting_any_engine(capsys):
    """The front end binds its port first: a port in use is one clear error, nothing started."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        assert main(["serve", "/no/such/model", "--instances", "2", "--port", str(port)]) == 2
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen there" in err and "nothing was started" in err
    assert "[kunserve] starting" not in capsys.readouterr().out


def test_serve_listen_socket_is_bound_and_not_inherited():
    from vllm_kunserve.cli.serve import listen_socket

    s = listen_socket("127.0.0.1", 0)
    try:
        assert s.getsockname()[0] == "127.0.0.1" and s.getsockname()[1] > 0
        assert not s.get_inheritable()
    finally:
        s.close()
    with pytest.raises(ValueError, match="--host no.such.host.invalid"):
        listen_socket("no.such.host.invalid", 8000)


def test_serve_reuse_port_lets_front_ends_share_a_port_and_only_then():
    from vllm_kunserve.cli.serve import listen_socket

    a = listen_socket("127.0.0.1", 0, reuse_port=True)
    port = a.getsockname()[1]
    a.listen()   # as uvicorn does once the front end serves
    try:
        b = listen_socket("127.0.0.1", port, reuse_port=True)   # a second front end's, on the same port
        assert b.getsockname()[1] == port
        b.close()
        with pytest.raises(ValueError, match=f"--port {port}: cannot listen there"):
            listen_socket("127.0.0.1", port)   # one without --reuse-port is refused as before
    finally:
        a.close()


def test_serve_help_lists_every_option_with_its_default(capsys):
    from vllm_kunserve.cli.serve import _options

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for action in _options()._actions:   # each of the command's own options, with its default
        flag = action.option_strings[0]
        assert flag in out, flag
    for shown in ("--instances INSTANCES", "(default: 1)", "(default: least-work)", "(default: 8000)",
                  "vllm serve --help"):
        assert shown in out, shown


def test_serve_divides_a_cpu_hosts_memory_among_its_engines_and_refuses_an_impossible_split():
    from vllm_kunserve.cli.serve import GiB, memory_split

    args, line = memory_split(2, ["--dtype", "bfloat16"], device="cpu", backend="local", available=20 * GiB,
                              total=24 * GiB, weights=GiB, env={})
    assert args[0] == "--gpu-memory-utilization" and 0.37 <= float(args[1]) <= 0.375   # 0.9 x 20 / 2 of 24
    assert "2 engines share 90%" in line and "--kv-cache-memory-bytes" in line
    args, line = memory_split(2, [], device="cpu", backend="local", available=20 * GiB, total=24 * GiB, weights=GiB,
                              env={}, share=0.3)   # --host-memory-share 0.3
    assert 0.12 <= float(args[1]) <= 0.125 and "2 engines share 30%" in line
    import argparse

    from vllm_kunserve.cli.serve import parse
    assert parse(argparse.Namespace(model="m", rest=["--host-memory-share", "0.3"]))[0].host_memory_share == 0.3
    for bad in ("0", "1.5", "-0.2", "nan"):
        with pytest.raises(ValueError, match="--host-memory-share must be in"):
            parse(argparse.Namespace(model="m", rest=["--host-memory-share", bad]))
    # the user sized the engines, or one engine, or a GPU, or Ray: left to vLLM
    for kw in ({"engine_args": ["--kv-cache-memory-bytes", "1000000"]}, {"engine_args": ["--gpu-memory-utilization=0.3"]},
               {"env": {"VLLM_CPU_KVCACHE_SPACE": "4"}}, {"instances": 1}, {"device": "cuda"}, {"backend": "ray"}):
        a = {"instances": 2, "engine_args": [], "device": "cpu", "backend": "local", "env": {}, **kw}
        assert memory_split(a["instances"], a["engine_args"], device=a["device"], backend=a["backend"],
                            available=20 * GiB, total=24 * GiB, weights=GiB, env=a["env"]) == ([], "")
    with pytest.raises(ValueError, match="--instances 8: each engine would get 1.12 GiB .* fewer engines"):
        memory_split(8, [], device="cpu", backend="local", available=10 * GiB, total=24 * GiB, weights=2 * GiB, env={})


def test_serve_gives_each_local_cpu_engine_cores_of_its_own_unless_told():
    from vllm_kunserve.cluster.fleet.spec import EngineSpec, cpu_split, engine_env

    env, line = cpu_split(2, device="cpu", backend="local", cpus=[1, 0], env={})
    assert env == {"KUNSERVE_ENGINE_CPUS": "0|1"} and "set KUNSERVE_ENGINE_CPUS to choose" in line
    assert [engine_env(EngineSpec("m", env=env), i)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(2)] == ["0", "1"]
    assert cpu_split(2, device="cpu", backend="local", cpus=list(range(8)) + [10, 11, 12], env={})[0] == \
        {"KUNSERVE_ENGINE_CPUS": "0-4|5-7,10-11"}   # equal runs, a gap written as vLLM's id list
    assert cpu_split(4, device="cpu", backend="local", cpus=[0, 1], env={})[0] == {"KUNSERVE_ENGINE_CPUS": "0|1|0|1"}
    # the user chose, or one engine, or not a CPU, or not local engines: left to vLLM
    for kw in ({"env": {"KUNSERVE_ENGINE_CPUS": "0"}}, {"env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}},
               {"instances": 1}, {"device": "cuda"}, {"backend": "ray"}, {"backend": "attach"}):
        a = {"instances": 2, "device": "cpu", "backend": "local", "env": {}, **kw}
        assert cpu_split(a["instances"], device=a["device"], backend=a["backend"], cpus=[0, 1], env=a["env"]) == ({}, "")


def test_serve_puts_one_engine_on_each_gpu_and_refuses_more_engines_than_gpus():
    from vllm_kunserve.cli.serve import device_split
    from vllm_kunserve.cluster.fleet.spec import EngineSpec, engine_env

    env, line = device_split(3, device="cuda", backend="local", devices=4, env={})
    assert env == {"KUNSERVE_ENGINE_GPUS": "0|1|2"} and "one GPU per engine" in line
    spec = EngineSpec("m", env=env)
    assert [engine_env(spec, i)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["0", "1", "2"]
    # the user chose, or one engine, or not CUDA, or Ray: left alone
    for kw in ({"env": {"CUDA_VISIBLE_DEVICES": "1,2"}}, {"env": {"KUNSERVE_ENGINE_GPUS": "0,1|2,3"}},
               {"instances": 1}, {"device": "cpu"}, {"backend": "ray"}):
        a = {"instances": 2, "device": "cuda", "backend": "local", "env": {}, **kw}
        assert device_split(a["instances"], device=a["device"], backend=a["backend"], devices=4, env=a["env"]) == ({}, "")
    with pytest.raises(ValueError, match="--instances 3: this host has 2 GPU.*KUNSERVE_ENGINE_GPUS.*0\\|1\\|0"):
        device_split(3, device="cuda", backend="local", devices=2, env={})
    assert engine_env(EngineSpec("m", env={"KUNSERVE_ENGINE_GPUS": "0,1|2,3"}), 3)["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_an_engine_that_fails_to_start_is_one_line_naming_it_its_first_error_and_its_log(tmp_path):
    from vllm_kunserve.cluster.fleet.launcher import StartupExited

    log = tmp_path / "engine-1.log"
    log.write_text("INFO starting\nERROR 11-27 [core.py:1] EngineCore failed to start.\nTraceback (most recent call last):\n"
                   "  File \"x.py\", line 1, in <module>\nValueError: Available memory on node 0 (3.1/23.4 GiB) on startup "
                   "is less than desired CPU memory utilization (0.92, 21.5 GiB).\nRuntimeError: Engine core initialization failed.\n")
    e = StartupExited("server exited with code 1 ...", log, instance=1)
    line = e.one_line()
    assert "\n" not in line and line.startswith("instance 1 failed to start: ValueError: Available memory")
    assert str(log) in line


def test_serve_refuses_a_non_loopback_address_without_a_token(capsys, monkeypatch):
    monkeypatch.delenv("KUNSERVE_CONTROL_TOKEN", raising=False)
    assert main(["serve", "/no/such/model", "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 is reachable from other machines: set --token" in err
    assert "[kunserve] starting" not in capsys.readouterr().out
    assert main(["serve", "/no/such/model", "--backend", "ray", "--ray-address", "ray://head:10001",
                 "--kunserve-config", "{}"]) == 2
    assert "set --token" in capsys.readouterr().err


def test_serve_takes_vllms_api_keys_and_an_attached_engines_own_key_only_with_engine_url(monkeypatch):
    import argparse

    from vllm_kunserve.cli import serve

    monkeypatch.setattr(serve, "_tokenizer", lambda name: None)   # no tokenizer named "m" to look up

    from vllm_kunserve.cli.serve import api_keys, check_engine_args, parse

    # vLLM's precedence: --api-key (one or more) over VLLM_API_KEY; neither: no key
    assert api_keys(check_engine_args("m", ["--api-key", "k1", "k2"]), {"VLLM_API_KEY": "env"}) == ["k1", "k2"]
    assert api_keys(check_engine_args("m", []), {"VLLM_API_KEY": "env"}) == ["env"]
    assert api_keys(check_engine_args("m", []), {}) == []
    with pytest.raises(ValueError, match="--engine-api-key needs --engine-url"):
        parse(argparse.Namespace(model="m", rest=["--engine-api-key", "ek"]))
    with pytest.raises(ValueError, match="--engine-api-key: empty"):
        parse(argparse.Namespace(model="m", rest=["--engine-url", "http://h:1", "--engine-api-key", " "]))
    opts, _ = parse(argparse.Namespace(model="m", rest=["--engine-url", "http://h:1", "--engine-api-key", "ek"]))
    assert opts.engine_api_key == "ek"
    # wired into the front end: clients' keys from vLLM's flag, the attached engines' own key from ours
    from vllm_kunserve.cli.serve import build

    rest = ["--engine-url", "http://h:1", "--engine-api-key", "ek", "--api-key", "ck"]
    opts, engine_args = parse(argparse.Namespace(model="m", rest=rest))
    _, front = build("m", opts, engine_args, check_engine_args("m", engine_args))
    assert front.api_keys == ("ck",) and front.engine_api_key == "ek"
    opts, engine_args = parse(argparse.Namespace(model="m", rest=["--api-key", "ck"]))
    _, front = build("m", opts, engine_args, check_engine_args("m", engine_args))
    assert front.api_keys == ("ck",) and front.engine_api_key == "ck"   # the engines it starts get --api-key


def test_serve_takes_memory_admission_and_refuses_bad_bounds_in_one_line():
    import argparse

    from vllm_kunserve.cli.serve import parse
    opts = parse(argparse.Namespace(model="m", rest=["--admission", "memory", "--admission-queue", "8",
                                                      "--admission-wait", "5"]))[0]
    assert (opts.admission, opts.admission_queue, opts.admission_wait) == ("memory", 8, 5.0)
    assert parse(argparse.Namespace(model="m", rest=[]))[0].admission == "off"
    for bad in (["--admission-queue", "-1"], ["--admission-wait", "0"]):
        with pytest.raises(ValueError, match="--admission-queue must be >= 0 and --admission-wait > 0"):
            parse(argparse.Namespace(model="m", rest=bad))


def test_serve_takes_ray_resources_and_placement_and_refuses_bad_ones_in_one_line(capsys):
    import argparse

    from vllm_kunserve.cli.serve import parse
    opts = parse(argparse.Namespace(model="m", rest=["--backend", "ray", "--ray-resources", '{"engine_slot": 1}',
                                                      "--ray-placement", "pack"]))[0]
    assert opts.ray_resources == {"engine_slot": 1.0} and opts.ray_placement == "pack"
    opts = parse(argparse.Namespace(model="m", rest=["--backend", "ray"]))[0]
    assert opts.ray_resources == {} and opts.ray_placement == "spread"
    for bad, why in (('{"slot": 0}', "amounts > 0"), ('["slot"]', "amounts > 0"), ("{slot", "not valid JSON"),
                     ('{"CPU": 2}', "built-in resources")):
        with pytest.raises(ValueError, match=f"--ray-resources: .*{why}"):
            parse(argparse.Namespace(model="m", rest=["--backend", "ray", "--ray-resources", bad]))
    with pytest.raises(ValueError, match="need --backend ray"):
        parse(argparse.Namespace(model="m", rest=["--ray-placement", "pack"]))
    with pytest.raises(SystemExit) as e:   # argparse's own one line
        main(["serve", "m", "--backend", "ray", "--ray-placement", "scatter"])
    assert e.value.code == 2 and "invalid choice: 'scatter'" in capsys.readouterr().err
