"""Stage-link round trip between two processes on one host (the pipeline group's hop).

Both processes use one compute thread, as engines' workers do. A pipeline group hands every step's hidden states to the member that holds the next layers and
back (``vllm_kunserve.transfer.stage``: Unix socket + shared-memory payload). This measures the
round trip with a handler that returns its input, for the payload sizes a decode step (a few
KiB to 100s of KiB) and a prefill chunk (MiBs) move, with the server in another process.

    python -m benchmarks.stage_link [--reps 200]

Writes docs/benchmarks/stage_link.{json,md}.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

from vllm_kunserve.bench.report import command, md_table, write_json
from vllm_kunserve.workload.stats import percentile

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
OUT = ROOT / "docs" / "benchmarks"
SIZES = [16 << 10, 256 << 10, 4 << 20, 24 << 20]


def _serve(q) -> None:
    import torch

    torch.set_num_threads(1)  # as in an engine's worker: one compute thread
    from vllm_kunserve.transfer.stage import StageServer

    srv = StageServer(lambda kind, meta, tensors: (None, tensors))
    q.put(srv.address)
    time.sleep(3600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-doc", action="store_true")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from vllm_kunserve.transfer.stage import StageClient

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_serve, args=(q,), daemon=True)
    p.start()
    addr = q.get(timeout=60)
    rows = []
    try:
        c = StageClient(addr, nbytes=max(SIZES) * 2)
        for n in SIZES:
            x = torch.zeros(n // 4, dtype=torch.float32)
            reps = a.reps if n <= (4 << 20) else max(10, a.reps // 10)
            for _ in range(5):
                c.call("ping", None, {"x": x})
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                c.call("ping", {"step": 1}, {"x": x})
                times.append((time.perf_counter() - t0) * 1e3)
            # order statistics: the sample at or above each rank
            p50, p90 = (percentile(times, q, method="higher") for q in (50, 90))
            rows.append({"bytes": n, "reps": reps, "p50_ms": round(p50, 4), "p90_ms": round(p90, 4),
                         "max_ms": round(max(times), 4), "gb_per_s_each_way": round(2 * n / (p50 / 1e3) / 1e9 / 2, 2)})
            print(rows[-1], flush=True)
        c.close()
    finally:
        p.terminate()
    res = {"rows": rows, "load_avg": os.getloadavg(), "cpus": os.cpu_count(),
           "command": command("stage_link.py")}
    if not a.no_doc:
        write_json(OUT / "stage_link.json", res, indent=1, clean=False)
        lines = ["# Stage-link round trip (written by benchmarks/stage_link.py)", "",
                 f"Command: `{res['command']}`; {res['cpus']} CPUs; load average at the end "
                 f"{', '.join(f'{x:.2f}' for x in res['load_avg'])}.", "",
                 "Client and server in two processes on one host; the handler returns its input, so each "
                 "round trip moves the payload both ways (written into and read from the shared-memory "
                 "buffer on each side) plus two pickled headers over a Unix socket. A group's hop also "
                 "carries the step's attention metadata (small tensors, pickled).", "",
                 ] + md_table(["payload", "round trip p50 (ms)", "p90 (ms)", "max (ms)", "reps"], "rrrrr",
                              ([f"{r['bytes'] >> 10} KiB", r["p50_ms"], r["p90_ms"], r["max_ms"], r["reps"]]
                               for r in rows))
        lines += ["", "For comparison, issue 13 reports gloo over loopback at 1.5-9 ms p50 per 16 KiB on these "
                  "machines (the transfer channel's own benchmark: docs/benchmarks/mechanisms_transfer.md). "
                  "Both processes use one compute thread, as engines' workers do: with torch's default (one "
                  "OpenMP thread per core) the two processes' spin-waiting OpenMP threads fought over the 2 "
                  "cores here and the 256 KiB p90 went from 0.23 ms to 16 ms."]
        (OUT / "stage_link.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
