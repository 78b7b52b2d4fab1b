"""`kunserve serve --engine-url` over two real `vllm serve` engines started elsewhere (issue 37):
answers token-identical to the engines' own, two front ends on one port (--reuse-port) both relay,
a hung engine (SIGSTOP) is retried around after --first-byte-timeout and tripped, one answering 500
is retried around, a killed one is failed over and never restarted by the front end."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from tests.vllm.cluster_client import complete, status
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster, VllmServer, start_all

pytestmark = pytest.mark.vllm

ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(32 << 20),
        "--max-model-len", "256", "--enforce-eager", "--served-model-name", "m"]
PROMPTS = [f"attached {i}: the router fronts {i * 3} engines and" for i in range(4)]


def attach_front(model, engines: list[VllmServer], tmp_path, *extra: str, kcfg: dict | None = None,
                 port: int = 0, log: str = "front.log") -> KunserveCluster:
    """A started ``kunserve serve --engine-url`` front end over ``engines``, polling every 0.25 s."""
    front = KunserveCluster(str(model), [], kcfg, log_path=tmp_path / log, instances=len(engines),
                            startup_timeout_s=120, port=port,
                            extra=[*(x for e in engines for x in ("--engine-url", e.url)), "--monitor-interval", "0.25",
                                   *extra])
    front.start()
    return front


def test_attached_real_engines_hung_answering_500_and_killed(tiny_model, tmp_path):
    """Three `vllm serve` engines started together (one start-up for the three drills): engines 0
    and 1 behind two front ends on one port, then engine 1 hung (SIGSTOP); engine 2 answering 500
    behind a second front end over engines 0 and 2 (``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``, vLLM's own
    switch: its engine core killed, its API server answers every request with 500); then engine 0
    killed, its requests going to engine 1."""
    engines = [VllmServer(str(tiny_model), ARGS, log_path=tmp_path / f"engine{i}.log", startup_timeout_s=400)
               for i in range(2)]
    engines.append(VllmServer(str(tiny_model), ARGS, env={"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"},
                              log_path=tmp_path / "engine2.log", startup_timeout_s=400))
    start_all(engines)
    front = replica = front500 = stopped = None
    try:
        flags = ("--dispatch", "round-robin", "--first-byte-timeout", "3", "--reuse-port")
        front = attach_front(tiny_model, engines[:2], tmp_path, *flags)
        replica = attach_front(tiny_model, engines[:2], tmp_path, *flags, port=front.port, log="replica.log")

        async def shared() -> tuple[list, list[int]]:
            """Each request on a connection of its own, kept open: the kernel spreads the connections over
            the two front ends, and each answers the requests of those it accepted (16 whole answers,
            whose connections stay open, then 8 streams, which a client may close at [DONE])."""
            sessions = [aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) for _ in range(24)]
            try:
                out = [await complete(s, front.url, PROMPTS[k % len(PROMPTS)], max_tokens=24, stream=k >= 16)
                       for k, s in enumerate(sessions)]
                return out, [accepted(f) for f in (front, replica)]
            finally:
                for s in sessions:
                    await s.close()
        both, held = asyncio.run(shared())
        replica.stop()   # from here one front end on the port

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
                direct = [await complete(s, engines[0].url, p, max_tokens=24) for p in PROMPTS]
                via = [await complete(s, front.url, p, max_tokens=24, stream=k % 2 == 0)
                       for k, p in enumerate(PROMPTS)]
                nonlocal stopped
                stopped = engines[1]._proc.proc.pid
                os.kill(stopped, signal.SIGSTOP)    # engine 1's server hangs: accepts, never answers
                t0 = time.monotonic()
                hung = [await complete(s, front.url, p, max_tokens=24, stream=True) for p in PROMPTS]
                hung_s = time.monotonic() - t0
                st_hung = await status(s, front.url)
                os.kill(stopped, signal.SIGCONT)
                stopped = None
                return direct, via, hung, hung_s, st_hung
        direct, via, hung, hung_s, st_hung = asyncio.run(go())

        # engine 2 answers 500, behind a front end over engines 0 and 2 (its instance 1)
        front500 = attach_front(tiny_model, [engines[0], engines[2]], tmp_path, "--dispatch", "round-robin",
                                log="front500.log")

        async def answering_500():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
                os.kill(engine_core_pid(engines[2]), signal.SIGKILL)
                t0 = time.monotonic()
                while True:   # vLLM notices its engine core died: from then on it answers 500
                    broken = await complete(s, engines[2].url, PROMPTS[0], max_tokens=24)
                    if broken.status != 200 or time.monotonic() - t0 > 60:
                        break
                    await asyncio.sleep(0.1)
                via500 = await asyncio.gather(*(complete(s, front500.url, p, max_tokens=24, stream=k % 2 == 0)
                                                for k, p in enumerate(PROMPTS * 2)))
                return broken, via500, await status(s, front500.url)
        broken, via500, st500 = asyncio.run(answering_500())
        front500.stop()

        async def killed_engine():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
                engines[0].stop()                   # engine 0 dies: its requests go to engine 1
                killed = [await complete(s, front.url, p, max_tokens=24, stream=k % 2 == 0)
                          for k, p in enumerate(PROMPTS)]
                return killed, await status(s, front.url)
        killed, st = asyncio.run(killed_engine())
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        for f in (replica, front500, front):
            if f is not None:
                f.stop()
        for e in engines:
            e.stop()
    ref = [a.token_ids for a in direct]
    assert all(len(r) == 24 for r in ref)
    assert [a.token_ids for a in via] == ref
    assert [a.token_ids for a in both] == [ref[k % len(PROMPTS)] for k in range(24)]
    assert sum(held) >= 16 and all(held), held   # both front ends on the port answered some of them
    # every streamed request while engine 1 hung was answered by engine 0; the ones sent to engine 1
    # first waited one --first-byte-timeout, and engine 1's breaker opened after three
    assert [a.token_ids for a in hung] == ref and all(a.error is None for a in hung)
    retries = [e for e in st_hung["events"] if e["event"] == "retry"]
    assert retries and all(e["src"] == 1 and "no response in 3 s" in e["reason"] for e in retries)
    assert hung_s < 3 * (len(retries) + 1) + 30
    # engine 2 answering 500: every request completed token-identical, none reached the client as an
    # error; round-robin sent some to it while the front end still counted it ready: each came back
    # from vLLM as a 500 and went to engine 0
    assert broken.status == 500, (broken.status, broken.error)
    assert all(a.status == 200 and a.error is None for a in via500), [(a.status, a.error) for a in via500]
    assert [a.token_ids for a in via500] == ref * 2
    retries = [e for e in st500["events"] if e["event"] == "retry"]
    assert retries and all(e["src"] == 1 and "answered 500" in e["reason"] for e in retries), retries
    assert [a.token_ids for a in killed] == ref and all(a.status == 200 and a.error is None for a in killed)
    # attached: the front end never restarts what it did not start
    assert st["instances"][0]["restarts"] == 0


def accepted(front: KunserveCluster) -> int:
    """The client connections a front end's process holds open on its port."""
    import psutil

    return sum(1 for c in psutil.Process(front._proc.proc.pid).net_connections("tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == front.port)


def engine_core_pid(server: VllmServer) -> int:
    """The pid of a `vllm serve`'s engine core process (its API server's child ``VLLM::EngineCore``)."""
    import psutil

    kids = psutil.Process(server._proc.proc.pid).children(recursive=True)
    cores = [k.pid for k in kids if "EngineCore" in " ".join([k.name(), *k.cmdline()])]
    assert len(cores) == 1, [(k.pid, k.name()) for k in kids]
    return cores[0]


@pytest.mark.covering
def test_attached_kunserve_engines_are_found_and_grouped(burst_model, tmp_path):
    """Two kunserve `vllm serve` engines started elsewhere, with the kunserve endpoint plugin allowed
    (`VLLM_PLUGINS=kunserve`): `kunserve serve --engine-url` finds each one's control port from the
    engine (`GET /kunserve/engine`, nothing typed), groups them on an operator's drop with outputs
    token-identical to the ungrouped ones, and restore splits the group."""
    from tests.vllm.cluster_client import op
    from tests.vllm.conftest import BURST_KV_BYTES

    args = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(BURST_KV_BYTES),
            "--max-model-len", "512", "--enforce-eager", "--served-model-name", "m"]
    kcfg = {"drop": {"enable": False}}
    engines = [VllmServer(str(burst_model), args, {"kunserve": {**kcfg, "drop": {"enable": False, "group_member": True}}},
                          env={"VLLM_PLUGINS": "kunserve"}, log_path=tmp_path / f"engine{i}.log", startup_timeout_s=600)
               for i in range(2)]
    front = None
    try:
        start_all(engines)
        front = attach_front(burst_model, engines, tmp_path, kcfg=kcfg)

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
                announced = []
                for e in engines:
                    async with s.get(e.url + "/kunserve/engine") as r:
                        announced.append((r.status, await r.json()))
                refs = {p: (await complete(s, front.url, p, max_tokens=64)).token_ids for p in PROMPTS[:3]}
                before = await status(s, front.url)
                code, ev = await op(s, front.url, "drop", {"instances": [0, 1]})
                grouped = await status(s, front.url)
                outs = [await complete(s, front.url, p, max_tokens=64, stream=True) for p in PROMPTS[:3]]
                rcode, _ = await op(s, front.url, "restore", {})
                t0 = time.monotonic()
                while time.monotonic() - t0 < 120:
                    split = await status(s, front.url)
                    if not split["groups"]:
                        break
                    await asyncio.sleep(0.25)
                return announced, refs, before, code, ev, grouped, outs, rcode, split
        announced, refs, before, code, ev, grouped, outs, rcode, split = asyncio.run(go())
    finally:
        if front is not None:
            front.stop()
        for e in engines:
            e.stop()
    assert [a[0] for a in announced] == [200, 200], announced
    assert [i["control_url"] for i in before["instances"]] == [a[1]["control_url"] for a in announced]
    log = (tmp_path / "front.log").read_text()
    assert "0: control " in log and "(from the engine)" in log and "cluster drop: on" in log
    assert code == 200 and ev["members"] == [0, 1], ev
    (g,) = grouped["groups"]
    assert g["state"] == "grouped" and g["members"] == [0, 1]
    assert [o.token_ids for o in outs] == [refs[p] for p in PROMPTS[:3]] and all(len(o.token_ids) == 64 for o in outs)
    assert rcode == 200 and not split["groups"]
