"""A member abandoning its group beside a live peer (a regroup, a partial join): a peer's span running on
it ends before its peers' KV regions go, and a span arriving after is refused (the peer then finds its
peer lost and abandons too) instead of writing into freed KV. Found by the regroup test in real engines
(a segfault in vLLM's CPU ``reshape_and_cache``); here against a stand-in worker."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from vllm_kunserve.integration.vllm import pipeline as P

pytestmark = pytest.mark.unit


class Residency:
    """The worker's layer residency: ``leave`` records what it found when it freed the regions."""

    def __init__(self, member_views):
        self.kv, self.dropped, self.calls = [], [4, 5, 6, 7], []
        self.views = member_views

    def leave(self, blocks, exchange, images=None):
        self.calls.append({"t": time.perf_counter(), "compute_held": P.COMPUTE.locked(),
                           "views": dict(self.views())})
        exchange()
        self.dropped = []
        return blocks


@pytest.fixture
def member():
    holder = {}
    res = Residency(lambda: holder["m"].views)
    runner = SimpleNamespace(_kunserve_memory=res, _kunserve_kv_view=None,
                             model=SimpleNamespace(model=SimpleNamespace(layers=[])))
    worker = SimpleNamespace(model_runner=runner, vllm_config=SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={})))
    m = holder["m"] = P.GroupMember(worker)
    m.name, m.views = "e1", {("e0", "layers.4.attn"): torch.zeros(1)}
    yield m, res
    m.server.close()


def test_an_abandon_waits_for_a_running_span_then_refuses_later_ones(member):
    m, res = member
    ended = {}

    def span_running():   # a live peer's span holds the compute lock while it runs here
        with P.COMPUTE:
            started.set()
            time.sleep(0.2)
            ended["t"] = time.perf_counter()
    started = threading.Event()
    t = threading.Thread(target=span_running)
    t.start()
    started.wait(5)
    out = m.leave({"kv_blocks": 88, "held": [], "abandon": True})
    t.join()
    (call,) = res.calls
    assert call["t"] >= ended["t"] and call["compute_held"] and call["views"] == {}
    assert out["mapped_blocks"] == 88 and out["restore"]["source"] == "host"
    assert not P.COMPUTE.locked()
    # a span arriving after the abandon is refused, and leaves the lock free
    with pytest.raises(P.GroupError, match="not in a group"):
        m._run_span({"origin": "e0", "lo": 4, "hi": 8, "attn": None, "slots": None},
                    {"positions": torch.zeros(1), "hidden": torch.zeros(1, 4)})
    assert not P.COMPUTE.locked()
