"""Stage links (transfer.stage): request/reply over a Unix socket with shared-memory payloads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from vllm_kunserve.transfer.errors import PeerFailedError
from vllm_kunserve.transfer.stage import RemoteError, StageClient, StageServer

pytestmark = pytest.mark.unit


def _double(kind, meta, tensors):
    if kind == "boom":
        raise ValueError("bad span")
    return {"kind": kind, "meta": meta}, {k: v * 2 for k, v in tensors.items()}


@pytest.fixture
def link():
    srv = StageServer(_double)
    c = StageClient(srv.address, nbytes=1 << 16)
    yield srv, c
    c.close()
    srv.close()


def test_round_trip_tensors_and_metadata(link):
    srv, c = link
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    y = torch.arange(5, dtype=torch.int64)
    meta, out = c.call("span", {"lo": 2, "t": torch.tensor([1, 2])}, {"x": x, "y": y})
    assert meta["kind"] == "span" and meta["meta"]["lo"] == 2 and meta["meta"]["t"].tolist() == [1, 2]
    assert torch.equal(out["x"], x * 2) and torch.equal(out["y"], y * 2) and out["x"].dtype == torch.float32
    # a payload larger than the buffer: the client maps a bigger one and the server follows
    big = torch.ones(200_000, dtype=torch.float32)
    _, out = c.call("span", None, {"big": big})
    assert torch.equal(out["big"], big * 2)
    assert srv.stats.calls == 2 and srv.stats.bytes_in >= big.numel() * 4


def test_handler_error_reaches_the_caller_and_the_link_stays_up(link):
    _, c = link
    with pytest.raises(RemoteError, match="bad span"):
        c.call("boom")
    _, out = c.call("ok", None, {"a": torch.ones(2)})
    assert out["a"].tolist() == [2.0, 2.0]


def test_dead_peer_is_a_peer_failed_error():
    srv = StageServer(_double)
    c = StageClient(srv.address)
    srv.close()
    with pytest.raises(PeerFailedError):
        c.call("span", None, {"a": torch.ones(2)})
    c.close()


def test_bulk_waits_while_an_activation_is_handled():
    """Activations first: a bulk call that arrives while an activation call is being handled
    runs after it."""
    order = []
    gate = threading.Event()

    def handler(kind, meta, tensors):
        if kind == "act":
            order.append("act-start")
            gate.wait(5)
            order.append("act-end")
        else:
            order.append("bulk")
        return None, {}
    srv = StageServer(handler)
    act, bulk = StageClient(srv.address), StageClient(srv.address, bulk=True)
    try:
        t = threading.Thread(target=act.call, args=("act",))
        t.start()
        while "act-start" not in order:
            time.sleep(0.001)
        tb = threading.Thread(target=bulk.call, args=("kv_put",))
        tb.start()
        time.sleep(0.1)
        gate.set()
        t.join(5)
        tb.join(5)
        assert order == ["act-start", "act-end", "bulk"]
    finally:
        act.close()
        bulk.close()
        srv.close()


def test_only_same_host_addresses():
    with pytest.raises(ValueError, match="unix://"):
        StageClient("tcp://10.0.0.1:5000")


def test_metadata_tensors_travel_in_the_buffer_as_just_their_elements(link):
    from vllm_kunserve.transfer import stage

    srv, c = link
    store = torch.arange(1_000_000, dtype=torch.int32)  # a runner's persistent buffer
    view = store[10:14]
    meta = {"attn": {"layer.0": {"seq": view}, "layer.1": {"seq": view}}, "lo": 3}
    data, tensors = stage._dump_meta(meta)
    assert len(tensors) == 1 and len(data) < 400  # pickle alone wrote the 4 MB storage
    before = srv.stats.bytes_in
    got, _ = c.call("span", meta, {})
    assert srv.stats.bytes_in - before == 16  # the view's 4 elements, once
    echoed = got["meta"]["attn"]
    assert echoed["layer.0"]["seq"].tolist() == [10, 11, 12, 13] and got["meta"]["lo"] == 3
    assert echoed["layer.0"]["seq"] is echoed["layer.1"]["seq"]  # one tensor stays one
    # the received metadata is the caller's to keep: the next call reuses the buffer
    c.call("span", {"t": torch.full((4,), 7, dtype=torch.int32)}, {})
    assert echoed["layer.0"]["seq"].tolist() == [10, 11, 12, 13]


def test_a_handler_can_hold_a_resource_until_its_reply_is_on_its_way():
    """``(meta, tensors, after)``: ``after`` runs once the reply is sent, not before (the caller
    has the reply while ``after`` still waits) and also when the handler's reply cannot be built."""
    got_reply, ran = threading.Event(), []

    def after():
        ran.append(got_reply.wait(5))   # the caller must have the reply already

    def handler(kind, meta, tensors):
        if kind == "unpicklable":
            return lambda: None, {}, after   # the reply's metadata cannot be pickled
        return {"ok": True}, {"x": tensors["x"] + 1}, after

    srv = StageServer(handler)
    c = StageClient(srv.address)
    try:
        meta, out = c.call("span", None, {"x": torch.zeros(3)})
        got_reply.set()
        assert meta == {"ok": True} and out["x"].tolist() == [1.0, 1.0, 1.0]
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == [True]
        with pytest.raises(RemoteError):
            c.call("unpicklable")
        deadline = time.monotonic() + 5
        while len(ran) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(ran) == 2
    finally:
        c.close()
        srv.close()


def test_sent_runs_once_when_the_request_is_on_its_way_or_the_call_fails():
    """``call(..., sent=fn)``: ``fn`` runs before the reply can exist (here the handler waits for
    it: were it run only after the reply, the handler would time out) and exactly once; on a dead
    link it still runs."""
    was_sent = threading.Event()
    calls = []

    def handler(kind, meta, tensors):
        return {"saw_sent": was_sent.wait(5)}, {}

    srv = StageServer(handler)
    c = StageClient(srv.address)
    try:
        meta, _ = c.call("span", None, {"x": torch.ones(2)}, sent=lambda: (calls.append(1), was_sent.set()))
        assert meta == {"saw_sent": True} and calls == [1]
    finally:
        c.close()
        srv.close()
    srv = StageServer(handler)
    c = StageClient(srv.address)
    srv.close()
    with pytest.raises(PeerFailedError):
        c.call("span", None, {"x": torch.ones(2)}, sent=lambda: calls.append(2))
    assert calls == [1, 2]
    c.close()


def test_an_unknown_device_link_is_refused_and_cpu_tensors_never_open_the_device_path():
    srv = StageServer(_double)
    try:
        with pytest.raises(ValueError, match="device_link 'nvlink': one of auto, ipc, host"):
            StageClient(srv.address, device_link="nvlink")
        c = StageClient(srv.address)
        try:
            c.call("x", None, {"x": torch.ones(3)})
            assert c.device_link == "auto" and c._dbuf is None  # nothing on a device: shared memory only
        finally:
            c.close()
    finally:
        srv.close()


def test_a_client_sees_its_server_go_away_between_calls():
    srv = StageServer(_double)
    c = StageClient(srv.address)
    try:
        c.call("x", None, {"x": torch.ones(2)})
        assert not c.peer_closed()
        srv.close()
        deadline = time.monotonic() + 5
        while not c.peer_closed() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.peer_closed()
    finally:
        c.close()
