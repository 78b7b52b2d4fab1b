"""Batch cost model (KunServe Eq. 1-3, a decode KV-read term, a roofline token term) and its fit.

A *chunk* is ``c`` new tokens of one request whose first ``p`` tokens (its prefix) already have KV:

    chunk_cost(p, c) = alpha * (p*c + (c^2 + c) / 2) + beta * c + gamma          (Eq. 1-2)
                       + delta * p * [c == 1]                                      (extension)
    batch_cost(b)    = sum(chunk_cost) - (|b| - 1) * gamma                        (Eq. 3)
                     = alpha * A(b) + beta * B(b) + gamma + delta * D(b)

with ``A`` the attention pairs (prefix attention ``p*c`` plus causal self-attention), ``B`` the
token count and ``D`` the context tokens read by one-token chunks (decode steps ``(context, 1)``).
The fixed term ``gamma`` is paid once per batch (kernel launches, sampling).

Why ``delta``: prefill attention is compute-bound (cost per query-key pair, ``alpha``), but a
one-token chunk reads its whole KV prefix for a single query, so decode attention is bound by KV
bytes read and costs far more per context token than ``alpha`` says (about 40x for Qwen-2.5-14B
on an H100). With ``delta = 0`` (the default, and what the ``paper`` form fits) the model is exactly
Eq. 1-3; the ``extended`` form fits ``delta >= 0`` too.

The ``roofline`` form replaces the token term ``beta * B`` by the larger of the weight-read time
and the compute time of the batch's matrix multiplies (the physical roofline), plus the per-token
work that neither hides:

    T(B) = beta_floor * B + max(floor, (beta - beta_floor) * pad(B)),  pad(B) = tile * ceil(B / tile)
    batch_cost(b) = alpha * A(b) + T(B(b)) + gamma + delta * D(b)

``floor`` is the time to stream the weights once (flat in B: a small batch is weight-read bound);
``beta - beta_floor`` the compute per token once the batch is past the knee
``knee = floor / (beta - beta_floor)`` tokens; ``beta_floor`` the per-token work paid in both
regimes (activations, element-wise kernels); ``tile`` the GEMM row tile the compute is quantised to
(1: none; a 129-token batch computes two 128-row tiles). Above the knee and on tile boundaries
``T(B) = beta * B``, so ``beta`` keeps its meaning (per-token cost of a compute-bound batch) and the
paper/extended forms are the roofline with ``floor = beta_floor = 0`` and ``tile = 1``.

How the roofline shares out over chunks (what the lookahead microbatcher balances): ``var_cost``
stays additive, ``alpha``/``beta``/``delta`` terms only, exactly as in the other forms. What the
floor and the tile padding add, :meth:`CostModel.batch_overhead` ``= T(B) - beta * B >= 0``, is paid
once per batch, like ``gamma``:

    batch_cost(b) = gamma + batch_overhead(B(b)) + sum(var_cost(p, c) for (p, c) in b)
    chunk_cost(p, c) = batch_cost([(p, c)])   (the chunk run alone: its own gamma and floor)

so Eq. 3's ``sum(chunk_cost) - (|b| - 1) * gamma`` holds for the roofline only above the knee; below
it each chunk alone pays the whole floor and the batch pays it once.

Fits. For the paper and extended forms batch cost is linear in (alpha, beta, gamma, delta): non-
negative least squares over profiled batches, rows weighted by 1/measured so the fit minimises
*relative* error, the quantity the microbatcher balances. For the roofline, with the knee ``K`` and
``tile`` fixed, ``T(B) = beta_floor * B + (beta - beta_floor) * max(pad(B), K)`` is linear again,
so each (tile, K) is one NNLS over columns (A, B, max(pad(B), K), 1, D); a 1-D search over K
(every padded token count in the profile, refined between neighbours) for each tile in
:data:`TILES` keeps the best weighted fit. ``form="auto"`` picks the form by k-fold cross-validated
relative error on the rows it is given.

Profiles (see docs/policy.md): our JSON/JSONL format (per batch the (prefix, chunk) pairs and the
measured time) or a Vidur ``mlp.csv`` (per-layer linear-op timings on real GPUs; no attention, so
only the token terms and gamma are fitted and alpha, delta are fixed at 0).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from vllm_kunserve.policy._schema import get, need_list, need_mapping

Chunk = tuple[int, int]  # (prefix tokens, new tokens)
# Eq. 1-3 (delta fixed at 0) | Eq. 1-3 + decode KV-read term | extended + roofline token term
FORMS = ("paper", "extended", "roofline")
AUTO = "auto"  # fit(form=AUTO): the form with the least cross-validated relative error
TILES = (1, 16, 32, 64, 128)  # GEMM row tiles the roofline fit tries (1: no tile quantisation)


# ---------------------------------------------------------------------------------------------
# the model

@dataclass(frozen=True)
class CostModel:
    alpha: float  # per attention pair
    beta: float  # per token (of a compute-bound batch, in the roofline form)
    gamma: float  # per batch
    delta: float = 0.0  # per context token read by a one-token (decode) chunk; 0 = the paper's form
    unit: str = "ms"
    token_only_per_token: float | None = None  # the token-count-only baseline fitted on the same rows
    meta: dict = field(default_factory=dict, compare=False)
    floor: float = 0.0  # roofline: weight-read time per batch (paid once, like gamma); 0 = no floor
    beta_floor: float = 0.0  # roofline: per-token cost paid below the knee too (<= beta)
    tile: int = 1  # roofline: GEMM row tile the compute is padded to (1 = none)

    @property
    def form(self) -> str:
        if self.floor > 0 or self.tile > 1:
            return "roofline"
        return "extended" if self.delta > 0 else "paper"

    @property
    def knee(self) -> float:
        """Tokens where the compute time reaches the weight-read floor (0: no floor)."""
        if self.floor <= 0:
            return 0.0
        slope = self.beta - self.beta_floor
        return self.floor / slope if slope > 0 else math.inf

    def token_cost(self, tokens: float) -> float:
        """The token term ``T(B)``: ``beta * B`` in the linear forms, the roofline otherwise."""
        return self.beta * tokens + self.batch_overhead(tokens)

    def batch_overhead(self, tokens: float) -> float:
        """What a batch of ``tokens`` pays once on top of ``gamma + sum(var_cost)``: the roofline's
        ``T(B) - beta * B`` (weight-read floor top-up below the knee, tile padding; >= 0). Exactly
        0 for the paper and extended forms."""
        if self.floor <= 0 and self.tile <= 1:
            return 0.0
        pad = math.ceil(tokens / self.tile) * self.tile if self.tile > 1 else tokens
        t = self.beta_floor * tokens + max(self.floor, (self.beta - self.beta_floor) * pad)
        return max(0.0, t - self.beta * tokens)

    def var_cost(self, prefix: int, tokens: int) -> float:
        """Chunk cost without the per-batch terms (``gamma`` and :meth:`batch_overhead`): additive
        over the chunks of a batch, what microbatching balances."""
        kv = self.delta * prefix if tokens == 1 else 0.0
        return self.alpha * (prefix * tokens + (tokens * tokens + tokens) / 2) + self.beta * tokens + kv

    def chunk_cost(self, prefix: int, tokens: int) -> float:
        """The chunk run alone as a batch (its own ``gamma`` and, in the roofline form, floor)."""
        return self.var_cost(prefix, tokens) + self.gamma + self.batch_overhead(tokens)

    def batch_cost(self, chunks: Iterable[Chunk]) -> float:
        a, b, d = features3(chunks)
        return self.alpha * a + self.beta * b + self.gamma + self.delta * d + self.batch_overhead(b)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "cost_model") -> "CostModel":
        """Model files written before ``delta`` (or the roofline fields) existed load with them at
        0 (tile 1): the paper's form."""
        d = need_mapping(d, where)
        tok = d.get("token_only_per_token")
        beta = get(d, "beta", float, where, lo=0.0)
        return cls(alpha=get(d, "alpha", float, where, lo=0.0), beta=beta,
                   gamma=get(d, "gamma", float, where, lo=0.0), delta=get(d, "delta", float, where, 0.0, lo=0.0),
                   unit=get(d, "unit", str, where, "ms"),
                   token_only_per_token=None if tok is None else get(d, "token_only_per_token", float, where, lo=0.0),
                   meta=dict(get(d, "meta", dict, where, {})),
                   floor=get(d, "floor", float, where, 0.0, lo=0.0),
                   beta_floor=get(d, "beta_floor", float, where, 0.0, lo=0.0, hi=beta),
                   tile=get(d, "tile", int, where, 1, lo=1))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, str(path))


def features(chunks: Iterable[Chunk]) -> tuple[float, float]:
    """(attention pairs A, tokens B) of a batch: the paper's features."""
    a, b, _ = features3(chunks)
    return a, b


def features3(chunks: Iterable[Chunk]) -> tuple[float, float, float]:
    """(attention pairs A, tokens B, decode KV reads D) of a batch; D sums the prefix of every
    one-token chunk (a decode step, or a prefill's last token: one query reading the whole prefix)."""
    a = b = d = 0.0
    for p, c in chunks:
        a += p * c + (c * c + c) / 2
        b += c
        if c == 1:
            d += p
    return a, b, d


# ---------------------------------------------------------------------------------------------
# non-negative least squares

_SCIPY_NNLS: list = []  # [solver or None], looked up once


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0. scipy's solver when installed, else Lawson-Hanson."""
    if not _SCIPY_NNLS:
        try:  # pragma: no cover - depends on the environment
            from scipy.optimize import nnls as _sp
        except ImportError:
            _sp = None
        _SCIPY_NNLS.append(_sp)
    sp = _SCIPY_NNLS[0]
    if sp is not None:  # pragma: no cover - depends on the environment
        return sp(a, b)[0]
    return nnls_lawson_hanson(a, b, max_iter)


def nnls_lawson_hanson(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Lawson-Hanson active-set NNLS (numpy only; the problems here have 1-3 unknowns)."""
    a = np.asarray(a, float)
    b = np.asarray(b, float)
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    tol = 10 * max(m, n) * np.finfo(float).eps * np.linalg.norm(a, 1) * max(1.0, np.abs(b).max(initial=0))
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 3 * n + 10):
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            step = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


# ---------------------------------------------------------------------------------------------
# profiles

@dataclass(frozen=True)
class Profile:
    batches: tuple[tuple[Chunk, ...], ...]
    ms: np.ndarray
    attention: bool = True  # False: the timings exclude attention (Vidur mlp.csv), alpha is not fitted
    name: str = ""

    def __len__(self) -> int:
        return len(self.batches)

    def subset(self, idx: Sequence[int]) -> "Profile":
        return Profile(tuple(self.batches[i] for i in idx), self.ms[np.asarray(idx, int)], self.attention, self.name)

    def design(self) -> np.ndarray:
        """Columns (A, B, 1, D): the features of :func:`features3` and the constant."""
        f = np.array([features3(b) for b in self.batches], float).reshape(-1, 3)
        return np.column_stack([f[:, 0], f[:, 1], np.ones(len(f)), f[:, 2]])


def _row(obj: Any, where: str) -> tuple[tuple[Chunk, ...], float]:
    d = need_mapping(obj, where)
    chunks = []
    for k, ch in enumerate(need_list(get(d, "chunks", list, where), f"{where}.chunks")):
        ch = need_list(ch, f"{where}.chunks[{k}]")
        if len(ch) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ch):
            raise ValueError(f"{where}.chunks[{k}]={ch!r}: expected [prefix_tokens, new_tokens] (integers >= 0)")
        if ch[1] < 1:
            raise ValueError(f"{where}.chunks[{k}]: new_tokens must be >= 1")
        chunks.append((ch[0], ch[1]))
    if not chunks:
        raise ValueError(f"{where}.chunks: empty batch")
    ms = get(d, "ms", float, where)
    if ms <= 0:
        raise ValueError(f"{where}.ms={ms!r}: must be > 0")
    return tuple(chunks), float(ms)


def load_profile(path: str | Path, tp: int | None = None) -> Profile:
    """Read a profile: ``.csv`` = Vidur mlp.csv, otherwise our JSON object or JSON lines."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such profile file")
    if p.suffix == ".csv":
        return load_vidur_mlp(p, tp)
    text = p.read_text(encoding="utf-8")
    attention = True
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            attention = bool(doc.get("attention", True))
            rows = need_list(get(doc, "rows", list, str(p)), f"{p}.rows")
        else:
            rows = need_list(doc, str(p))
        items = [_row(r, f"{p}.rows[{k}]") for k, r in enumerate(rows)]
    except json.JSONDecodeError:
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            items.append(_row(obj, f"{p}:{n}"))
    if len(items) < 3:
        raise ValueError(f"{p}: need at least 3 profiled batches, found {len(items)}")
    return Profile(tuple(b for b, _ in items), np.array([m for _, m in items]), attention, p.stem)


# stages that run once per model, not per layer, in a Vidur mlp.csv
VIDUR_NON_LAYER_OPS = ("emb",)


def load_vidur_mlp(path: str | Path, tp: int | None = None) -> Profile:
    """Per-layer time (sum of the median of every per-layer linear stage) by ``num_tokens``, one TP degree."""
    p = Path(path)
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        cols = list(reader.fieldnames or ())
        ops = [c for c in cols if c.startswith("time_stats.") and c.endswith(".median")
               and c.split(".")[1] not in VIDUR_NON_LAYER_OPS]
        missing = sorted({"num_tokens", "num_tensor_parallel_workers"} - set(cols))
        if missing or not ops:
            what = missing[0] if missing else "time_stats.<op>.median"
            raise ValueError(f"{p}: not a Vidur mlp.csv, missing column {what}")
        rows = list(reader)
    tps = sorted({int(r["num_tensor_parallel_workers"]) for r in rows})
    tp = tps[0] if tp is None else tp
    if tp not in tps:
        raise ValueError(f"{p}: no rows for tp={tp}; available: {tps}")
    batches, ms = [], []
    for line, r in enumerate(rows, 2):
        if int(r["num_tensor_parallel_workers"]) != tp:
            continue
        try:
            t = sum(float(r[c]) for c in ops)
            n = int(r["num_tokens"])
        except ValueError as e:
            raise ValueError(f"{p}:{line}: bad number ({e})") from None
        batches.append(((0, n),))
        ms.append(t)
    name = f"{p.parent.parent.parent.name}/{p.parent.name}/tp{tp}" if p.parent.parent.parent.name else p.stem
    return Profile(tuple(batches), np.array(ms), attention=False, name=name)


# ---------------------------------------------------------------------------------------------
# fit and evaluation

def _check_form(form: str, auto: bool = False) -> None:
    ok = FORMS + ((AUTO,) if auto else ())
    if form not in ok:
        raise ValueError(f"form={form!r}: choose one of {', '.join(ok)}")


def _design(profile: Profile) -> np.ndarray:
    """The profile's (A, B, 1, D) columns, attention ones zeroed when the timings have no attention
    (Vidur mlp.csv): neither attention term is identifiable there."""
    x = profile.design()
    if not profile.attention:
        x[:, 0] = 0.0
        x[:, 3] = 0.0
    return x


def _weights(profile: Profile, weighting: str) -> np.ndarray:
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting={weighting!r}: choose relative or absolute")
    return 1.0 / profile.ms if weighting == "relative" else np.ones(len(profile))


def _padded(tokens: np.ndarray, tile: int) -> np.ndarray:
    return np.ceil(tokens / tile) * tile if tile > 1 else tokens


def _knee_candidates(padded: np.ndarray, most: int = 160) -> np.ndarray:
    """Knee positions to try: every distinct padded token count (a quantile subset when there are
    more than ``most``). A knee at or below the smallest one floors no row (no floor)."""
    u = np.unique(padded)
    if len(u) > most:
        u = np.unique(u[np.linspace(0, len(u) - 1, most).round().astype(int)])
    return u


def _roofline_at(x: np.ndarray, ms: np.ndarray, w: np.ndarray, tile: int, knee: float):
    """NNLS of the roofline with ``tile`` and ``knee`` fixed: columns (A, B, max(pad(B), K), 1, D).
    Returns (weighted squared error, coefficients)."""
    b = x[:, 1]
    cols = np.column_stack([x[:, 0], b, np.maximum(_padded(b, tile), knee), x[:, 2], x[:, 3]])
    a, y = cols * w[:, None], ms * w
    coef = np.linalg.lstsq(a, y, rcond=None)[0]  # the unconstrained optimum, when feasible, is the NNLS one
    if (coef < 0).any():
        coef = nnls(a, y)
    r = (cols @ coef - ms) * w
    return float(r @ r), coef


def _golden(f, lo: float, hi: float, iters: int = 40) -> float:
    """Minimiser of a unimodal ``f`` on [lo, hi] by golden-section search."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if b - a <= 1e-9 * max(1.0, abs(b)):
            break
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def _fit_roofline(x: np.ndarray, ms: np.ndarray, w: np.ndarray, tiles: Sequence[int]) -> dict:
    """1-D search over the knee (each distinct padded token count, then a finer grid between the
    best one's neighbours) for each tile, NNLS at each; the least weighted squared error wins."""
    best = None
    for tile in tiles:
        cand = _knee_candidates(_padded(x[:, 1], tile))
        errs = []
        for k in cand:
            err, coef = _roofline_at(x, ms, w, tile, float(k))
            errs.append(err)
            if best is None or err < best[0]:
                best = (err, tile, float(k), coef, cand)
        i = int(np.argmin(errs))
        lo, hi = float(cand[max(i - 1, 0)]), float(cand[min(i + 1, len(cand) - 1)])
        grid = np.linspace(lo, hi, 26)  # the error is smooth between data points: grid, then golden section
        gerr = [_roofline_at(x, ms, w, tile, float(k))[0] for k in grid]
        j = int(np.argmin(gerr))
        lo, hi = float(grid[max(j - 1, 0)]), float(grid[min(j + 1, len(grid) - 1)])
        for k in (float(grid[j]), _golden(lambda k: _roofline_at(x, ms, w, tile, k)[0], lo, hi)):
            err, coef = _roofline_at(x, ms, w, tile, k)
            if err < best[0]:
                best = (err, tile, k, coef, cand)
    _, tile, knee, coef, cand = best
    a, b1, b2, g, d = (float(v) for v in coef)
    beta = b1 + b2
    if knee <= cand[0]:  # floors no row: no floor (the padding, if any, still applies)
        knee = 0.0
    floor = b2 * knee
    if b2 <= 0:  # no roofline part at all: the linear form
        tile = 1
    if floor <= 0 and tile == 1:  # T(B) = beta * B: the linear form, beta_floor has no meaning
        floor, b1 = 0.0, 0.0
    return {"alpha": a, "beta": beta, "gamma": g, "delta": d, "floor": floor, "beta_floor": min(b1, beta),
            "tile": int(tile)}


def fit(profile: Profile, weighting: str = "relative", form: str = "paper", tiles: Sequence[int] = TILES,
        folds: int = 5, seed: int = 0) -> CostModel:
    """Fit one form, plus the token-only baseline. ``paper``: NNLS of (alpha, beta, gamma), delta
    fixed at 0, exactly Eq. 1-3; ``extended``: with ``delta``; ``roofline``: extended with the
    roofline token term (knee and tile searched, see the module doc); ``auto``: the form with the
    least ``folds``-fold cross-validated mean relative error on these rows (:func:`select_form`),
    refitted on all of them."""
    w = _weights(profile, weighting)
    _check_form(form, auto=True)
    if form == AUTO:
        chosen, cv = select_form(profile, weighting, folds, seed, tiles)
        m = fit(profile, weighting, chosen, tiles)
        return replace(m, meta=dict(m.meta, selected_by=f"{folds}-fold cross-validation", cv_mean_rel_err=cv))
    x = _design(profile)
    if form == "roofline":
        params = _fit_roofline(x, profile.ms, w, tuple(tiles) or (1,))
    else:
        xf = x.copy()
        if form == "paper":
            xf[:, 3] = 0.0
        c = nnls(xf * w[:, None], profile.ms * w)
        params = {"alpha": float(c[0]), "beta": float(c[1]), "gamma": float(c[2]), "delta": float(c[3])}
    tok = x[:, 1] * w
    k = float(tok @ (profile.ms * w) / (tok @ tok)) if tok @ tok > 0 else 0.0
    return CostModel(**params, token_only_per_token=k,
                     meta={"profile": profile.name, "rows": len(profile), "weighting": weighting, "form": form,
                           "attention_fitted": profile.attention})


def select_form(profile: Profile, weighting: str = "relative", folds: int = 5, seed: int = 0,
                tiles: Sequence[int] = TILES) -> tuple[str, dict[str, float]]:
    """The form with the least ``folds``-fold cross-validated mean relative error on ``profile``
    (ties go to the simpler form) and every form's error. Fewer than 4 rows: ``paper``."""
    n = len(profile)
    k = min(folds, n // 2)
    if k < 2:
        return "paper", {}
    idx = np.random.default_rng(seed).permutation(n)
    parts = np.array_split(idx, k)
    rel = {f: np.zeros(n) for f in FORMS}
    for j, test in enumerate(parts):
        train = np.sort(np.concatenate([p for i, p in enumerate(parts) if i != j]))
        ptrain, ptest = profile.subset(train), profile.subset(np.sort(test))
        for f in FORMS:
            m = fit(ptrain, weighting, f, tiles)
            rel[f][np.sort(test)] = np.abs(predict(m, ptest) - ptest.ms) / ptest.ms
    cv = {f: float(r.mean()) for f, r in rel.items()}
    best = min(FORMS, key=lambda f: (round(cv[f], 12), FORMS.index(f)))
    return best, cv


def _coef(m: CostModel) -> np.ndarray:
    return np.array([m.alpha, m.beta, m.gamma, m.delta])


def _predict_design(x: np.ndarray, m: CostModel) -> np.ndarray:
    out = x @ _coef(m)
    if m.floor > 0 or m.tile > 1:  # the roofline's per-batch overhead (see CostModel.batch_overhead)
        b = x[:, 1]
        t = m.beta_floor * b + np.maximum(m.floor, (m.beta - m.beta_floor) * _padded(b, m.tile))
        out = out + np.maximum(0.0, t - m.beta * b)
    return out


def predict(model: CostModel, profile: Profile) -> np.ndarray:
    return _predict_design(profile.design(), model)


def _errors(pred: np.ndarray, ms: np.ndarray) -> dict:
    rel = np.abs(pred - ms) / ms
    return {"mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max())}


def _form_params(m: CostModel) -> dict:
    return {"alpha": m.alpha, "beta": m.beta, "gamma": m.gamma, "delta": m.delta, "floor": m.floor,
            "beta_floor": m.beta_floor, "tile": m.tile}


def _stored_forms(model: CostModel) -> dict[str, CostModel]:
    """Every form fitted alongside ``model`` (``meta.forms``, written by :func:`fit_with_holdout`);
    an older model file has none (and its forms no roofline fields)."""
    out = {}
    forms = model.meta.get("forms")
    if isinstance(forms, dict):
        for name, c in forms.items():
            if isinstance(c, dict) and all(isinstance(c.get(k), (int, float)) for k in ("alpha", "beta", "gamma")):
                out[str(name)] = CostModel(float(c["alpha"]), float(c["beta"]), float(c["gamma"]),
                                           float(c.get("delta", 0.0)), unit=model.unit,
                                           floor=float(c.get("floor", 0.0)),
                                           beta_floor=float(c.get("beta_floor", 0.0)),
                                           tile=int(c.get("tile", 1)))
    return out


def evaluate(model: CostModel, profile: Profile) -> dict:
    """Mean/max relative error on ``profile`` of the model, of every form fitted with it (paper
    Eq. 1-3, extended and roofline, side by side, when the model file records them) and of the
    token-count-only baseline."""
    x = profile.design()
    tokens = x[:, 1]
    k = model.token_only_per_token
    source = "model_file"
    if k is None:
        k = float(tokens @ profile.ms / (tokens @ tokens))
        source = "fitted_on_these_rows"
    out = {"rows": len(profile), "profile": profile.name, "form": model.form,
           "model": _errors(_predict_design(x, model), profile.ms)}
    forms = _stored_forms(model)
    if forms:
        out["forms"] = {name: _errors(_predict_design(x, m), profile.ms) for name, m in forms.items()}
    out["token_only"] = {**_errors(k * tokens, profile.ms), "per_token": k, "fitted": source}
    return out


def split_holdout(n: int, holdout: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    if not 0 < holdout < 1:
        raise ValueError(f"holdout={holdout}: must be in (0, 1)")
    idx = np.random.default_rng(seed).permutation(n)
    k = max(1, int(round(n * holdout)))
    return np.sort(idx[k:]), np.sort(idx[:k])


def fit_with_holdout(profile: Profile, holdout: float = 0.2, seed: int = 0,
                     weighting: str = "relative", form: str = AUTO,
                     test: Profile | None = None) -> tuple[CostModel, dict]:
    """Fit every form on a random (1 - holdout) share and report errors on both parts.

    ``test``: score on these rows instead (a separately measured profile) and fit on all of
    ``profile``. ``form="auto"`` (the default) picks the form by cross-validation on the training
    rows only (:func:`select_form`), so the held-out rows stay unseen.

    Returns the model of the chosen form (its ``meta.forms`` records the parameters and held-out
    error of every form, so ``evaluate`` can compare them later) and the report: ``train``/
    ``heldout`` evaluations of that model (each with ``forms`` side by side), ``forms``
    (parameters and errors per form) and, for ``auto``, ``cv_mean_rel_err`` per form."""
    _check_form(form, auto=True)
    if test is None:
        train, held = split_holdout(len(profile), holdout, seed)
        ptrain, ptest = profile.subset(train), profile.subset(held)
    else:
        ptrain, ptest = profile, test
    fitted = {f: fit(ptrain, weighting, f) for f in FORMS}
    cv = None
    chosen_form = form
    if form == AUTO:
        chosen_form, cv = select_form(ptrain, weighting, seed=seed)
    forms = {}
    for f, m in fitted.items():
        forms[f] = {**_form_params(m), "train": _errors(predict(m, ptrain), ptrain.ms),
                    "heldout": _errors(predict(m, ptest), ptest.ms)}
    chosen = fitted[chosen_form]
    stored = {f: {**{k: d[k] for k in _form_params(fitted[f])},
                  "heldout_mean_rel_err": d["heldout"]["mean_rel_err"]} for f, d in forms.items()}
    meta = dict(chosen.meta, heldout_mean_rel_err=forms[chosen_form]["heldout"]["mean_rel_err"], forms=stored)
    if cv is not None:
        meta.update(selected_by="5-fold cross-validation on the training rows", cv_mean_rel_err=cv)
    model = replace(chosen, meta=meta)
    report = {"form": chosen_form, "requested_form": form, "train": evaluate(model, ptrain),
              "heldout": evaluate(model, ptest), "forms": forms,
              "holdout": holdout if test is None else None, "seed": seed,
              "scored_on": f"held-out {holdout:.0%} of the rows" if test is None else f"separate profile {test.name}"}
    if cv is not None:
        report["cv_mean_rel_err"] = cv
    return model, report


def default_model() -> CostModel:
    """Stand-in until a profile is fitted: ms per decoder layer, Llama-2-7B-like on an H100.

    beta and gamma: the NNLS fit of Vidur's H100 Llama-2-7B TP1 mlp.csv; alpha: attention FLOPs per
    (query, key) pair per layer (4 x d_model = 16,384) at about 300 TFLOP/s.
    """
    return CostModel(alpha=5.5e-8, beta=5.87e-4, gamma=0.146, meta={"source": "default"})


def isfinite_model(m: CostModel) -> bool:
    return all(math.isfinite(v) and v >= 0 for v in (m.alpha, m.beta, m.gamma, m.delta, m.floor, m.beta_floor))
