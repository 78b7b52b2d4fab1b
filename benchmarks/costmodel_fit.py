"""Cost-model forms on every profile: held-out error of paper / extended / roofline, the auto choice.

Usage:
    python -m benchmarks.costmodel_fit [--data ../shared/data] [--out docs/benchmarks/costmodel_fit.json]
                                       [--md docs/benchmarks/costmodel_fit.md]
    python -m benchmarks.costmodel_fit --measure-cpu 4 --model models/small   # (re)measure the CPU runs first

``--measure-cpu N`` takes N vLLM-CPU runs (``benchmarks/profile_cpu_steps.py --quick --repeat 1``),
each started only when the machine is idle, and keeps a run only if other processes used at most
``--max-foreign`` of the CPU while it ran (/proc/stat busy time minus the run's own CPU time); a
kept run is written to ``docs/benchmarks/costmodel_fit_cpu_run<k>.json`` with that share in its meta.

Scores (mean relative error, rows other than those fitted):

* every Vidur ``mlp.csv`` under ``--data/profiles/vidur`` at every TP degree: fitted on a random 80%
  (seed 0), scored on the other 20%; the auto form is picked by 5-fold cross-validation on the 80%;
* vLLM-CPU step times of the ``small`` model: the two shipped profiles (held-out 20% of each, and
  each fitted on one and scored on the other) and the re-measured runs
  ``docs/benchmarks/costmodel_fit_cpu_run<N>.json`` (``benchmarks/profile_cpu_steps.py --quick``,
  run N times one after the other): the per-shape minimum over the odd runs is fitted and the
  per-shape minimum over the even runs scored, and the other way round (the minimum: other jobs on
  the shared cores only add time).

Where the chosen form misses 5%, the residuals say why: the mean signed error per token range and
the jitter between neighbouring token counts, which no smooth function of the batch can follow.
Pure CPU, a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from vllm_kunserve.bench.report import md_row, md_table, write_json
from vllm_kunserve.policy import costmodel as pc
from vllm_kunserve.bench.costmodel_eval import (TARGET, bench_vidur, percent, repeat_noise, score, small_batch_kinds,
                                                vidur_table)

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
CPU_DIR = ROOT / "docs" / "benchmarks"
CPU_SHIPPED = (("profile_cpu_steps", CPU_DIR / "cpu_small_profile.json"),
               ("harness solo requests", CPU_DIR / "sim_cpu_small_insitu_profile.json"))


def shape_median(profiles: list[pc.Profile], name: str) -> pc.Profile:
    """One row per distinct batch shape: the median of its timings over ``profiles``."""
    by = defaultdict(list)
    for p in profiles:
        for b, ms in zip(p.batches, p.ms):
            by[b].append(float(ms))
    shapes = sorted(by, key=lambda b: (sum(c for _, c in b), len(b), b))
    return pc.Profile(tuple(shapes), np.array([statistics.median(by[b]) for b in shapes]), True, name)


def shape_min(profiles: list[pc.Profile], name: str) -> pc.Profile:
    """One row per distinct batch shape: the least of its timings over ``profiles``. Other jobs on
    the shared cores only ever add time (a decode step that takes 7 ms alone took 700 ms while a
    test suite ran beside it), so the minimum over repeats is the undisturbed step time."""
    by = defaultdict(list)
    for p in profiles:
        for b, ms in zip(p.batches, p.ms):
            by[b].append(float(ms))
    shapes = sorted(by, key=lambda b: (sum(c for _, c in b), len(b), b))
    return pc.Profile(tuple(shapes), np.array([min(by[b]) for b in shapes]), True, name)


def cpu_runs() -> list[Path]:
    runs = sorted(CPU_DIR.glob("costmodel_fit_cpu_run*.json"), key=lambda p: int(p.stem.rsplit("run", 1)[1]))
    return runs


def bench_cpu() -> dict:
    out: dict = {"shipped": [], "remeasured": [], "runs": []}
    shipped = [(what, pc.load_profile(p), p) for what, p in CPU_SHIPPED if p.exists()]
    for what, prof, p in shipped:
        out["shipped"].append({**score(prof), "what": what, "file": str(p.relative_to(ROOT)),
                               "repeat_noise_all": repeat_noise(prof)})
    for what, prof, p in shipped:
        if repeat_noise(prof) and len({b for b in prof.batches}) < len(prof):
            med = shape_median([prof], f"{what}, median per shape")
            out["shipped"].append({**score(med), "what": f"{what}, median per shape",
                                   "file": str(p.relative_to(ROOT))})
    if len(shipped) == 2:
        (wa, a, fa), (wb, b, fb) = shipped
        for (w1, p1, f1), (w2, p2, f2) in (((wa, a, fa), (wb, b, fb)), ((wb, b, fb), (wa, a, fa))):
            out["shipped"].append({**score(p1, test=p2), "what": f"fit {w1}, score {w2}",
                                   "file": f"{f1.relative_to(ROOT)} -> {f2.relative_to(ROOT)}"})
    runs = cpu_runs()
    if len(runs) >= 2:
        profs = [pc.load_profile(p) for p in runs]
        meta = json.loads(runs[0].read_text()).get("meta", {})
        odd = shape_min(profs[0::2], "odd runs (min per shape)")
        even = shape_min(profs[1::2], "even runs (min per shape)")
        out["runs"] = [{"file": str(p.relative_to(ROOT)), "rows": len(q), "repeat_noise": repeat_noise(q),
                        "foreign_cpu_share": json.loads(p.read_text())["meta"].get("foreign_cpu_share")}
                       for p, q in zip(runs, profs)]
        out["runs_meta"] = meta
        out["between_run_noise"] = _between(odd, even)
        for tr, te in ((odd, even), (even, odd)):
            out["remeasured"].append({**score(tr, test=te), "what": f"fit {tr.name}, score {te.name}",
                                      "small_batches": small_batch_kinds(pc.fit(tr, form="auto"), te),
                                      "per_sequence_probe": per_sequence_probe(tr, te),
                                      "noise_floor": _between(tr, te)["mean_rel_diff"]})
        pooled = shape_min(profs, "all runs (min per shape)")
        out["remeasured"].append({**score(pooled), "what": "all runs (min per shape), held-out 20%"})
    return out


def per_sequence_probe(train: pc.Profile, test: pc.Profile) -> dict:
    """Diagnostic, not a model form: the extended form plus ``epsilon`` per sequence (chunk) in the
    batch, i.e. one LM-head row and one sample per sequence, which Eq. 1-3 have no term for."""
    def cols(p: pc.Profile) -> np.ndarray:
        return np.column_stack([p.design(), [len(b) for b in p.batches]])
    w = 1.0 / train.ms
    c = pc.nnls(cols(train) * w[:, None], train.ms * w)
    return {"epsilon_ms_per_sequence": float(c[4]), "heldout": pc._errors(cols(test) @ c, test.ms)}


def _between(a: pc.Profile, b: pc.Profile) -> dict:
    """Shapes timed in both halves: relative distance of their two reduced timings (the noise floor of
    fitting one half and scoring the other)."""
    mb = dict(zip(b.batches, b.ms))
    d = [abs(x - mb[s]) / mb[s] for s, x in zip(a.batches, a.ms) if s in mb]
    return {"shapes_in_both": len(d), "shapes_a": len(a), "shapes_b": len(b),
            "mean_rel_diff": float(np.mean(d)) if d else None, "median_rel_diff": float(np.median(d)) if d else None}


# ------------------------------------------------------------------------------------------------
def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot (/proc/stat; idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4], sum(v)


def _busy_share(seconds: float) -> float:
    b0, t0 = _cpu_jiffies()
    time.sleep(seconds)
    b1, t1 = _cpu_jiffies()
    return (b1 - b0) / max(t1 - t0, 1)


def measure_cpu(runs: int, model: str, max_foreign: float = 0.05, max_wait_s: float = 3600.0,
                out_dir: Path = CPU_DIR) -> list[Path]:
    """Take ``runs`` vLLM-CPU profiles on an otherwise idle machine (see the module doc)."""
    tick = os.sysconf("SC_CLK_TCK")
    done = [p for p in cpu_runs()]
    k = max((int(p.stem.rsplit("run", 1)[1]) for p in done), default=0)
    tmp = Path(tempfile.gettempdir()) / f"costmodel_fit_cpu_{os.getpid()}.json"
    deadline = time.time() + max_wait_s
    rejected, kept = [], []
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_cpu_steps.py"), "--model", model, "--quick",
           "--repeat", "1", "--out", str(tmp)]
    while len(kept) < runs and time.time() < deadline:
        if _busy_share(5.0) > max_foreign:  # someone else is running: wait for idle
            continue
        b0, t0 = _cpu_jiffies()
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        w0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.time() - w0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        b1, t1 = _cpu_jiffies()
        if proc.returncode != 0:
            raise SystemExit(f"profile_cpu_steps failed:\n{proc.stderr[-2000:]}")
        ours = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        foreign = max(0.0, (b1 - b0) / tick - ours) / max((t1 - t0) / tick, 1e-9)
        if foreign > max_foreign:
            rejected.append(foreign)
            print(f"run rejected: other processes used {foreign:.1%} of the CPU", flush=True)
            continue
        doc = json.loads(tmp.read_text())
        k += 1
        doc["meta"].update({"command": " ".join(["python", "benchmarks/profile_cpu_steps.py"] + cmd[2:-2]
                                                + ["--out", f"docs/benchmarks/costmodel_fit_cpu_run{k}.json"]),
                            "taken_by": "python -m benchmarks.costmodel_fit --measure-cpu",
                            "foreign_cpu_share": foreign, "wall_s": wall, "runs_rejected_before": len(rejected),
                            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "model": model})
        out = out_dir / f"costmodel_fit_cpu_run{k}.json"
        write_json(out, doc, indent=None, clean=False)
        kept.append(out)
        print(f"kept {out.name}: {len(doc['rows'])} steps, other processes {foreign:.1%} of the CPU, {wall:.0f} s",
              flush=True)
    tmp.unlink(missing_ok=True)
    return kept


def _noise(rn: dict | None) -> str:
    return "-" if not rn else f"{rn['mean_rel_dev']:.1%} ({rn['rows']} rows)"


def cpu_table(rows: list[dict]) -> list[str]:
    L = md_table(["step times", "fitted rows", "scored rows", "scored on", "paper", "extended", "roofline", "auto form",
                  "auto mean", "auto max", "repeat noise of scored rows", "<= 5%"], "l" * 12)
    for c in rows:
        f, rn = c["forms"], c.get("repeat_noise")
        L.append(md_row([c["what"], c["train_rows"], c["test_rows"], c["scored_on"], percent(f["paper"]["mean_rel_err"]),
                         percent(f["extended"]["mean_rel_err"]), percent(f["roofline"]["mean_rel_err"]), c["auto_form"],
                         percent(c["heldout"]["mean_rel_err"]), percent(c["heldout"]["max_rel_err"]), _noise(rn),
                         "yes" if c["meets_target"] else "**no**"]))
    return L


def miss_notes(rows: list[dict]) -> list[str]:
    """One line per profile that misses 5%: where the residuals of the chosen form sit."""
    L = []
    for c in rows:
        if c["meets_target"]:
            continue
        bins = ", ".join(f"{b['tokens'][0]}-{b['tokens'][1] if b['tokens'][1] < 1 << 29 else 'max'} tokens "
                         f"{b['mean_signed']:+.1%} signed / {b['mean_abs']:.1%} abs ({b['rows']} rows)"
                         for b in c["residuals"])
        extra = []
        if c.get("neighbour_jitter") is not None:
            extra.append(f"neighbour jitter {c['neighbour_jitter']:.1%}")
        rn = c.get("repeat_noise")
        if rn:
            extra.append(f"identical shapes differ from their other timings' median by {rn['mean_rel_dev']:.1%} "
                         f"on average (max {rn['max_rel_dev']:.0%}, {rn['rows']} rows)")
        if c.get("noise_floor") is not None:
            extra.append(f"the fitted half's own timings score the other half at {c['noise_floor']:.1%} "
                         "(a perfect table of every shape), so no model can reach 5% here")
        sb = c.get("small_batches")
        if sb:
            extra.append("batches of <= 128 tokens: " + ", ".join(
                f"{k.replace('_', ' ')} ({v['rows']} rows, {v['sequences'][0]}-{v['sequences'][1]} sequences) "
                f"{v['mean_signed']:+.1%} signed" for k, v in sb.items()))
        pr = c.get("per_sequence_probe")
        if pr:
            extra.append(f"adding a per-sequence term (one LM-head row and one sample per sequence; "
                         f"{pr['epsilon_ms_per_sequence']:.3f} ms each when fitted) gives "
                         f"{pr['heldout']['mean_rel_err']:.1%}")
        L.append(f"* **{c.get('what', c['profile'])}** ({c['auto_form']}, {percent(c['heldout']['mean_rel_err'])}): "
                 f"held-out residuals by batch size: {bins}" + (f"; {'; '.join(extra)}" if extra else "") + ".")
    return L


def render(r: dict, cmd: str) -> str:
    v = r["vidur"]
    n_ok = sum(c["meets_target"] for c in v)
    n_lin = sum(min(c["forms"]["paper"]["mean_rel_err"], c["forms"]["extended"]["mean_rel_err"]) <= TARGET for c in v)
    n_t1 = sum(c["forms"]["roofline_tile1"]["mean_rel_err"] <= TARGET for c in v)
    L = ["# Cost-model forms: held-out error per profile", "",
         f"Produced by `{cmd}` on {r['machine']} (Python {r['python']}); raw numbers in "
         "`docs/benchmarks/costmodel_fit.json`. Target: mean relative error <= 5% on rows the fit did not see.", "",
         "Forms (`vllm_kunserve/policy/costmodel.py`, docs/policy.md): **paper** = Eq. 1-3, "
         "`alpha A + beta B + gamma`; **extended** = paper + `delta D` (decode KV reads); **roofline** = "
         "extended with the token term `beta B` replaced by `beta_floor B + max(floor, (beta - beta_floor) "
         "pad(B))`: the larger of the weight-read time and the (GEMM-tile padded) compute time. The knee "
         "and the tile (1, 16, 32, 64 or 128 rows) are searched, the rest is NNLS on relative error. "
         "**roofline, no tile** = the same with tile fixed at 1 (the plain max of floor and slope). "
         "**auto** = the form `fit(form=\"auto\")` and `fit_with_holdout` (default) pick by 5-fold "
         "cross-validation on the training rows only; its error is the verdict.", "",
         "## Vidur profiles (held-out 20%, seed 0)", "",
         "Per-layer time of the linear stages (sum of medians, embedding excluded) per batch token count; no "
         "attention in these timings, so alpha = delta = 0 and paper = extended. Token-only = time "
         "proportional to tokens.", ""]
    L += vidur_table(v)
    L += ["", f"**{n_ok} of {len(v)} profiles meet the 5% target with the auto form** (paper/extended: "
          f"{n_lin} of {len(v)}; roofline without the tile: {n_t1} of {len(v)}).", ""]
    miss = miss_notes(v)
    if miss:
        L += ["Misses, and what the equation cannot express there:", ""] + miss + [""]
    if all("split_spread" in c for c in v):
        seeds = v[0]["split_spread"]["seeds"]
        L += [f"Held-out mean error over {len(seeds)} random 80/20 splits (seeds {seeds[0]}-{seeds[-1]}): mean and "
              "worst split, and how many splits meet 5%:", ""]
        L += md_table(["profile", "paper mean", "paper worst", "roofline mean", "roofline worst", "roofline splits <= 5%"],
                      "llllll", ([c["profile"], percent(float(np.mean(sp["paper"]))), percent(max(sp["paper"])),
                                  percent(float(np.mean(sp["roofline"]))), percent(max(sp["roofline"])),
                                  f"{sum(e <= TARGET for e in sp['roofline'])} of {len(seeds)}"]
                                 for c in v for sp in [c["split_spread"]]))
        L.append("")
    L += ["Fitted roofline parameters (ms per layer; the seed-0 training rows):", ""]
    L += md_table(["profile", "beta ms/token", "beta_floor ms/token", "floor ms", "knee tokens", "tile", "gamma ms",
                   "neighbour jitter"], "l" * 8,
                  ([c["profile"], f"{m['beta']:.3g}", f"{m['beta_floor']:.3g}", f"{m['floor']:.3g}",
                    f"{m['knee_tokens']:.0f}", m["tile"], f"{m['gamma']:.3g}", percent(c["neighbour_jitter"])]
                   for c in v for m in [c["roofline"]]))
    L += ["", "Neighbour jitter = mean relative distance of each row from the line through its two neighbours in "
          "token count: the steps of cuBLAS kernel and tile choices between neighbouring batch sizes (e.g. "
          "+25-30% from 512 to 520 tokens on several profiles). The tile term follows the 128-row steps; the "
          "rest of the jitter is what no smooth function of the token count can follow.", ""]
    cpu = r["cpu"]
    L += ["## vLLM-CPU step times (`small` model, float32)", ""]
    rows = cpu["shipped"] + cpu["remeasured"]
    sep = [c for c in rows if c["scored_on"].startswith("separate")]
    if sep:
        best = min(sep, key=lambda c: c["heldout"]["mean_rel_err"])
        floors = [c["noise_floor"] for c in sep if c.get("noise_floor") is not None]
        L += [f"Fitted on one separately measured profile and scored on another, the best result is "
              f"{percent(best['heldout']['mean_rel_err'])} ({best['what']}, {best['auto_form']} form): "
              f"{'meets' if best['meets_target'] else 'misses'} the 5% target"
              + (f"; the timings themselves differ by {percent(min(floors))}-{percent(max(floors))} between the "
                 "measured halves, more than the target, so no function of the batch shape can meet it on "
                 "this machine." if floors else ".") + " Held-out rows of one profile are scored too.", ""]
    noisy = next((c for c in cpu["shipped"] if c.get("repeat_noise_all")
                  and c["repeat_noise_all"]["mean_rel_dev"] > 1.0), None)
    if noisy:
        L += [f"`{noisy['file']}` was taken while other jobs ran: identical batch shapes differ from the median of "
              f"their other timings by {noisy['repeat_noise_all']['mean_rel_dev']:.0%} on average (up to "
              f"{1 + noisy['repeat_noise_all']['max_rel_dev']:.0f}x), so no form can fit it; the re-measured runs "
              "below replace it.", ""]
    if rows:
        L += cpu_table(rows)
        L += ["", "Repeat noise = mean relative distance of a scored row from the median of the other timings of "
              "the exact same batch shape (leave one out), over the scored rows whose shape was timed more than "
              "once: what even a perfect model of the batch shape misses.", ""]
    for c in cpu["shipped"]:
        rn = c.get("repeat_noise_all")
        if rn:
            L.append(f"* `{c['file']}` ({c['what']}): identical shapes differ from the median of their other "
                     f"timings by {rn['mean_rel_dev']:.0%} on average (median {rn['median_rel_dev']:.0%}, max "
                     f"{rn['max_rel_dev']:.0%}; {rn['rows']} rows).")
    if cpu.get("runs"):
        b = cpu["between_run_noise"]
        L += ["", f"Re-measured: {len(cpu['runs'])} runs of `python -m benchmarks.profile_cpu_steps --model <small> "
              "--quick --repeat 1` (the model built by `kunserve make-model --preset small`), taken by `python "
              "benchmarks/costmodel_fit.py --measure-cpu N`: a run starts only when the machine is idle and is kept "
              "only if other processes used at most 5% of the CPU while it ran (the 2 cores are shared with other "
              "jobs; runs they disturbed were dropped). The odd and the even runs are each reduced to the minimum "
              f"per batch shape ({b['shapes_a']} and {b['shapes_b']} shapes); the {b['shapes_in_both']} shapes "
              f"timed in both halves differ by {percent(b['mean_rel_diff'])} on average (median "
              f"{percent(b['median_rel_diff'])}): the floor under any fit-one-half, score-the-other error.", ""]
        for run in cpu["runs"]:
            rn = run["repeat_noise"]
            L.append(f"* `{run['file']}`: {run['rows']} steps, other processes {run['foreign_cpu_share']:.1%} of the "
                     f"CPU" + (f", repeat noise {rn['mean_rel_dev']:.0%} (median {rn['median_rel_dev']:.0%})" if rn else ""))
    miss = miss_notes(rows)
    if miss:
        L += ["", "Misses, and what the equation cannot express there:", ""] + miss
    L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "costmodel_fit.json"))
    ap.add_argument("--md", default=str(ROOT / "docs" / "benchmarks" / "costmodel_fit.md"))
    ap.add_argument("--measure-cpu", type=int, default=0, metavar="N",
                    help="first take N more vLLM-CPU runs on an idle machine (see the module doc)")
    ap.add_argument("--model", default="models/small", help="model dir for --measure-cpu")
    ap.add_argument("--max-foreign", type=float, default=0.05,
                    help="--measure-cpu: keep a run only if other processes used at most this CPU share")
    ap.add_argument("--max-wait", type=float, default=3600.0, help="--measure-cpu: give up after this many s")
    a = ap.parse_args(argv)
    if a.measure_cpu:
        measure_cpu(a.measure_cpu, a.model, a.max_foreign, a.max_wait)
    r = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version(),
         "command": "python -m benchmarks.costmodel_fit", "vidur": bench_vidur(Path(a.data)), "cpu": bench_cpu()}
    write_json(a.out, r, indent=1, clean=False)
    Path(a.md).write_text(render(r, r["command"]))
    print(json.dumps({"vidur_meet_target": sum(c["meets_target"] for c in r["vidur"]), "vidur": len(r["vidur"]),
                      "cpu": [(c["what"], c["auto_form"], round(c["heldout"]["mean_rel_err"], 4))
                              for c in r["cpu"]["shipped"] + r["cpu"]["remeasured"]]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
