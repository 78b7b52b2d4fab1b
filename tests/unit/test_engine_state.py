"""The control port's ``/state`` as one type (``engine.state.EngineState``): what the agent publishes
reads back to the same values, a malformed state is an error that names the field, and the
cluster's control-port client and monitor read it typed (``cluster.control.client``)."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import aiohttp
import pytest

from tests.unit.test_control_port import FakeEngine
from tests.unit.test_engine_agent import _agent
from vllm_kunserve.cli.main import main
from vllm_kunserve.cluster.control.client import (ControlClient, ControlPortError, ControlPortNotAnObject,
                                                  ControlPortUnreachable)
from vllm_kunserve.cluster.control.monitor import Monitor
from vllm_kunserve.engine.control import ControlServer
from vllm_kunserve.engine.state import EngineState, EngineStateError, Layer

pytestmark = pytest.mark.unit


def _full_state() -> dict:
    """Every key the agent writes, with values of each kind (a grouped member mid-operation)."""
    return {
        "engine": {"label": "1", "pid": 4242, "model": "/models/tiny", "hidden_size": 64, "max_num_batched_tokens": 512,
                   "stage": ["unix:///tmp/s1", "unix:///tmp/s1b"], "control_url": "http://127.0.0.1:9"},
        "phase": "grouped", "operation": {"op": "group_leave", "started": 1.7e9, "params": {"source": "peer"}},
        "auto": False, "errors": 2,
        "capacity": {"blocks_total": 130, "blocks_base": 88, "blocks_max": 176, "block_size": 32, "block_bytes": 8192},
        "blocks": {"used": 40, "free": 89, "queued": 10, "demand": 61, "draining": 0},
        "requests": {"waiting": 2, "running": 14, "prefill_tokens": 300, "decode_tokens": 14,
                     "mix_prompt_tokens": 900, "mix_output_tokens": 4480},
        "layers": [{"index": i, "state": s, "bytes": 3 << 20} for i, s in enumerate(["resident", "dropped", "streamed"])],
        "remapped_layers": [2], "slots": 1, "dropped_layers": [1],
        "group": {"name": "e1", "drop": [1], "spans": [[1, 2, "e0"]], "peers": {"e0": "unix:///tmp/s0"},
                  "since": 1.7e9, "blocks": 130},
        "pipeline": {"hops": 12, "rtt_ms": 0.4}, "h2d_bytes_per_s": 1e10, "copy_overlap": True,
        "remap_room_bytes": 6 << 20, "tenancy": {"lent": 3, "borrowed_blocks": 0, "repaying": False, "held_bytes": 1 << 30},
        "events": [{"event": "group_join", "outcome": "ok", "ms": 12.5, "bytes": 10, "time": 1.7e9}],
    }


def test_the_agents_state_reads_back_to_the_same_values():
    agent, workers, _ = _agent()
    agent.info.update(model="/models/tiny", control_url="http://127.0.0.1:9", stage=["unix:///tmp/s0"])
    agent.remap([1, 4], 1)
    sent = agent.control_state()
    for d in (sent, json.loads(json.dumps(sent))):   # as published, and as it crosses the wire
        st = EngineState.from_dict(d)
        assert st.to_dict() == d
        assert list(st.to_dict()) == list(d) and list(st.to_dict()["engine"]) == list(d["engine"])
    st = EngineState.from_dict(sent)
    assert st.engine.label == "0" and st.engine.pid == os.getpid() and st.engine.stage == ("unix:///tmp/s0",)
    assert st.engine.control_url == "http://127.0.0.1:9" and st.engine.model == "/models/tiny"
    assert st.phase == "remapped" and st.remapped_layers == (1, 4) and st.slots == 1 and st.operation is None
    assert st.capacity.blocks_total == agent.sched.visible and st.capacity.block_size == 16
    assert st.capacity.blocks_base == agent.sched.base and st.capacity.block_bytes == agent.block_bytes
    assert [x.state for x in st.layers].count("streamed") == 2 and st.layers[1] == Layer(1, "streamed",
                                                                                         agent.layer_bytes_each[1])
    assert st.blocks.used == 0 and st.requests.running == 0 and st.events[-1]["event"] == "remap"


def test_every_field_round_trips_and_is_typed():
    d = _full_state()
    st = EngineState.from_dict(d)
    assert st.to_dict() == d and EngineState.from_dict(st.to_dict()) == st
    assert st.engine.get("hidden_size") == 64 and st.engine.get("vllm", "-") == "-"
    assert st.group["name"] == "e1" and st.dropped_layers == (1,) and st.copy_overlap is True
    assert st.requests.mix_output_tokens == 4480 and st.blocks.demand == 61 and st.auto is False


def test_missing_keys_read_as_none():
    st = EngineState.from_dict({"phase": "draining", "capacity": {"blocks_total": 8}, "blocks": None})
    assert st.phase == "draining" and st.capacity.blocks_total == 8 and st.capacity.block_size is None
    assert st.blocks.used is None and st.layers == () and st.events == () and st.engine.pid is None


@pytest.mark.parametrize("bad,field", [
    ([1, 2], "the state"), ("state", "the state"),
    ({"capacity": [120]}, "capacity"), ({"capacity": {"blocks_total": "120"}}, "capacity.blocks_total"),
    ({"capacity": {"block_size": 16.5}}, "capacity.block_size"), ({"blocks": {"used": True}}, "blocks.used"),
    ({"requests": {"running": [3]}}, "requests.running"), ({"layers": {"0": "resident"}}, "layers"),
    ({"layers": [{"index": 0, "state": "resident"}, "dropped"]}, "layers[1]"),
    ({"layers": [{"index": 0, "state": 3}]}, "layers[0].state"), ({"engine": "e0"}, "engine"),
    ({"engine": {"stage": "unix:///s"}}, "engine.stage"), ({"engine": {"pid": "4242"}}, "engine.pid"),
    ({"phase": 1}, "phase"), ({"auto": "yes"}, "auto"), ({"events": [1]}, "events"),
    ({"remapped_layers": [1, "2"]}, "remapped_layers"), ({"group": ["e0"]}, "group"),
    ({"h2d_bytes_per_s": "fast"}, "h2d_bytes_per_s"),
])
def test_a_malformed_state_is_an_error_naming_the_field(bad, field):
    with pytest.raises(EngineStateError, match=r"^engine state: " + field.replace("[", r"\[").replace("]", r"\]")
                       + " must be"):
        EngineState.from_dict(bad)


# -- the control-port client and the monitor ---------------------------------------------------------------
def test_the_client_reads_state_and_runs_operations():
    engine = FakeEngine()

    async def go(url):
        async with aiohttp.ClientSession() as session:
            client = ControlClient("t0k")
            st = await client.state(session, url)
            grown = await client.op(session, url, "grow", {"n": 8}, timeout_s=5)
            with pytest.raises(ControlPortError) as refused:
                await client.op(session, url, "busy", {})
            with pytest.raises(ControlPortError) as no_token:
                await ControlClient().state_json(session, url)
            return st, grown, refused.value, no_token.value

    with ControlServer(engine, token="t0k") as srv:
        st, grown, refused, no_token = asyncio.run(go(srv.url))
        assert ControlClient("t0k").get_json(srv.url + "/state")["capacity"]["blocks_total"] == 128
        with pytest.raises(ControlPortError) as wrong:
            ControlClient("bad").get_json(srv.url + "/state")
    assert st.capacity.blocks_total == 120 and st.engine.label == "0" and st.layers[2].state == "streamed"
    assert grown == {"blocks_total": 128} and engine.calls == [("grow", {"n": 8}), ("busy", {})]
    assert refused.status == 409 and "in progress" in str(refused.body) and no_token.status == 401
    assert wrong.value.status == 403
    with pytest.raises(ControlPortUnreachable):
        ControlClient().get_json(srv.url + "/state", 2)


def test_get_json_refuses_an_answer_that_is_not_an_object():
    engine = FakeEngine()
    engine.control_state = lambda: [1, 2]
    with ControlServer(engine) as srv:
        with pytest.raises(ControlPortNotAnObject) as e:
            ControlClient().get_json(srv.url + "/state")
    assert e.value.body == "list"


def test_the_monitor_reads_the_state_typed_and_names_a_malformed_one():
    engine = FakeEngine()
    with ControlServer(engine) as srv:
        e = SimpleNamespace(index=0, accepting=True, control_url=srv.url, url="")
        mon = Monitor([e])

        async def poll():
            async with aiohttp.ClientSession() as session:
                return await mon.poll_one(session, e)
        good = asyncio.run(poll())
        engine.state["capacity"]["blocks_total"] = "lots"
        bad = asyncio.run(poll())
    assert good.ok and good.source == "control" and good.engine_state == EngineState.from_dict(good.state)
    assert (good.capacity_blocks, good.block_size, good.used_blocks, good.queued_blocks) == (120, 32, 40, 10)
    assert (good.running, good.waiting) == (14, 2) and good.view()["engine"]["phase"] == "base"
    assert not bad.ok and "EngineStateError" in bad.error and "capacity.blocks_total" in bad.error


def test_status_says_in_one_line_that_a_state_is_malformed(capsys):
    engine = FakeEngine()
    engine.state["layers"] = "RRSRD"
    with ControlServer(engine) as srv:
        assert main(["status", "--url", srv.url]) == 1
        err = capsys.readouterr().err
        assert "layers must be a list" in err and err.count("\n") == 1
        assert main(["status", "--url", srv.url, "--json"]) == 0   # the raw state is still shown
