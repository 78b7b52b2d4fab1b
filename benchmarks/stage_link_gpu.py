"""The stage link on a GPU: hop round trip, KV exchange and a two-stage 7B-sized pipeline, two
processes sharing one device (issue 38).

What a pipeline group of CUDA engines moves through ``vllm_kunserve.transfer.stage``:
- **hop**: a step's hidden states to the member holding the next layers and back. The server echoes
  its input, so a round trip is three device copies of the payload (into the link's device buffer,
  the server's reply into it, the caller's copy out) plus two headers over a Unix socket and two
  interprocess events. Sizes: decode (batch 1-256 x hidden 4096 / 8192, bf16) and prefill chunks (up
  to 8k tokens). Paths: ``ipc`` (CUDA IPC device buffer, the default) and ``host`` (pinned host
  staging, the fallback). The floor is three copies at the device's measured copy rate.
- **kv**: KV pages gathered into chunks, sent on a bulk connection and scattered into the peer's
  region, for chunk sizes 1-128 MiB (GB/s against the device's copy peak); and a decode-sized hop's
  latency while the exchange runs on the same link (activations first).
- **pipeline**: a 7B-sized decoder (32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 11008, bf16;
  5.8 G parameters with the LM head) run in one process, and split in two (layers 16-31 in the
  peer, called once per step with the hidden states and the residual), at the same batch and
  context, eager and with CUDA graphs (each process's part of the step captured). Every step ends
  with the sampled tokens on the host, as an engine's step does. Overhead per token = (grouped -
  single) / batch.

Two processes on one GPU time-slice the device, which a real group (one GPU per member) does not:
the overhead measured here includes those context switches, so it bounds a group's from above.

    python -m benchmarks.stage_link_gpu [--parts hop,kv,pipeline] [--quick]

Writes docs/benchmarks/stage_link_gpu.{json,md} (and a copy into $OUT when set).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
MiB = 1 << 20
DECODE_BATCH = (1, 16, 64, 256)
PREFILL_TOKENS = (512, 2048, 8192)
HIDDEN = (4096, 8192)
CHUNKS_MIB = (1, 4, 16, 64, 128, 256, 512)
PAGE_BYTES = 128 << 10  # one KV block of a 7B MHA model: 16 tokens x 32 heads x 128 x bf16 (K or V)
KV_TOTAL = 2 << 30
CTX = 512


# -- the 7B-sized decoder (plain torch) ---------------------------------------------------------------
class Dims:
    layers, hidden, heads, kv_heads, head_dim, inter, vocab = 32, 4096, 32, 8, 128, 11008, 32000


def _layer(torch, dev, gen):
    d, h = Dims, Dims.hidden
    qkv = (d.heads + 2 * d.kv_heads) * d.head_dim

    def w(*shape):
        return torch.empty(*shape, device=dev, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)

    return {"norm1": torch.ones(h, device=dev, dtype=torch.bfloat16), "qkv": w(h, qkv), "o": w(h, h),
            "norm2": torch.ones(h, device=dev, dtype=torch.bfloat16), "gate_up": w(h, 2 * d.inter),
            "down": w(d.inter, h)}


def _rms(torch, x, w):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w


def _run_layers(torch, F, layers, kv, hidden, residual):
    """Decode one token for every sequence through ``layers`` (KV cache of CTX tokens each)."""
    d = Dims
    b = hidden.shape[0]
    for lw, (k, v) in zip(layers, kv):
        residual = hidden + residual
        x = _rms(torch, residual, lw["norm1"])
        q = (x @ lw["qkv"])[:, : d.heads * d.head_dim].view(b, d.heads, 1, d.head_dim)
        a = F.scaled_dot_product_attention(q, k[:b], v[:b], enable_gqa=True)
        residual = a.reshape(b, -1) @ lw["o"] + residual
        x = _rms(torch, residual, lw["norm2"])
        g, u = (x @ lw["gate_up"]).chunk(2, dim=-1)
        hidden = (F.silu(g) * u) @ lw["down"]
    return hidden, residual


class Stage:
    """A span of the decoder on one process: layers [lo, hi), their KV, optional embedding / head."""

    def __init__(self, torch, lo, hi, max_batch, first, last, seed=0):
        import torch.nn.functional as F

        self.torch, self.F, self.dev = torch, F, torch.device("cuda")
        gen = torch.Generator(device=self.dev).manual_seed(seed + lo)
        self.layers = [_layer(torch, self.dev, gen) for _ in range(lo, hi)]
        shape = (max_batch, Dims.kv_heads, CTX, Dims.head_dim)
        self.kv = [(torch.empty(shape, device=self.dev, dtype=torch.bfloat16).normal_(generator=gen),
                    torch.empty(shape, device=self.dev, dtype=torch.bfloat16).normal_(generator=gen))
                   for _ in range(lo, hi)]
        self.embed = (torch.empty(Dims.vocab, Dims.hidden, device=self.dev, dtype=torch.bfloat16)
                      .normal_(0, 0.02, generator=gen) if first else None)
        self.head = (torch.empty(Dims.hidden, Dims.vocab, device=self.dev, dtype=torch.bfloat16)
                     .normal_(0, 0.02, generator=gen) if last else None)
        self.graphs: dict = {}

    def params(self) -> int:
        n = sum(t.numel() for lw in self.layers for t in lw.values())
        return n + sum(t.numel() for t in (self.embed, self.head) if t is not None)

    def start(self, ids):
        h = self.embed[ids]
        return h, self.torch.zeros_like(h)

    def mid(self, hidden, residual):
        return _run_layers(self.torch, self.F, self.layers, self.kv, hidden, residual)

    def end(self, hidden, residual):
        return (_rms(self.torch, hidden + residual, 1.0) @ self.head).argmax(-1)

    def graphed(self, key, fn, *inputs):
        """``fn(*inputs)`` through a CUDA graph captured for these input shapes (static buffers)."""
        torch = self.torch
        g = self.graphs.get(key)
        if g is None:
            static_in = [x.clone() for x in inputs]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn(*static_in)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = fn(*static_in)
            g = self.graphs[key] = (graph, static_in, static_out)
        graph, static_in, static_out = g
        for dst, src in zip(static_in, inputs):
            dst.copy_(src)
        graph.replay()
        return static_out


# -- the peer process ---------------------------------------------------------------------------------
def _serve(q, max_batch: int, pipeline: bool) -> None:
    import torch

    from vllm_kunserve.transfer.stage import StageServer

    torch.cuda.init()
    region = torch.empty(KV_TOTAL, dtype=torch.uint8, device="cuda")
    pages = region.view(-1, PAGE_BYTES)
    stage = Stage(torch, Dims.layers // 2, Dims.layers, max_batch, first=False, last=False) if pipeline else None

    def handler(kind, meta, t):
        if kind == "echo":
            return None, t
        if kind == "kv_put":
            pages.index_copy_(0, t["ids"], t["data"])
            return None, {}
        if kind == "span":
            with torch.inference_mode():
                if meta["graph"]:
                    h, r = stage.graphed(("mid", t["h"].shape[0]), stage.mid, t["h"], t["r"])
                else:
                    h, r = stage.mid(t["h"], t["r"])
            return None, {"h": h, "r": r}
        raise ValueError(kind)

    srv = StageServer(handler)
    q.put((srv.address, stage.params() if stage else 0))
    time.sleep(3600)


def _peer(ctx, max_batch=0, pipeline=False):
    q = ctx.Queue()
    p = ctx.Process(target=_serve, args=(q, max_batch, pipeline), daemon=True)
    p.start()
    addr, params = q.get(timeout=600)
    return p, addr, params


# -- measurements -------------------------------------------------------------------------------------
def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def copy_peak(torch, nbytes: int, reps: int = 20) -> float:
    """Seconds for one device-to-device copy of ``nbytes`` (median of ``reps``, CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _hop_times(torch, c, x, reps, warm=5):
    for _ in range(warm):
        c.call("echo", None, {"x": x})
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _, out = c.call("echo", None, {"x": x})
        out["x"].sum()  # a kernel on the reply: it is usable on the device
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def part_hop(torch, ctx, quick: bool) -> dict:
    from vllm_kunserve.transfer.stage import StageClient

    p, addr, _ = _peer(ctx)
    rows = []
    try:
        clients = {"ipc": StageClient(addr, nbytes=1 << 20, device_link="auto"),
                   "host": StageClient(addr, nbytes=1 << 20, device_link="host")}
        cases = [("decode", b, h) for h in HIDDEN for b in DECODE_BATCH] + \
                [("prefill", n, h) for h in HIDDEN for n in PREFILL_TOKENS]
        if quick:
            cases = cases[:3] + cases[-1:]
        for kind, rows_n, hidden in cases:
            x = torch.randn(rows_n, hidden, device="cuda", dtype=torch.bfloat16)
            nbytes = x.numel() * 2
            floor = 3 * copy_peak(torch, nbytes) * 1e3
            for path, c in clients.items():
                reps = 200 if nbytes <= 4 * MiB else 30
                t = _hop_times(torch, c, x, reps if not quick else 20)
                rows.append({"kind": kind, "rows": rows_n, "hidden": hidden, "bytes": nbytes, "path": c.device_link,
                             "asked": path, "reps": len(t), "p50_ms": round(_pct(t, 50), 4),
                             "p90_ms": round(_pct(t, 90), 4), "p99_ms": round(_pct(t, 99), 4),
                             "floor_ms": round(floor, 4), "overhead_ms": round(_pct(t, 50) - floor, 4)})
                print("hop", rows[-1], flush=True)
        for nbytes in (16 << 10, 2 * MiB):  # the same machine's host-only link (CPU tensors, shared memory)
            xc = torch.zeros(nbytes // 4)
            t = _hop_times(torch, clients["ipc"], xc, 200)
            rows.append({"kind": "cpu tensors", "rows": 1, "hidden": nbytes // 4, "bytes": nbytes, "path": "shm",
                         "asked": "cpu", "reps": len(t), "p50_ms": round(_pct(t, 50), 4),
                         "p90_ms": round(_pct(t, 90), 4), "p99_ms": round(_pct(t, 99), 4),
                         "floor_ms": None, "overhead_ms": None})
            print("hop", rows[-1], flush=True)
        errors = {k: c.device_link_error for k, c in clients.items()}
        for c in clients.values():
            c.close()
    finally:
        p.terminate()
    return {"rows": rows, "errors": errors}


def part_kv(torch, ctx, quick: bool) -> dict:
    from vllm_kunserve.transfer.stage import StageClient

    p, addr, _ = _peer(ctx)
    rows = []
    try:
        src = torch.randint(0, 255, (KV_TOTAL // 4,), dtype=torch.uint8, device="cuda")
        pages = src.view(-1, PAGE_BYTES)
        n_pages = pages.shape[0]
        peak_s = copy_peak(torch, 64 * MiB)
        peak = 64 * MiB / peak_s
        bulk = StageClient(addr, nbytes=1 << 20, bulk=True)
        act = StageClient(addr, nbytes=1 << 20)
        x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
        idle = _hop_times(torch, act, x, 50)
        for chunk_mib in (CHUNKS_MIB if not quick else (4, 32)):
            per = max(1, chunk_mib * MiB // PAGE_BYTES)
            order = torch.randperm(n_pages, device="cuda")  # pages scattered, as a KV pool's are

            def exchange():
                for s in range(0, n_pages, per):
                    ids = order[s:s + per]
                    bulk.call("kv_put", None, {"ids": ids, "data": pages.index_select(0, ids)})
                torch.cuda.synchronize()

            exchange()  # warm (buffer sizes)
            t0 = time.perf_counter()
            exchange()
            dt = time.perf_counter() - t0
            moved = n_pages * PAGE_BYTES
            # the same exchange with a decode hop every few ms on the activation connection
            lat: list[float] = []
            th = threading.Thread(target=exchange)
            th.start()
            while th.is_alive():
                lat += _hop_times(torch, act, x, 1, warm=0)
            th.join()
            rows.append({"chunk_mib": chunk_mib, "bytes": moved, "s": round(dt, 4),
                         "gb_per_s": round(moved / dt / 1e9, 2), "peak_copy_gb_per_s": round(peak / 1e9, 1),
                         "share_of_peak": round(moved / dt / peak, 3), "hop_during_n": len(lat),
                         "hop_during_p50_ms": round(_pct(lat, 50), 4) if lat else None,
                         "hop_during_p99_ms": round(_pct(lat, 99), 4) if lat else None,
                         "hop_idle_p50_ms": round(_pct(idle, 50), 4)})
            print("kv", rows[-1], flush=True)
        bulk.close()
        act.close()
    finally:
        p.terminate()
    return {"rows": rows, "page_bytes": PAGE_BYTES, "total_bytes": n_pages * PAGE_BYTES}


def part_pipeline(torch, ctx, quick: bool, steps: int) -> dict:
    from vllm_kunserve.transfer.stage import StageClient

    batches = DECODE_BATCH if not quick else (1, 64)
    max_b = max(batches)
    p, addr, peer_params = _peer(ctx, max_b, pipeline=True)
    rows = []
    try:
        half = Dims.layers // 2
        front = Stage(torch, 0, half, max_b, first=True, last=True)
        back = Stage(torch, half, Dims.layers, max_b, first=False, last=False)  # the single process's own copy
        c = StageClient(addr, nbytes=1 << 20)
        params = front.params() + back.params()

        def single(ids, graph):
            if graph:
                return front.graphed(("all", ids.shape[0]), lambda i: front.end(*back.mid(*front.mid(*front.start(i)))),
                                     ids)
            return front.end(*back.mid(*front.mid(*front.start(ids))))

        def grouped(ids, graph):
            if graph:
                h, r = front.graphed(("front", ids.shape[0]), lambda i: front.mid(*front.start(i)), ids)
            else:
                h, r = front.mid(*front.start(ids))
            _, out = c.call("span", {"graph": graph}, {"h": h, "r": r}, copy=False)
            if graph:
                return front.graphed(("end", ids.shape[0]), front.end, out["h"], out["r"])
            return front.end(out["h"], out["r"])

        modes = {"single": single, "grouped": grouped}
        with torch.inference_mode():
            for b in batches:
                ids = torch.randint(0, Dims.vocab, (b,), device="cuda")
                for graph in (False, True):
                    res, tokens = {}, {}
                    for name in (["single", "grouped"] if b % 2 else ["grouped", "single"]):
                        fn = modes[name]
                        for _ in range(3):
                            tokens[name] = fn(ids, graph).cpu()
                        times = []
                        for _ in range(steps):
                            t0 = time.perf_counter()
                            fn(ids, graph).cpu()  # the sampled tokens reach the host every step
                            times.append((time.perf_counter() - t0) * 1e3)
                        res[name] = times
                    s, g = statistics.median(res["single"]), statistics.median(res["grouped"])
                    # where tokens differ: is it the link (bits) or the arithmetic (another process's kernels)?
                    h, r = front.mid(*front.start(ids))
                    hs, rs = back.mid(h, r)
                    hs2, _ = back.mid(h, r)
                    _, out = c.call("span", {"graph": False}, {"h": h, "r": r})
                    diag = {"span_bits_equal": bool(torch.equal(hs, out["h"])),
                            "span_repeat_equal": bool(torch.equal(hs, hs2)),
                            "span_max_abs_diff": float((hs.float() - out["h"].float()).abs().max()),
                            "span_nonfinite": int((~torch.isfinite(hs)).sum()),
                            "single_repeat_tokens_equal": bool(torch.equal(single(ids, graph).cpu(),
                                                                           single(ids, graph).cpu()))}
                    rows.append({"batch": b, "graphs": graph, "steps": steps,
                                 # the peer's layers are the single process's (same seed): same tokens
                                 "tokens_equal": bool(torch.equal(tokens["single"], tokens["grouped"])),
                                 "single_ms": round(s, 3), "grouped_ms": round(g, 3),
                                 "single_p90_ms": round(_pct(res["single"], 90), 3),
                                 "grouped_p90_ms": round(_pct(res["grouped"], 90), 3),
                                 "overhead_ms_per_step": round(g - s, 3),
                                 "overhead_us_per_token": round((g - s) / b * 1e3, 2),
                                 "overhead_share": round((g - s) / s, 4), **diag})
                    print("pipeline", rows[-1], flush=True)
        c.close()
    finally:
        p.terminate()
    return {"rows": rows, "params": params, "peer_params": peer_params, "context": CTX,
            "dims": {k: getattr(Dims, k) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                                   "vocab")}}


def derive(res: dict) -> dict:
    """What the rest of the project takes from a run: the CUDA bulk chunk (the smallest measured chunk
    within 3/4 of the best measured KV-exchange throughput; ``transfer.stage.BULK_CHUNK_BYTES``) and the
    simulator's link (``sim.hardware.LINKS["stage-h100"]``): bandwidth = the device's copy rate / 3 (a
    payload is copied three times), latency = what a hop adds to a CUDA-graphed step (median over
    batches of the grouped - single step time, per hop, at least 0)."""
    out = {}
    kv = (res.get("kv") or {}).get("rows") or []
    if kv:
        best = max(r["gb_per_s"] for r in kv)
        out["chosen_chunk_mib"] = min(r["chunk_mib"] for r in kv if r["gb_per_s"] >= 0.75 * best)
    rows = [r for r in (res.get("pipeline") or {}).get("rows", []) if r["graphs"]]
    if kv and rows:
        per_hop = statistics.median(max(0.0, r["overhead_ms_per_step"]) / 2 for r in rows)
        out["link_fit"] = {"bandwidth_bytes_per_s": round(kv[0]["peak_copy_gb_per_s"] * 1e9 / 3, -6),
                           "latency_s": round(per_hop / 1e3, 7)}
    hop = [r for r in (res.get("hop") or {}).get("rows", []) if r["path"] == "ipc"]
    if hop:
        out["hop_round_trip_p50_ms"] = statistics.median(r["p50_ms"] for r in hop)
    return out


def _dash(v):
    return "-" if v is None else v


# -- the doc ------------------------------------------------------------------------------------------
def render(res: dict) -> list[str]:
    from vllm_kunserve.bench.report import md_table

    out = ["# Stage link on a GPU: hop, KV exchange, two-stage pipeline (written by benchmarks/stage_link_gpu.py)",
           "",
           f"Command: `{res['command']}`, on {res['device']} (torch {res['torch']}, CUDA {res['cuda']}, "
           f"driver {res.get('driver', '?')}); {res['date']}. Raw data: `stage_link_gpu.json`.",
           "",
           "Client and server are two processes sharing the one GPU (no vLLM: the lent machine has none). "
           "Two processes on one GPU time-slice it, which a group of one GPU per member does not: these "
           "figures bound a group's link cost from above. Vs. the CPU engines' link: "
           "[stage_link.md](stage_link.md).", ""]
    hop = res.get("hop")
    if hop:
        out += ["## Hop round trip", "",
                "The server echoes the payload; each round trip is timed on the host until a kernel on the "
                "reply has finished. Floor = three device-to-device copies of the payload at the rate "
                "measured in the same process (the copies a round trip makes); overhead = p50 - floor. "
                "`ipc`: CUDA IPC device buffer with interprocess events (the default); `host`: the fallback, "
                "staged through the pinned shared-memory buffer.", ""]
        out += md_table(["payload", "shape (rows x hidden)", "size", "path", "p50 ms", "p90 ms", "p99 ms", "floor ms",
                         "overhead ms", "reps"], "llrlrrrrrr",
                        [[r["kind"], f"{r['rows']} x {r['hidden']}", f"{r['bytes'] / MiB:.3g} MiB", r["path"],
                          r["p50_ms"], r["p90_ms"], r["p99_ms"], _dash(r["floor_ms"]), _dash(r["overhead_ms"]), r["reps"]]
                         for r in hop["rows"]])
        if any(hop["errors"].values()):
            out += ["", f"Device-path errors: {hop['errors']}"]
        out.append("")
    kv = res.get("kv")
    if kv:
        out += ["## KV exchange", "",
                f"{kv['total_bytes'] / (1 << 30):.2f} GiB of KV in {kv['page_bytes'] >> 10} KiB pages, taken in a "
                "random order (a pool's blocks are scattered), gathered into chunks on the sender, sent on a bulk "
                "connection and scattered into the peer's region. GB/s is payload bytes over wall time to the last "
                "page; peak = one device-to-device copy of 64 MiB in one process. Each page is copied three "
                "times on the device (gather, into the link's buffer, scatter), so a third of the peak is the "
                "ceiling of this design. Hop during = a decode hop (64 x 4096 bf16) on the activation "
                "connection while the exchange runs (activations go first between chunks).", ""]
        out += md_table(["chunk", "GB/s", "share of copy peak", "hop p50 idle ms", "hop p50 during ms",
                         "hop p99 during ms", "hops during"], "rrrrrrr",
                        [[f"{r['chunk_mib']} MiB", r["gb_per_s"], r["share_of_peak"], r["hop_idle_p50_ms"],
                          r["hop_during_p50_ms"], r["hop_during_p99_ms"], r["hop_during_n"]] for r in kv["rows"]])
        if kv["rows"]:
            out += ["", f"Copy peak: {kv['rows'][0]['peak_copy_gb_per_s']} GB/s."]
        out.append("")
    pl = res.get("pipeline")
    if pl:
        d = pl["dims"]
        out += ["## Two-stage pipeline, 7B-sized", "",
                f"{d['layers']} layers, hidden {d['hidden']}, {d['heads']} heads / {d['kv_heads']} KV heads, MLP "
                f"{d['inter']}, vocab {d['vocab']}, bf16: {pl['params'] / 1e9:.2f} G parameters; decode with "
                f"{pl['context']} tokens of KV per sequence. Single: one process runs every layer. Grouped: "
                "layers 16-31 run in the peer, called once per step with the hidden states and the residual; "
                "the caller runs embedding, layers 0-15 and the head. Every step ends with the tokens on the "
                "host. Median of the steps; graphs = each process's part captured as a CUDA graph. The peer's "
                "layers are built from the same seed as the single process's, so both give the same greedy "
                "tokens (last column).", ""]
        yn = lambda v: "-" if v is None else ("yes" if v else "no")  # noqa: E731
        out += md_table(["batch", "graphs", "single ms", "grouped ms", "overhead ms/step", "overhead us/token",
                         "overhead %", "single p90", "grouped p90", "same tokens", "span twice here same"],
                        "rlrrrrrrrll",
                        [[r["batch"], "yes" if r["graphs"] else "no", r["single_ms"], r["grouped_ms"],
                          r["overhead_ms_per_step"], r["overhead_us_per_token"], f"{100 * r['overhead_share']:.1f}",
                          r["single_p90_ms"], r["grouped_p90_ms"], yn(r.get("tokens_equal")),
                          yn(r.get("span_repeat_equal"))] for r in pl["rows"]])
        g = [r for r in pl["rows"] if r["graphs"]]
        e = [r for r in pl["rows"] if not r["graphs"]]
        out += ["",
                f"With CUDA graphs (how vLLM runs decode on CUDA by default) the grouped step costs "
                f"{min(r['overhead_share'] for r in g) * 100:+.1f}% to {max(r['overhead_share'] for r in g) * 100:+.1f}% "
                "of the single process's: the host sends the hidden states' header while the device still "
                "runs the first half, and the peer's stream waits on the caller's event, so the link's host "
                "round trip hides behind the device's work." if g else "", "",
                "Eager steps are launch-bound here (batch 1: "
                f"{e[0]['single_ms']} ms eager vs {g[0]['single_ms'] if g else '?'} ms graphed); their grouped - single "
                "differences are host effects (two processes launching kernels, the one GPU switching between "
                "their contexts), not the link." if e else "", "",
                "\"Same tokens\": greedy tokens of the grouped and the single step for the same input. Where "
                "they differ, the kernels themselves are not bit-reproducible at that batch: the last column "
                "runs the peer's span twice in the caller's own process and compares the hidden states. The "
                "link moves bits exactly (tests/gpu/test_stage_cuda.py compares every element).", ""]
    d = res.get("derived") or {}
    if d:
        out += ["## What the project takes from this run", ""]
        if "chosen_chunk_mib" in d:
            out.append(f"- CUDA bulk chunk: **{d['chosen_chunk_mib']} MiB**, the smallest measured chunk within 3/4 of "
                       "the best measured KV-exchange throughput (`transfer.stage.BULK_CHUNK_BYTES`).")
        if "link_fit" in d:
            f = d["link_fit"]
            out.append(f"- Simulator link `stage-h100` (`sim.hardware.LINKS`): {f['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s "
                       f"(copy rate / 3), {f['latency_s'] * 1e6:.0f} us per hop (what a hop adds to a CUDA-graphed step, "
                       "median over batches).")
        if "hop_round_trip_p50_ms" in d:
            out.append(f"- Host round trip of the link on this machine: {d['hop_round_trip_p50_ms']:.2f} ms (median of "
                       "the ipc rows' p50); it overlaps the device's work when the step is captured as a graph, and is "
                       "paid in full by an eager step, whose host launches the kernels.")
        out.append("")
    for k, v in res.get("failed", {}).items():
        out += [f"Part `{k}` failed: `{v.splitlines()[-1] if v else ''}`", ""]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="hop,kv,pipeline")
    ap.add_argument("--quick", action="store_true", help="a few sizes only (a smoke run)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--render", type=Path, help="rewrite the doc (and the derived figures) from this run's JSON, "
                    "without measuring: the lent GPU machine returns the JSON, the doc is rendered here")
    ap.add_argument("--out", type=Path, default=DOCS / "stage_link_gpu.json")
    a = ap.parse_args(argv)
    md = a.out.with_suffix(".md")
    if a.render:
        res = json.loads(a.render.read_text())
        res["derived"] = derive(res)
        a.out.write_text(json.dumps(res, indent=1))
        md.write_text("\n".join(render(res)))
        return 0
    import torch

    from vllm_kunserve.bench.report import command

    ctx = mp.get_context("spawn")
    res = {"command": command("stage_link_gpu.py", sys.argv[1:]), "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "failed": {}}
    try:
        import subprocess
        res["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        pass
    for part in a.parts.split(","):
        t0 = time.time()
        try:
            if part == "hop":
                res["hop"] = part_hop(torch, ctx, a.quick)
            elif part == "kv":
                res["kv"] = part_kv(torch, ctx, a.quick)
            elif part == "pipeline":
                res["pipeline"] = part_pipeline(torch, ctx, a.quick, a.steps)
            else:
                raise SystemExit(f"--parts: unknown part {part!r} (hop, kv, pipeline)")
        except Exception:
            res["failed"][part] = traceback.format_exc()
            print(res["failed"][part], flush=True)
        print(f"part {part}: {time.time() - t0:.1f} s", flush=True)
        res["derived"] = derive(res)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
        md.write_text("\n".join(render(res)))
        if os.environ.get("OUT"):
            for f in (a.out, md):
                shutil.copy(f, os.environ["OUT"])
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
