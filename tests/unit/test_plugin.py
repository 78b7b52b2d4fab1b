"""The plugin's activation gate (vLLM's EngineArgs class is imported; no engine is built)."""

import sys
import time
import types

import pytest

from vllm_kunserve import plugin

pytestmark = pytest.mark.unit

EngineArgs = pytest.importorskip("vllm.engine.arg_utils").EngineArgs


@pytest.fixture
def gate(monkeypatch):
    """A fresh gate over a stand-in ``create_engine_config`` (restored afterwards)."""
    made = []

    def create_engine_config(self, *a, **kw):
        cfg = types.SimpleNamespace(additional_config=self.additional_config, model_config=None,
                                    parallel_config=types.SimpleNamespace(worker_extension_cls=""))
        made.append(cfg)
        return cfg

    monkeypatch.setattr(EngineArgs, "create_engine_config", create_engine_config)
    monkeypatch.setitem(plugin._state, "gate", None)
    monkeypatch.setitem(plugin._state, "patches", [])
    # setenv (not delenv) so that teardown removes what activate() exports: it must not leak into
    # engines this test process starts later (they would apply the touchpoints)
    monkeypatch.setenv(plugin.ENV_PATCHES, "")
    monkeypatch.setenv(plugin.ENV_FEATURES, "")
    plugin.register()
    yield made
    from vllm_kunserve.integration.vllm import revert_all

    revert_all()


def _args(additional):
    return types.SimpleNamespace(additional_config=additional, worker_extension_cls="", enforce_eager=False)


def test_register_installs_only_the_gate_and_imports_nothing(gate, monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm_kunserve.integration.vllm", raising=False)
    assert getattr(EngineArgs.create_engine_config, "__kunserve_gate__", False)
    out = EngineArgs.create_engine_config(_args({"someone_else": 1}))
    assert out is gate[-1] and out.parallel_config.worker_extension_cls == ""
    assert plugin.applied_patches() == []
    assert "vllm_kunserve.integration.vllm" not in sys.modules


def test_gate_rejects_bad_config_naming_the_key(gate):
    from vllm_kunserve.config import KunServeConfigError

    with pytest.raises(KunServeConfigError, match="kunserve.bogus"):
        EngineArgs.create_engine_config(_args({"kunserve": {"bogus": 1}}))
    assert gate == []  # vLLM's config was never built


def test_gate_activates_per_engine_and_exports_patches(gate, monkeypatch):
    a = _args({"kunserve": {}})
    EngineArgs.create_engine_config(a)
    assert a.worker_extension_cls.endswith("KunServeWorkerExtension")
    assert plugin.applied_patches() == ["worker_extension"]
    import os

    assert os.environ[plugin.ENV_PATCHES] == "worker_extension"
    stock = EngineArgs.create_engine_config(_args(None))  # a later stock engine stays stock
    assert stock.parallel_config.worker_extension_cls == ""
    assert plugin.ENV_PATCHES not in os.environ  # and its processes apply nothing
    b = _args({"kunserve": {"remap": {"enable": True}}})
    EngineArgs.create_engine_config(b)
    assert b.enforce_eager is True
    assert set(os.environ[plugin.ENV_PATCHES].split(",")) >= {"worker_extension", "kv_plan", "engine_core"}


def test_shm_wait_setting_makes_every_queue_reader_sleep_instead_of_spinning(monkeypatch):
    """KUNSERVE_SHM_WAIT_MS: register() makes vLLM's shared-memory queue readers, while busy, sleep on
    the writer's signal for up to that many ms instead of spinning on sched_yield() (in any process,
    stock engines too); a lost signal costs at most that slice. Unset: vLLM's spin, untouched."""
    zmq = pytest.importorskip("zmq")
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    from vllm_kunserve.integration.vllm import shm_wait

    SLICE, n_waits = 0.1, 5

    def waits() -> tuple[float, float, float]:
        """(CPU s, wall s) of n_waits busy-window waits with no writer signal, and the wall s of one wait
        the writer signalled (the reader must return on the signal, well before its slice)."""
        ctx = zmq.Context()
        try:
            addr = get_open_zmq_ipc_path()
            writer = shm_broadcast.SpinCondition(False, ctx, addr)
            reader = shm_broadcast.SpinCondition(True, ctx, addr)
            reader.busy_loop_s = 60.0  # in the busy window throughout
            c, t = time.thread_time(), time.perf_counter()
            for _ in range(n_waits):
                reader.wait(timeout_ms=5000)
            cpu, wall = time.thread_time() - c, time.perf_counter() - t
            time.sleep(0.2)  # the subscription has propagated
            writer.notify()
            time.sleep(0.05)
            t = time.perf_counter()
            reader.wait(timeout_ms=5000)
            signalled = time.perf_counter() - t
            for s in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket,
                      writer.local_notify_socket):
                s.close(linger=0)
            return cpu, wall, signalled
        finally:
            ctx.term()

    monkeypatch.delenv(shm_wait.ENV, raising=False)
    assert shm_wait.apply_from_env() is None
    _, stock_wall, _ = waits()
    # vLLM: each wait is one sched_yield(), the caller spins (bounds: half the patched minimum, so that a
    # loaded host's yields, which may give the core away for a few ms, cannot blur the two apart)
    assert stock_wall < n_waits * SLICE * 0.75 / 2
    monkeypatch.setenv(shm_wait.ENV, str(int(SLICE * 1000)))
    monkeypatch.setitem(plugin._state, "gate", None)
    monkeypatch.setattr(EngineArgs, "create_engine_config", EngineArgs.create_engine_config)  # gate undone after
    try:
        plugin.register()
        cpu, wall, signalled = waits()
        assert wall >= n_waits * SLICE * 0.75 and cpu < 0.5 * wall  # each wait slept its slice, off the CPU
        assert wall < n_waits * 1.0  # ... and never waited for vLLM's 5 s recheck
        assert signalled < SLICE / 2  # the writer's signal ends the sleep
        plugin.register()  # a second load in the same process does not wrap twice
        assert len(shm_wait._applied) == 1
    finally:
        shm_wait.revert()
    _, wall, _ = waits()
    assert wall < n_waits * SLICE * 0.75 / 2
    for bad in ("-1", "soon", "inf", "nan", "1000"):
        with pytest.raises(ValueError, match=shm_wait.ENV):
            shm_wait.wanted_wait_ms({shm_wait.ENV: bad})
    assert shm_wait.wanted_wait_ms({shm_wait.ENV: "0"}) is None
    assert shm_wait.wanted_wait_ms({shm_wait.ENV: "1.5"}) == 1.5


def test_a_group_member_refuses_a_cuda_platform_unless_told(monkeypatch):
    """Pipeline groups have run inside vLLM on CPU only: on CUDA a group member refuses to start with
    one line naming the setting that overrides it; a CPU member, a remap-only engine and an engine
    with the override start."""
    from vllm_kunserve.config import KunServeConfigError, parse_config
    from vllm_kunserve.integration.vllm import engine_hooks as H

    member = parse_config({"drop": {"group_member": True}})
    with pytest.raises(KunServeConfigError) as e:
        H.check_group_device(member, "cuda")
    assert "\n" not in str(e.value) and "drop.allow_unvalidated_cuda=true" in str(e.value)
    H.check_group_device(member, "cpu")
    H.check_group_device(parse_config({"remap": {"enable": True}}), "cuda")
    forced = parse_config({"drop": {"group_member": True, "allow_unvalidated_cuda": True}})
    H.check_group_device(forced, "cuda")
    monkeypatch.setattr(H, "platform_device", lambda: "cuda")
    holder = types.SimpleNamespace(enforce_eager=True)
    with pytest.raises(KunServeConfigError, match="CPU only"):
        H.EngineCorePatch().configure(member, holder)


def test_a_group_member_runs_eager_and_without_cascade_attention():
    """Dropped layers' forwards are replaced and a peer's span carries one FA plan: a member's
    EngineArgs get enforce_eager and disable_cascade_attn; a built config that has cascade on is
    refused in one line; a remap-only engine keeps the user's cascade setting."""
    from vllm_kunserve.config import KunServeConfigError, parse_config
    from vllm_kunserve.integration.vllm import engine_hooks as H

    member = parse_config({"drop": {"group_member": True}})
    args = types.SimpleNamespace(enforce_eager=False, disable_cascade_attn=False)
    H.EngineCorePatch().configure(member, args)
    assert args.enforce_eager is True and args.disable_cascade_attn is True
    remap = types.SimpleNamespace(enforce_eager=False, disable_cascade_attn=False)
    H.EngineCorePatch().configure(parse_config({"remap": {"enable": True}}), remap)
    assert remap.enforce_eager is True and remap.disable_cascade_attn is False
    built = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=True, disable_cascade_attn=False))
    with pytest.raises(KunServeConfigError, match="without cascade attention") as e:
        H.EngineCorePatch().configure(member, built)
    assert "\n" not in str(e.value)
    built.model_config.disable_cascade_attn = True
    H.EngineCorePatch().configure(member, built)


def test_a_group_member_with_tensor_parallelism_is_refused_in_one_line():
    from vllm_kunserve.config import KunServeConfigError, parse_config
    from vllm_kunserve.integration.vllm import engine_hooks as H

    member = parse_config({"drop": {"group_member": True}})
    for holder in (types.SimpleNamespace(enforce_eager=True, tensor_parallel_size=2),
                   types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=2),
                                         model_config=types.SimpleNamespace(enforce_eager=True))):
        with pytest.raises(KunServeConfigError, match="tensor parallelism") as e:
            H.EngineCorePatch().configure(member, holder)
        assert "\n" not in str(e.value)
    H.EngineCorePatch().configure(parse_config({"remap": {"enable": True}}),   # remap runs with TP (tests/vllm)
                                  types.SimpleNamespace(enforce_eager=True, tensor_parallel_size=2))


def test_a_cuda_group_member_refuses_an_attention_backend_its_spans_cannot_carry(monkeypatch):
    from vllm_kunserve.config import KunServeConfigError, parse_config
    from vllm_kunserve.integration.vllm import engine_hooks as H

    monkeypatch.setattr(H, "platform_device", lambda: "cuda")
    member = parse_config({"drop": {"group_member": True, "allow_unvalidated_cuda": True}})

    def built(backend):
        return types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=True),
                                     attention_config=types.SimpleNamespace(backend=backend))

    with pytest.raises(KunServeConfigError, match="refusing attention backend FLASHINFER") as e:
        H.EngineCorePatch().configure(member, built(types.SimpleNamespace(name="FLASHINFER")))
    assert "\n" not in str(e.value)
    H.EngineCorePatch().configure(member, built(types.SimpleNamespace(name="FLASH_ATTN")))
    H.EngineCorePatch().configure(member, built(None))   # vLLM's choice (FlashAttention on Hopper)
    monkeypatch.setattr(H, "platform_device", lambda: "cpu")
    H.EngineCorePatch().configure(member, built(types.SimpleNamespace(name="CPU_ATTN")))
