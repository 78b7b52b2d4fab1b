"""Where ``kunserve serve``'s CPU per relayed token goes, before and after a change (issue 37).

``kunserve serve --engine-url`` fronts two stand-in engines that stream chunks serialized by vLLM's
own response models (``CompletionStreamResponse.model_dump_json(exclude_unset=True)``, with the
token ids the front end asks for), one token to every running stream per step, as a batch engine
does; closed-loop clients keep ``--levels`` streams busy. The stand-ins compute nothing, so what is
measured is the front end alone: its CPU time per relayed token (psutil, its whole process tree),
and, with ``--profile``, where that time goes (py-spy's samples of the front end, each counted
under the innermost frame of a known part: the relay's parse and rewrite, aiohttp's reading of the
engine's stream, uvicorn's writing to the client, the dispatch and bookkeeping, the event loop).

Each ``--ref`` (a git commit; ``HEAD`` and the working tree are ``.``) is run from its own worktree
(``PYTHONPATH``), levels and refs interleaved in an order shuffled per repetition. The step times
(``--step-ms``) default to what two tiny-model engines delivered in ``router_side_by_side.md``
(about 3.1k tokens/s at 32 streams, 5.8k at 128).

    python -m benchmarks.relay_cpu [--refs 9d66cf0,.] [--levels 32,128] [--reps 3] [--seconds 15]
        [--profile] [--out docs/benchmarks/relay_cpu.json] [--render-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from vllm_kunserve.bench.compare import cpu_times
from vllm_kunserve.bench.router_fleet import wait_healthy
from vllm_kunserve.cluster.fleet.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]   # this checkout
DOCS = ROOT / "docs" / "benchmarks"


# ----------------------------------------------------------------------------------- the stand-in engine
def engine_main(port: int, step_ms: float) -> None:
    """A server answering like a vLLM engine with ``return_token_ids``: every ``step_ms`` one token to
    each running stream, chunks serialized by vLLM's own models. Also /health, /v1/models, /metrics."""
    from aiohttp import web
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

    running: dict[int, asyncio.Queue] = {}
    counter = iter(range(1 << 62))

    async def stepper():
        while True:
            await asyncio.sleep(step_ms / 1e3)
            for q in list(running.values()):
                q.put_nowait(1)

    async def generate(request):
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        prompt_ids = list(range(3, 3 + max(1, len(str(body.get("prompt", ""))) // 4)))
        k = next(counter)
        rid, created = f"cmpl-{k}", int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        q: asyncio.Queue = asyncio.Queue()
        running[k] = q
        try:
            for i in range(n):
                await q.get()
                t = 100 + (k * 7 + i) % 800
                ch = CompletionResponseStreamChoice(index=0, text=f" w{t}", logprobs=None,
                                                    finish_reason="length" if i == n - 1 else None, stop_reason=None,
                                                    prompt_token_ids=prompt_ids if i == 0 else None, token_ids=[t])
                ev = CompletionStreamResponse(id=rid, object="text_completion", created=created, model="m",
                                              choices=[ch])   # every field set, as vLLM's serving sets them
                await resp.write(b"data: " + ev.model_dump_json(exclude_unset=True).encode() + b"\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}
                ev = CompletionStreamResponse(id=rid, object="text_completion", created=created, model="m", choices=[],
                                              usage=usage)
                await resp.write(b"data: " + ev.model_dump_json(exclude_unset=True, exclude_none=True).encode()
                                 + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        finally:
            running.pop(k, None)
        return resp

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]})

    async def metrics(request):
        return web.Response(text=f'vllm:num_requests_running{{model_name="m"}} {len(running)}.0\n'
                                 'vllm:cache_config_info{block_size="16",num_gpu_blocks="100000"} 1.0\n')

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", generate)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", lambda r: web.Response(status=200))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await stepper()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------- the client
async def closed_loop(url: str, streams: int, seconds: float, max_tokens: int) -> dict:
    """``streams`` closed-loop streams for ``seconds`` (after one untimed request each): tokens (data
    events) received, and the gaps between a stream's consecutive events."""
    import aiohttp

    tokens, gaps, stop = [0], [], [False]

    async def one(s, count: bool):
        body = {"model": "m", "prompt": "the cache holds blocks and " * 4, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}   # as vllm bench serve asks
        last = None
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for data in r.content.iter_any():
                now = time.perf_counter()
                n = data.count(b'"text"')   # a token's chunk (the usage chunk has none)
                if count and n:
                    tokens[0] += n
                    if last is not None:
                        gaps.append(now - last)
                    gaps.extend([0.0] * (n - 1))
                    last = now

    async def stream(s):
        await one(s, False)
        await started.wait()
        while not stop[0]:
            await one(s, True)

    started = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        tasks = [asyncio.ensure_future(stream(s)) for _ in range(streams)]
        await asyncio.sleep(0.5)
        started.set()
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        n0, span = tokens[0], time.perf_counter() - t0
        stop[0] = True
        await asyncio.gather(*tasks)
    return {"tokens": n0, "span_s": span, "gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else None}


# ------------------------------------------------------------------------------------------- the profile
PARTS = [   # (part, a substring of a frame "function (file:line)"), innermost known frame wins
    ("relay: parse and rewrite", "frontend/relay.py"), ("relay: parse and rewrite", "frontend/validate.py"),
    ("front end: dispatch, bookkeeping", "frontend/app.py"), ("front end: dispatch, bookkeeping", "cluster/"),
    ("aiohttp: engine stream in", "aiohttp/"), ("uvicorn: client stream out", "uvicorn/"),
    ("uvicorn: client stream out", "httptools"), ("event loop", "asyncio/"), ("event loop", "uvloop"),
]


#: innermost frames left out. py-spy's idle detection does not work here (threads blocked in a wait
#: are sampled as running), so waits are named; and uvloop's own work (epoll, socket reads and
#: writes in C) shows under ``Runner.run``, where its idle time shows too: the shares are of the
#: Python frames only, and the CPU per token (psutil) is the measure of the whole
IDLE_LEAVES = ("Condition.wait ", "Event.wait ", "wait (threading.py", "SocketIO.readinto ", "_wait_for_tstate_lock ",
               "select ", "sleep ", "Runner.run (asyncio/runners.py", "run_forever ")


def attribute(raw: str) -> dict[str, float]:
    """Shares of py-spy's collapsed stacks (``frame;frame;... count``) by part, idle samples left out."""
    return _shares(raw)[0]


def top_frames(raw: str, n: int = 12) -> list[list]:
    """The ``n`` innermost frames holding the most samples (self time), with their shares."""
    return _shares(raw)[1][:n]


def _shares(raw: str) -> tuple[dict[str, float], list[list]]:
    parts: Counter = Counter()
    leaves: Counter = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or int(n) == 0:
            continue
        frames = stack.split(";")
        if frames[-1].startswith(IDLE_LEAVES):
            continue   # a thread waiting, or the event loop's own C code (see IDLE_LEAVES)
        part = "other"
        for f in reversed(frames):
            hit = next((p for p, key in PARTS if key in f), None)
            if hit:
                part = hit
                break
        parts[part] += int(n)
        leaves[frames[-1]] += int(n)
    total = sum(parts.values()) or 1
    return ({p: round(c / total, 4) for p, c in parts.most_common()},
            [[f, round(c / total, 4)] for f, c in leaves.most_common()])


# ------------------------------------------------------------------------------------------------- a run
def worktree(ref: str, tmp: Path) -> Path:
    if ref == ".":
        return ROOT
    path = tmp / ref.replace("/", "_")
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def one_run(tree: Path, engines: list[str], model: Path, streams: int, a, profile_to: Path | None) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_HOST_IP": "127.0.0.1"}
    argv = [sys.executable, "-c", "from vllm_kunserve.cli.main import main; main()", "serve", str(model),
            "--port", str(port), "--dispatch", "round-robin", *[x for u in engines for x in ("--engine-url", u)]]
    log = open(tempfile.mktemp(prefix="relay_cpu_fe_", suffix=".log"), "w")
    fe = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tree)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", fe, 120)

        def cpu() -> float:   # the front end's process tree
            return sum(cpu_times(fe.pid).values())

        spy = None
        if profile_to is not None:
            spy = subprocess.Popen([shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record",
                                    "--pid", str(fe.pid), "--rate", "250", "--format", "raw",
                                    "--output", str(profile_to), "--duration", str(int(a.seconds) + 1),
                                    *(["--native"] if a.native else [])],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c0 = cpu()
        res = asyncio.run(closed_loop(f"http://127.0.0.1:{port}", streams, a.seconds, a.max_tokens))
        used = cpu() - c0   # includes the untimed first requests and the last ones' ends: a small excess
        if spy is not None:
            spy.wait(timeout=60)
        return {**res, "cpu_s": used, "cpu_us_per_token": 1e6 * used / max(1, res["tokens"]),
                "tokens_per_s": res["tokens"] / res["span_s"]}
    finally:
        fe.send_signal(signal.SIGINT)
        try:
            fe.wait(20)
        except subprocess.TimeoutExpired:
            fe.kill()
        log.close()


def main() -> int:
    if sys.argv[1:2] == ["--engine"]:
        engine_main(int(sys.argv[2]), float(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refs", default="HEAD,.", help="git refs to compare ('.': this working tree)")
    ap.add_argument("--levels", default="32,128")
    ap.add_argument("--step-ms", default="32:10,128:22", help="per level: the stand-in engines' step time")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="py-spy the front end in the last repetition")
    ap.add_argument("--native", action="store_true", help="--profile: with C frames (py-spy --native)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DOCS / "relay_cpu.json"))
    ap.add_argument("--render-only", action="store_true", help="re-write the page from --out's JSON")
    a = ap.parse_args()
    if a.render_only:
        write_doc(Path(a.out))
        return 0
    if a.reps < 1 or a.seconds <= 0:
        ap.error("--reps must be >= 1 and --seconds > 0")
    if a.profile and not (shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists()):
        ap.error("--profile needs py-spy (pip install py-spy)")
    refs = [r.strip() for r in a.refs.split(",") if r.strip()]
    levels = [int(x) for x in a.levels.split(",")]
    steps = {int(k): float(v) for k, v in (x.split(":") for x in a.step_ms.split(","))}
    if set(levels) - set(steps):
        ap.error(f"--step-ms has no step for level(s) {sorted(set(levels) - set(steps))}")
    model = ROOT / "models" / "tiny"
    if not (model / "config.json").exists():
        from vllm_kunserve.tools.make_model import PRESETS, build_model

        build_model(model, PRESETS["tiny"])
    commits = {r: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD" if r == "." else r],
                                 capture_output=True, text=True, check=True).stdout.strip() + ("+tree" if r == "." else "")
               for r in refs}
    rng = random.Random(a.seed)
    runs: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="relay_cpu_"))
    trees: dict[str, Path] = {}
    try:
        for r in refs:
            trees[r] = worktree(r, tmp)
        for level in levels:
            ports = [free_port(), free_port()]
            engines = [subprocess.Popen([sys.executable, __file__, "--engine", str(p), str(steps[level])],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
            try:
                for p, e in zip(ports, engines):
                    wait_healthy(f"http://127.0.0.1:{p}", e, 120)
                for rep in range(a.reps):
                    order = refs[:]
                    rng.shuffle(order)
                    for r in order:
                        prof = (Path(a.out).parent / f"{Path(a.out).stem}_{commits[r]}_{level}.pyspy.txt"
                                if a.profile and rep == a.reps - 1 else None)   # kept beside the JSON
                        res = one_run(trees[r], [f"http://127.0.0.1:{p}" for p in ports], model, level, a, prof)
                        if prof is not None and prof.exists():
                            res["profile"] = attribute(prof.read_text())
                            res["profile_top"] = top_frames(prof.read_text())
                        runs.append({"ref": r, "commit": commits[r], "level": level, "rep": rep, **res})
                        print(f"{commits[r]:>14} {level:>4} streams rep {rep}: {res['cpu_us_per_token']:.1f} us/token, "
                              f"{res['tokens_per_s']:.0f} tok/s, gap p50 {res['gap_p50_ms']:.2f} ms", flush=True)
            finally:
                for e in engines:
                    e.terminate()
                    e.wait(10)
    finally:
        for t in trees.values():
            if t != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(t)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    from vllm_kunserve.bench.report import command, cpu_model, write_json

    write_json(a.out, {"command": command("relay_cpu.py"), "cpu": cpu_model(), "cores": os.cpu_count(),
                       "load_1min": os.getloadavg()[0], "refs": commits, "steps_ms": steps, "runs": runs})
    write_doc(Path(a.out))
    return 0


def write_doc(path: Path) -> None:
    """The markdown page beside the JSON: per ref and level, CPU per token (median and range over the
    repetitions), the relayed token rate, the client's median gap, and the profile's shares."""
    from vllm_kunserve.bench.report import md_row, md_table

    d = json.loads(path.read_text())
    runs, refs = d["runs"], list(d["refs"].values())
    L = ["# Where the front end's CPU per relayed token goes (written by benchmarks/relay_cpu.py)", "",
         f"Command: `{d['command']}`. {d['cpu']}, {d['cores']} cores shared by the stand-in engines, the front end "
         f"and the client (1-min load average at the end: {d['load_1min']:.1f}). Two stand-in engines (vLLM's own "
         f"response models serialize every chunk; no model runs) give one token to each of their streams every "
         + ", ".join(f"{v:g} ms at {k} streams" for k, v in d["steps_ms"].items()) + "; "
         "`kunserve serve --engine-url` over them; closed-loop streams. CPU: the front end's process tree "
         "(psutil) over the measured seconds, per token the client received; the repetition py-spy sampled is "
         "left out of it (py-spy pauses the process for each sample).", ""]
    rows = []
    for level in sorted({r["level"] for r in runs}):
        for c in refs:
            # a profiled run is left out: py-spy pauses the process for every sample, which costs CPU
            xs = [r for r in runs if r["level"] == level and r["commit"] == c and not r.get("profile")] or \
                [r for r in runs if r["level"] == level and r["commit"] == c]
            if not xs:
                continue
            us = sorted(r["cpu_us_per_token"] for r in xs)
            rows.append([level, c, f"{statistics.median(us):.1f} ({us[0]:.1f}..{us[-1]:.1f})",
                         f"{statistics.median(r['tokens_per_s'] for r in xs):.0f}",
                         f"{statistics.median(r['gap_p50_ms'] for r in xs if r['gap_p50_ms'] is not None):.2f}",
                         len(xs)])
    L += md_table(["streams", "front end at", "CPU us per token (median, range)", "tokens/s", "client's median gap (ms)",
                   "reps"], "rlllrr", rows)
    prof = [r for r in runs if r.get("profile")]
    if prof:
        parts = sorted({p for r in prof for p in r["profile"]})
        L += ["", "Where its Python code's time goes (py-spy, 250 Hz, the last repetition; each sample counted under the "
                  "innermost frame of a known part). Left out: samples in a wait, and the event loop's own C code "
                  "(uvloop's epoll and socket I/O show under `Runner.run` together with its idle time, and py-spy's "
                  "idle detection does not work on this machine), so these are shares of the Python frames' samples; "
                  "the CPU per token above is the measure of the whole:", ""]
        L += md_table(["streams", "front end at", *parts], "rl" + "r" * len(parts),
                      ([r["level"], r["commit"], *[f"{100 * r['profile'].get(p, 0):.0f}%" for p in parts]]
                       for r in prof))
        for r in prof:
            if r.get("profile_top"):
                L += ["", f"{r['level']} streams, {r['commit']}: the innermost frames holding the most samples "
                          "(self time; a C function's time shows under the Python frame that called it):", ""]
                L += md_table(["frame", "share"], "lr", ([f"`{f}`", f"{100 * x:.1f}%"] for f, x in r["profile_top"][:8]))
    L += ["", f"Raw data: `{path.name}`."]
    path.with_suffix(".md").write_text("\n".join(L) + "\n")
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    sys.exit(main())
