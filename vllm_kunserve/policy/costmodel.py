"""Batch cost model (KunServe Eq. 1-3, plus an optional decode KV-read term) and its NNLS fit.

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
Eq. 1-3; the ``extended`` form fits ``delta >= 0`` too. Batch cost is linear in (A, B, 1, D), so the
coefficients come from non-negative least squares over profiled batches; by default rows are
weighted by 1/measured so the fit minimises *relative* error, the quantity the microbatcher balances.

Profiles (see docs/policy.md): our JSON/JSONL format (per batch the (prefix, chunk) pairs and the
measured time) or a Vidur ``mlp.csv`` (per-layer linear-op timings on real GPUs; no attention, so
only beta and gamma are fitted and alpha is fixed at 0).
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
FORMS = ("paper", "extended")  # Eq. 1-3 (delta fixed at 0) | Eq. 1-3 + decode KV-read term


# ---------------------------------------------------------------------------------------------
# the model

@dataclass(frozen=True)
class CostModel:
    alpha: float  # per attention pair
    beta: float  # per token
    gamma: float  # per batch
    delta: float = 0.0  # per context token read by a one-token (decode) chunk; 0 = the paper's form
    unit: str = "ms"
    token_only_per_token: float | None = None  # the token-count-only baseline fitted on the same rows
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def form(self) -> str:
        return "extended" if self.delta > 0 else "paper"

    def var_cost(self, prefix: int, tokens: int) -> float:
        """Chunk cost without the per-batch ``gamma`` (what microbatching balances)."""
        kv = self.delta * prefix if tokens == 1 else 0.0
        return self.alpha * (prefix * tokens + (tokens * tokens + tokens) / 2) + self.beta * tokens + kv

    def chunk_cost(self, prefix: int, tokens: int) -> float:
        return self.var_cost(prefix, tokens) + self.gamma

    def batch_cost(self, chunks: Iterable[Chunk]) -> float:
        a, b, d = features3(chunks)
        return self.alpha * a + self.beta * b + self.gamma + self.delta * d

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "cost_model") -> "CostModel":
        """Model files written before ``delta`` existed load with ``delta = 0`` (the paper's form)."""
        d = need_mapping(d, where)
        tok = d.get("token_only_per_token")
        return cls(alpha=get(d, "alpha", float, where, lo=0.0), beta=get(d, "beta", float, where, lo=0.0),
                   gamma=get(d, "gamma", float, where, lo=0.0), delta=get(d, "delta", float, where, 0.0, lo=0.0),
                   unit=get(d, "unit", str, where, "ms"),
                   token_only_per_token=None if tok is None else get(d, "token_only_per_token", float, where, lo=0.0),
                   meta=dict(get(d, "meta", dict, where, {})))

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

def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0. scipy's solver when installed, else Lawson-Hanson."""
    try:  # pragma: no cover - depends on the environment
        from scipy.optimize import nnls as _sp

        return _sp(a, b)[0]
    except ImportError:
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

def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"form={form!r}: choose one of {', '.join(FORMS)}")


def fit(profile: Profile, weighting: str = "relative", form: str = "paper") -> CostModel:
    """Non-negative least-squares fit of (alpha, beta, gamma), plus ``delta`` for the ``extended``
    form (``paper``: delta fixed at 0, exactly Eq. 1-3), and of the token-only baseline."""
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting={weighting!r}: choose relative or absolute")
    _check_form(form)
    x = profile.design().copy()
    if not profile.attention:  # no attention in the timings: neither attention term is identifiable
        x[:, 0] = 0.0
        x[:, 3] = 0.0
    if form == "paper":
        x[:, 3] = 0.0
    w = 1.0 / profile.ms if weighting == "relative" else np.ones(len(profile))
    coef = nnls(x * w[:, None], profile.ms * w)
    tok = x[:, 1] * w
    k = float(tok @ (profile.ms * w) / (tok @ tok)) if tok @ tok > 0 else 0.0
    return CostModel(float(coef[0]), float(coef[1]), float(coef[2]), delta=float(coef[3]), token_only_per_token=k,
                     meta={"profile": profile.name, "rows": len(profile), "weighting": weighting, "form": form,
                           "attention_fitted": profile.attention})


def _coef(m: CostModel) -> np.ndarray:
    return np.array([m.alpha, m.beta, m.gamma, m.delta])


def predict(model: CostModel, profile: Profile) -> np.ndarray:
    return profile.design() @ _coef(model)


def _errors(pred: np.ndarray, ms: np.ndarray) -> dict:
    rel = np.abs(pred - ms) / ms
    return {"mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max())}


def _stored_forms(model: CostModel) -> dict[str, np.ndarray]:
    """Coefficients of every form fitted alongside ``model`` (``meta.forms``, written by
    :func:`fit_with_holdout`); an older model file has none."""
    out = {}
    forms = model.meta.get("forms")
    if isinstance(forms, dict):
        for name, c in forms.items():
            if isinstance(c, dict) and all(isinstance(c.get(k), (int, float)) for k in ("alpha", "beta", "gamma")):
                out[str(name)] = np.array([c["alpha"], c["beta"], c["gamma"], c.get("delta", 0.0)], float)
    return out


def evaluate(model: CostModel, profile: Profile) -> dict:
    """Mean/max relative error on ``profile`` of the model, of every form fitted with it (paper
    Eq. 1-3 and the extended form, side by side, when the model file records them) and of the
    token-count-only baseline."""
    x = profile.design()
    tokens = x[:, 1]
    k = model.token_only_per_token
    source = "model_file"
    if k is None:
        k = float(tokens @ profile.ms / (tokens @ tokens))
        source = "fitted_on_these_rows"
    out = {"rows": len(profile), "profile": profile.name, "form": model.form,
           "model": _errors(predict(model, profile), profile.ms)}
    forms = _stored_forms(model)
    if forms:
        out["forms"] = {name: _errors(x @ c, profile.ms) for name, c in forms.items()}
    out["token_only"] = {**_errors(k * tokens, profile.ms), "per_token": k, "fitted": source}
    return out


def split_holdout(n: int, holdout: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    if not 0 < holdout < 1:
        raise ValueError(f"holdout={holdout}: must be in (0, 1)")
    idx = np.random.default_rng(seed).permutation(n)
    k = max(1, int(round(n * holdout)))
    return np.sort(idx[k:]), np.sort(idx[:k])


def fit_with_holdout(profile: Profile, holdout: float = 0.2, seed: int = 0,
                     weighting: str = "relative", form: str = "paper") -> tuple[CostModel, dict]:
    """Fit every form on a random (1 - holdout) share and report errors on both parts.

    Returns the model of ``form`` (its ``meta.forms`` records the coefficients and held-out error
    of every form, so ``evaluate`` can compare them later) and the report: ``train``/``heldout``
    evaluations of that model (each with ``forms`` side by side) and ``forms`` (coefficients and
    errors per form)."""
    _check_form(form)
    train, test = split_holdout(len(profile), holdout, seed)
    ptrain, ptest = profile.subset(train), profile.subset(test)
    fitted = {f: fit(ptrain, weighting, f) for f in FORMS}
    forms = {}
    for f, m in fitted.items():
        forms[f] = {"alpha": m.alpha, "beta": m.beta, "gamma": m.gamma, "delta": m.delta,
                    "train": _errors(predict(m, ptrain), ptrain.ms),
                    "heldout": _errors(predict(m, ptest), ptest.ms)}
    chosen = fitted[form]
    stored = {f: {"alpha": d["alpha"], "beta": d["beta"], "gamma": d["gamma"], "delta": d["delta"],
                  "heldout_mean_rel_err": d["heldout"]["mean_rel_err"]} for f, d in forms.items()}
    meta = dict(chosen.meta, heldout_mean_rel_err=forms[form]["heldout"]["mean_rel_err"], forms=stored)
    model = replace(chosen, meta=meta)
    report = {"form": form, "train": evaluate(model, ptrain), "heldout": evaluate(model, ptest),
              "forms": forms, "holdout": holdout, "seed": seed}
    return model, report


def default_model() -> CostModel:
    """Stand-in until a profile is fitted: ms per decoder layer, Llama-2-7B-like on an H100.

    beta and gamma: the NNLS fit of Vidur's H100 Llama-2-7B TP1 mlp.csv; alpha: attention FLOPs per
    (query, key) pair per layer (4 x d_model = 16,384) at about 300 TFLOP/s.
    """
    return CostModel(alpha=5.5e-8, beta=5.87e-4, gamma=0.146, meta={"source": "default"})


def isfinite_model(m: CostModel) -> bool:
    return all(math.isfinite(v) and v >= 0 for v in (m.alpha, m.beta, m.gamma, m.delta))
