"""Transfer channels between two real processes on CPU (gloo over 127.0.0.1)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from vllm_kunserve.transfer import (PeerFailedError, TransferCancelled, TransferError, connect,
                                    make_store)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

# The peer process. Modes: "sink" receives what the plan lists and reports it as JSON;
# "source" streams one slow bulk transfer to the test process.
PEER = textwrap.dedent("""
    import hashlib, json, sys, time
    import torch
    from vllm_kunserve.transfer import TransferCancelled, connect

    mode, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    plan = json.loads(sys.argv[4])
    if mode == "source":
        slow = lambda h, i: time.sleep(0.01)
        ch = connect(1, port=port, timeout_s=plan["timeout"], on_chunk_sent=slow)
        ch.send_bulk(torch.ones(plan["bytes"], dtype=torch.uint8), "payload", chunk_bytes=plan["chunk"]).wait()
        ch.close()
        sys.exit(0)
    chans = {name: connect(1, port=port, name=name, timeout_s=20, record=True) for name in plan["channels"]}
    report = {}
    for name, ch in chans.items():
        got = {}
        for bulk in plan["bulks"][name]:
            try:
                _, (t,) = ch.recv_bulk(bulk, timeout=30)
                got[bulk] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
            except TransferCancelled as exc:
                got[bulk] = "cancelled: " + str(exc)
        acts = [ch.recv_activation(timeout=30) for _ in range(plan["acts"][name])]
        report[name] = {"bulks": got, "acts": [[a.seq, a.tag, a.tensor.tolist()] for a in acts],
                        "rx_log": ch.stats.rx_log}
        ch.send_activation(torch.tensor([len(acts)]), tag=7)  # proves the reverse direction works
    with open(out, "w") as f:
        json.dump(report, f)
    for ch in chans.values():
        ch.close()
""")


def _spawn(tmp_path, mode: str, port: int, plan: dict) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    out = str(tmp_path / f"{mode}.json")
    proc = subprocess.Popen([sys.executable, str(script), mode, str(port), out, json.dumps(plan)],
                            cwd=os.getcwd(), env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, out


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_activations_preempt_bulk_in_order_and_bulk_arrives_intact(tmp_path):
    store = make_store(0)
    plan = {"channels": ["prio", "fifo"],
            "bulks": {"prio": ["A", "C", "big"], "fifo": ["A"]},
            "acts": {"prio": 3, "fifo": 3}}
    proc, out = _spawn(tmp_path, "sink", store.port, plan)
    try:
        queued_at: dict[str, int] = {}

        def make_hook(name):
            def on_chunk(h, i):  # runs on the sender thread right after chunk i left
                if h.name == "A" and i == 2:
                    chans[name].send_activation(torch.tensor([1.0, 2.0]), tag=10)
                    chans[name].send_activation(torch.tensor([3.0]), tag=11)
                    chans[name].send_activation(torch.zeros(2, 3), tag=12)
                    queued_at[name] = i
                if h.name == "C" and i == 1:
                    h.cancel()
            return on_chunk

        chans = {}
        for name in plan["channels"]:
            chans[name] = connect(0, store=store, name=name, chunk_bytes=64 << 10, timeout_s=20,
                                  priority=(name == "prio"), record=True, on_chunk_sent=make_hook(name))
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)  # 16 chunks
        c = torch.zeros(1 << 20, dtype=torch.uint8)
        big = torch.randn(8 << 20, generator=gen)  # 32 MiB, integrity check
        prio, fifo = chans["prio"], chans["fifo"]
        ha = prio.send_bulk(a, "A")
        hc = prio.send_bulk(c, "C")
        hbig = prio.send_bulk(big, "big", chunk_bytes=(2 << 20) - 12)  # ragged last chunk
        hfa = fifo.send_bulk(a, "A")
        ha.wait(30)
        with pytest.raises(TransferCancelled, match="'C' cancelled after 2/16"):
            hc.wait(30)
        hbig.wait(60)
        hfa.wait(30)
        assert hbig.progress()["bytes_done"] == big.numel() * 4 and hbig.num_chunks == 17
        assert prio.stats.preemptions == 3 and fifo.stats.preemptions == 0
        backs = {n: ch.recv_activation(timeout=30) for n, ch in chans.items()}
        assert all(b.tag == 7 and b.tensor.tolist() == [3] for b in backs.values())
        for ch in chans.values():
            ch.close(timeout=10)
        assert proc.wait(timeout=60) == 0
        report = json.load(open(out))
    finally:
        if proc.poll() is None:
            proc.kill()

    rp, rf = report["prio"], report["fifo"]
    assert rp["bulks"]["A"] == _sha(a) and rf["bulks"]["A"] == _sha(a)
    assert rp["bulks"]["big"] == _sha(big.view(torch.uint8))
    assert rp["bulks"]["C"].startswith("cancelled")
    # activations arrive complete and in send order on both channels
    for r in (rp, rf):
        assert [x[1] for x in r["acts"]] == [10, 11, 12]
        assert r["acts"][0][2] == [1.0, 2.0] and r["acts"][2][2] == [[0.0] * 3] * 2
    # priority: queued after chunk 2 of A, all three go out before chunk 3
    log = [tuple(x) for x in rp["rx_log"]]
    i2 = log.index(("chunk", "A", 2))
    assert [e[0] for e in log[i2 + 1:i2 + 4]] == ["act"] * 3
    assert log[i2 + 4] == ("chunk", "A", 3)
    # FIFO baseline: they wait for the whole bulk transfer
    flog = [tuple(x) for x in rf["rx_log"]]
    assert flog.index(("act", 0)) > flog.index(("chunk", "A", 15))


def test_peer_killed_mid_send_is_a_clean_error(tmp_path):
    store = make_store(0)
    proc, _ = _spawn(tmp_path, "sink", store.port, {"channels": ["kunserve"],
                                                    "bulks": {"kunserve": ["doomed"]},
                                                    "acts": {"kunserve": 0}})

    def kill_at_5(h, i):
        if i == 5:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)

    ch = connect(0, store=store, chunk_bytes=256 << 10, timeout_s=20, on_chunk_sent=kill_at_5)
    try:
        h = ch.send_bulk(torch.ones(64 << 20, dtype=torch.uint8), "doomed")
        t0 = time.monotonic()
        with pytest.raises(PeerFailedError) as info:
            h.wait(timeout=60)
        assert time.monotonic() - t0 < 20  # a dead peer is noticed at once, not at the timeout
        msg = str(info.value)
        assert "'doomed'" in msg and "chunks sent" in msg and "not sent" in msg
        done = info.value.outgoing[0]
        assert done["name"] == "doomed" and 6 <= done["chunks_done"] < done["chunks_total"] == 256
        assert h.state == "failed" and ch.failed
        with pytest.raises(PeerFailedError):
            ch.send_activation(torch.ones(1))
    finally:
        if proc.poll() is None:
            proc.kill()
        ch.close(timeout=5)


def test_silent_peer_times_out_naming_what_was_received(tmp_path):
    store = make_store(0)
    proc, _ = _spawn(tmp_path, "source", store.port,
                     {"timeout": 30, "bytes": 16 << 20, "chunk": 64 << 10})
    ch = connect(0, store=store, timeout_s=1.5)
    try:
        deadline = time.monotonic() + 60
        while not any(p["chunks_done"] >= 3 for p in ch.rx_progress()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.005)
        proc.send_signal(signal.SIGSTOP)  # alive but silent: only the timeout can tell
        t0 = time.monotonic()
        with pytest.raises(PeerFailedError) as info:
            ch.recv_bulk("payload", timeout=30)
        assert time.monotonic() - t0 < 10
        msg = str(info.value)
        assert "incoming bulk 'payload'" in msg and "chunks received" in msg and "missing" in msg
        got = info.value.incoming[0]
        assert 3 <= got["chunks_done"] < got["chunks_total"] == 256
    finally:
        proc.kill()
        proc.wait()
        ch.close(timeout=5)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="ranks 0 and 1"):
        make_store(2)
    with pytest.raises(ValueError, match="port"):
        make_store(1)
    with pytest.raises(ValueError, match="nccl"):
        connect(0, backend="nccl", device="cpu")
    with pytest.raises(ValueError, match="gloo"):
        connect(0, backend="gloo", device="meta")
    assert issubclass(PeerFailedError, TransferError)
