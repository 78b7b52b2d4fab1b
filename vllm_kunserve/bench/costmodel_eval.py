"""Held-out scoring of cost-model fits on measured step-time profiles (``policy.costmodel``'s forms,
the auto choice, the residuals by batch size and the noise no fit of the batch shape can beat), and
the Vidur profiles' table, for ``benchmarks/costmodel_fit.py`` and ``benchmarks/policy_overhead.py``.
"""

from __future__ import annotations

import csv
import glob
import os
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

from vllm_kunserve.bench.report import REPO, md_row, md_table
from vllm_kunserve.policy import costmodel as pc

TARGET = 0.05
BINS = ((1, 128), (129, 512), (513, 2048), (2049, 1 << 30))  # batch tokens


def _rel(pred: np.ndarray, ms: np.ndarray) -> np.ndarray:
    return (pred - ms) / ms


def residual_bins(model: pc.CostModel, prof: pc.Profile) -> list[dict]:
    """Mean signed and absolute relative error of ``model`` per batch-token range."""
    r = _rel(pc.predict(model, prof), prof.ms)
    toks = prof.design()[:, 1]
    out = []
    for lo, hi in BINS:
        sel = (toks >= lo) & (toks <= hi)
        if sel.any():
            out.append({"tokens": [lo, hi], "rows": int(sel.sum()), "mean_signed": float(r[sel].mean()),
                        "mean_abs": float(np.abs(r[sel]).mean())})
    return out


def small_batch_kinds(model: pc.CostModel, prof: pc.Profile, most: int = 128) -> dict:
    """Batches of at most ``most`` tokens, split into decode-only ones (every chunk one token) and
    those with a prefill chunk: mean signed relative error and rows of each."""
    r = _rel(pc.predict(model, prof), prof.ms)
    out = {}
    for kind, want in (("decode_only", True), ("with_prefill", False)):
        sel = [i for i, b in enumerate(prof.batches)
               if sum(c for _, c in b) <= most and all(c == 1 for _, c in b) == want]
        if sel:
            out[kind] = {"rows": len(sel), "mean_signed": float(r[sel].mean()),
                         "sequences": [min(len(prof.batches[i]) for i in sel), max(len(prof.batches[i]) for i in sel)]}
    return out


def neighbour_jitter(prof: pc.Profile) -> float | None:
    """Single-chunk profiles: mean relative distance of each row from the straight line through
    its two neighbours in token count. A step between neighbouring token counts (a kernel or tile
    switch) shows here; any smooth function of the token count misses by about this much."""
    if prof.attention or any(len(b) != 1 or b[0][0] != 0 for b in prof.batches):
        return None  # only for one-chunk-per-batch profiles without attention (Vidur mlp.csv)
    toks = prof.design()[:, 1]
    o = np.argsort(toks, kind="stable")
    t, y = toks[o], prof.ms[o]
    keep = np.r_[True, np.diff(t) > 0]
    t, y = t[keep], y[keep]
    if len(t) < 3:
        return None
    mid = y[:-2] + (y[2:] - y[:-2]) * (t[1:-1] - t[:-2]) / (t[2:] - t[:-2])
    return float(np.mean(np.abs(y[1:-1] - mid) / y[1:-1]))


def repeat_noise(prof: pc.Profile) -> dict | None:
    """Rows whose exact batch shape was timed more than once: mean relative distance of each from
    the median of the other timings of its shape (what even a perfect model of the shape misses)."""
    by = defaultdict(list)
    for b, ms in zip(prof.batches, prof.ms):
        by[b].append(ms)
    dev = []
    for v in by.values():
        for i, x in enumerate(v):
            rest = v[:i] + v[i + 1:]
            if rest:
                dev.append(abs(x - statistics.median(rest)) / x)
    if not dev:
        return None
    return {"rows": len(dev), "mean_rel_dev": float(np.mean(dev)), "median_rel_dev": float(np.median(dev)),
            "max_rel_dev": float(np.max(dev))}


def _params(m: pc.CostModel) -> dict:
    return {"alpha": m.alpha, "beta": m.beta, "gamma": m.gamma, "delta": m.delta, "floor": m.floor,
            "beta_floor": m.beta_floor, "tile": m.tile, "knee_tokens": m.knee, "form": m.form}


def score(prof: pc.Profile, test: pc.Profile | None = None, seed: int = 0) -> dict:
    """Held-out errors of every form, the roofline without tile search, the auto choice (5-fold CV
    on the training rows), its residuals, and the verdict."""
    model, rep = pc.fit_with_holdout(prof, seed=seed, test=test)
    if test is None:
        tr, te = pc.split_holdout(len(prof), 0.2, seed)
        ptrain, ptest = prof.subset(tr), prof.subset(te)
    else:
        ptrain, ptest = prof, test
    no_tile = pc.fit(ptrain, form="roofline", tiles=(1,))
    forms = {f: v["heldout"] for f, v in rep["forms"].items()}
    forms["roofline_tile1"] = pc._errors(pc.predict(no_tile, ptest), ptest.ms)
    h = rep["heldout"]
    return {"profile": prof.name, "rows": len(prof), "train_rows": len(ptrain), "test_rows": len(ptest),
            "scored_on": rep["scored_on"], "auto_form": rep["form"], "cv_mean_rel_err": rep["cv_mean_rel_err"],
            "heldout": h["model"], "token_only": {k: h["token_only"][k] for k in ("mean_rel_err", "max_rel_err")},
            "forms": forms, "model": _params(model), "roofline": _params(pc.fit(ptrain, form="roofline")),
            "residuals": residual_bins(model, ptest), "residuals_train": residual_bins(model, ptrain),
            "neighbour_jitter": neighbour_jitter(prof), "repeat_noise": repeat_noise(ptest),
            "meets_target": h["model"]["mean_rel_err"] <= TARGET}


# ------------------------------------------------------------------------------------------------
def vidur_paths(data: Path) -> list[str]:
    """Every Vidur ``mlp.csv`` under ``data/profiles/vidur``."""
    paths = sorted(glob.glob(str(data / "profiles" / "vidur" / "*" / "*" / "*" / "mlp.csv")))
    return paths or [str(REPO / "tests" / "data" / "vidur_h100_phi2_mlp.csv")]   # the checkout's small one


def split_spread(prof: pc.Profile, seeds=range(5)) -> dict:
    """Held-out mean relative error of the paper and roofline forms over several random 80/20
    splits: how much the seed-0 verdict depends on which rows were held out."""
    out = {"seeds": list(seeds), "paper": [], "roofline": []}
    for seed in seeds:
        tr, te = pc.split_holdout(len(prof), 0.2, seed)
        ptrain, ptest = prof.subset(tr), prof.subset(te)
        for f in ("paper", "roofline"):
            out[f].append(pc._errors(pc.predict(pc.fit(ptrain, form=f), ptest), ptest.ms)["mean_rel_err"])
    return out


def bench_vidur(data: Path, spread: bool = True) -> list[dict]:
    out = []
    for p in vidur_paths(data):
        with open(p, newline="") as f:
            tps = sorted({int(r["num_tensor_parallel_workers"]) for r in csv.DictReader(f)})
        for tp in tps:
            prof = pc.load_vidur_mlp(p, tp)
            row = {**score(prof), "path": os.path.relpath(p, data)}
            if spread:
                row["split_spread"] = split_spread(prof)
            out.append(row)
    return out


# ------------------------------------------------------------------------------------------------
def percent(v) -> str:
    """A relative error as the docs write it (``-`` for none)."""
    return "-" if v is None else f"{v:.1%}"


def vidur_table(rows: list[dict]) -> list[str]:
    """The Vidur profiles' held-out errors by form (:func:`bench_vidur`'s rows) as a markdown table."""
    L = md_table(["profile", "rows", "paper", "extended", "roofline, no tile", "roofline", "auto form", "auto mean",
                  "auto max", "token-only", "knee tokens", "tile", "<= 5%"], "l" * 13)
    for c in rows:
        f, m = c["forms"], c["model"]
        knee = f"{m['knee_tokens']:.0f}" if m["form"] == "roofline" and m["floor"] > 0 else "-"
        L.append(md_row([c["profile"], c["rows"], percent(f["paper"]["mean_rel_err"]),
                         percent(f["extended"]["mean_rel_err"]), percent(f["roofline_tile1"]["mean_rel_err"]),
                         percent(f["roofline"]["mean_rel_err"]), c["auto_form"], percent(c["heldout"]["mean_rel_err"]),
                         percent(c["heldout"]["max_rel_err"]), percent(c["token_only"]["mean_rel_err"]), knee,
                         m["tile"] if m["form"] == "roofline" else "-", "yes" if c["meets_target"] else "**no**"]))
    return L
