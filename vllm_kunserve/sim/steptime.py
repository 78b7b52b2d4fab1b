"""Step-time models: how long one engine iteration takes for a batch of ``(prefix, chunk)`` pairs.

* :class:`EqStepTime` is the paper's Eq. 1-2 (``alpha*(p*c + (c^2+c)/2) + beta*c + gamma`` per
  chunk, one shared ``gamma`` per batch, plus ``delta*p`` per decode chunk when the cost model was
  fitted in its extended form), i.e. the cost model of ``policy/costmodel.py`` in seconds. Used for
  the CPU replay (coefficients fitted to a measured vLLM-CPU profile).
* :class:`GpuStepTime` is the GPU "ground truth" of the simulator: token-linear and fixed parts of
  every decoder layer fitted to Vidur's measured H100/A100 linear-op times (``mlp.csv``, Microsoft
  Vidur, MIT license), scaled to the target model by FLOPs (token-linear part) and weight bytes
  (fixed part) when Vidur has no profile for it, plus an attention term per chunk: the larger of
  its FLOPs at an achievable share of peak and its KV reads at an achievable share of HBM
  bandwidth (decode attention is bandwidth-bound, which one ``alpha`` cannot express).
* :class:`MeasuredStepTime` replays a measured table instead of fitting one: the decode step of a
  batch of ``n`` requests interpolated linearly in a measured ``batch -> step`` table
  (``benchmarks/batch_scaling.py``, or a line fitted to a run's own steps with
  :func:`fit_decode_line`), plus the step's prefill tokens at a measured prefill rate.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from vllm_kunserve.workload.models import ModelArch

from .hardware import GpuSpec, data_dir

Pair = tuple[int, int]  # (prefix tokens already in KV, chunk tokens computed now)

VIDUR_LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
                   "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
VIDUR_MODELS = {  # our name -> folder under profiles/vidur/<gpu>/
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf",
}


class StepTime:
    def batch_time(self, pairs: Sequence[Pair]) -> float:  # seconds
        raise NotImplementedError

    def chunk_time(self, prefix: int, chunk: int) -> float:
        return self.batch_time([(prefix, chunk)])

    def describe(self) -> dict:
        return {"kind": type(self).__name__}


@dataclass
class EqStepTime(StepTime):
    """Eq. 1-2 with coefficients in seconds (alpha per attention pair, beta per token, gamma fixed),
    plus the cost model's optional decode KV-read term (delta per context token of a 1-token chunk)."""

    alpha: float
    beta: float
    gamma: float
    delta: float = 0.0
    scale: float = 1.0  # multiplier (e.g. a stage holding 1/k of the layers)

    def batch_time(self, pairs: Sequence[Pair]) -> float:
        if not pairs:
            return 0.0
        att = tok = kv = 0
        for p, c in pairs:
            att += p * c + (c * c + c) // 2
            tok += c
            if c == 1:
                kv += p
        return self.scale * (self.alpha * att + self.beta * tok + self.gamma + self.delta * kv)

    def describe(self) -> dict:
        return {"kind": "eq", "alpha_s": self.alpha, "beta_s": self.beta, "gamma_s": self.gamma,
                "delta_s": self.delta}


class MeasuredStepTime(StepTime):
    """A measured decode table plus a prefill rate, for replaying a run on the machine that measured them.

    A step's decode chunks (1 token each) cost the table's step time at their count, linear between
    measured batch sizes, the first row's time below the first batch, and the last segment's slope
    beyond the last batch. Its prefill tokens (chunks of more than one token) add
    ``tokens / prefill_tps``; a step with no decode also pays ``prefill_fixed_s``, the per-step cost a
    decode step already carries (e.g. a fitted line's intercept), so that a prefill alone costs
    ``prefill_fixed_s + tokens / prefill_tps`` and a prefill riding a decode step pays the fixed cost
    once. The table is used as measured (not smoothed); attention's dependence on context length is
    not modelled (the table was measured at one short context)."""

    def __init__(self, rows: Iterable[tuple[float, float]], prefill_tps: float, prefill_fixed_s: float = 0.0):
        pts = sorted((float(b), float(s)) for b, s in rows)
        if not pts or any(b <= 0 or s <= 0 for b, s in pts) or len({b for b, _ in pts}) != len(pts):
            raise ValueError(f"decode table {pts}: need distinct positive batch sizes with positive step times")
        if not prefill_tps > 0:
            raise ValueError(f"prefill_tps={prefill_tps}: must be positive")
        if prefill_fixed_s < 0:
            raise ValueError(f"prefill_fixed_s={prefill_fixed_s}: must be >= 0")
        self.points = pts
        self.prefill_tps = float(prefill_tps)
        self.prefill_fixed_s = float(prefill_fixed_s)

    @classmethod
    def from_table(cls, rows: Iterable[dict], prefill_tps: float) -> "MeasuredStepTime":
        """From ``batch_scaling.json``'s rows (``{"batch": n, "step_ms": ms}``)."""
        return cls(((r["batch"], r["step_ms"] * 1e-3) for r in rows), prefill_tps)

    @classmethod
    def linear(cls, intercept_s: float, slope_s: float, prefill_tps: float) -> "MeasuredStepTime":
        """A decode step of ``intercept_s + slope_s * n`` for ``n >= 1`` requests (e.g. from
        :func:`fit_decode_line`): the table of two rows, batch 1 and 2, extrapolated with their slope;
        the intercept is the fixed cost a step of prefill alone pays too."""
        if slope_s < 0 or intercept_s < 0 or intercept_s + slope_s <= 0:
            raise ValueError(f"step = {intercept_s} + {slope_s} * n: need intercept, slope >= 0 and a "
                             "positive step at n=1")
        return cls([(1.0, intercept_s + slope_s), (2.0, intercept_s + 2 * slope_s)], prefill_tps, intercept_s)

    def decode_time(self, n: float) -> float:
        """Seconds of a decode step for ``n`` requests (0 for none)."""
        if n <= 0:
            return 0.0
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]
        if len(pts) == 1:  # one row: proportional to the batch beyond it
            return pts[0][1] * n / pts[0][0]
        for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
            if n <= b1:
                return s0 + (s1 - s0) * (n - b0) / (b1 - b0)
        (b0, s0), (b1, s1) = pts[-2], pts[-1]
        return s1 + (s1 - s0) * (n - b1) / (b1 - b0)

    def batch_time(self, pairs: Sequence[Pair]) -> float:
        if not pairs:
            return 0.0
        decodes = sum(1 for _, c in pairs if c == 1)
        prefill = sum(c for _, c in pairs if c > 1)
        fixed = self.prefill_fixed_s if decodes == 0 else 0.0
        return self.decode_time(decodes) + fixed + prefill / self.prefill_tps

    def describe(self) -> dict:
        return {"kind": "measured", "decode_step_s": [list(p) for p in self.points],
                "prefill_tps": self.prefill_tps, "prefill_fixed_s": self.prefill_fixed_s}


def fit_decode_line(samples: Iterable[tuple[float, float, float]]) -> tuple[float, float]:
    """Weighted least squares ``step = a + c * batch`` over ``(batch, step_s, weight)`` samples (e.g.
    one per batch size seen in a run: its mean step and the seconds it was seen). Kept physical: a
    negative slope becomes a constant step (the weighted mean), a negative intercept a line through
    the origin. Returns ``(a, c)`` in seconds and seconds per request."""
    pts = [(float(b), float(s), float(w)) for b, s, w in samples if w > 0]
    if not pts:
        raise ValueError("fit_decode_line: no sample with positive weight")
    sw = sum(w for _, _, w in pts)
    mb = sum(w * b for b, _, w in pts) / sw
    ms = sum(w * s for _, s, w in pts) / sw
    sxx = sum(w * (b - mb) ** 2 for b, _, w in pts)
    c = sum(w * (b - mb) * (s - ms) for b, s, w in pts) / sxx if sxx > 0 else 0.0
    if c <= 0:
        return ms, 0.0
    a = ms - c * mb
    if a < 0:
        return 0.0, sum(w * b * s for b, s, w in pts) / sum(w * b * b for b, _, w in pts)
    return a, c


def _vidur_layer_fit(path: str, tp: int = 1) -> tuple[float, float, dict]:
    """Least-squares ``ms = beta*tokens + gamma`` of one layer's linear ops (medians) at tensor
    parallel degree ``tp``. Returns (beta_s, gamma_s, model dims of the profile)."""
    xs, ys, dims = [], [], {}
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            try:
                if int(row["num_tensor_parallel_workers"]) != tp:
                    continue
                xs.append(float(row["num_tokens"]))
                ys.append(sum(float(row[f"time_stats.{op}.median"]) for op in VIDUR_LAYER_OPS
                              if row.get(f"time_stats.{op}.median")) * 1e-3)
                dims = {"n_embd": int(row["n_embd"]), "n_expanded_embd": int(row["n_expanded_embd"]),
                        "n_head": int(row["n_head"]), "n_kv_head": int(row["n_kv_head"])}
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}:{i}: bad Vidur mlp row ({e})") from None
    if len(xs) < 2:
        raise ValueError(f"{path}: fewer than 2 rows with num_tensor_parallel_workers={tp}")
    a = np.vstack([np.asarray(xs), np.ones(len(xs))]).T
    (beta, gamma), *_ = np.linalg.lstsq(a, np.asarray(ys), rcond=None)
    return max(float(beta), 0.0), max(float(gamma), 0.0), dims


def _ref_linear_flops(d: dict) -> float:
    h, e, nh, nkv = d["n_embd"], d["n_expanded_embd"], d["n_head"], d["n_kv_head"]
    hd = h // nh
    return 2.0 * (2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * e)


class GpuStepTime(StepTime):
    def __init__(self, model: ModelArch, gpu: GpuSpec, vidur_root: str | None = None):
        self.model, self.gpu = model, gpu
        root = vidur_root or os.path.join(data_dir(), "profiles", "vidur")
        self.source = "analytic"
        ref = VIDUR_MODELS.get(model.name, "meta-llama/Llama-2-7b-hf")
        path = os.path.join(root, gpu.vidur_name or gpu.name, ref, "mlp.csv")
        if os.path.isfile(path):
            beta, gamma, dims = _vidur_layer_fit(path)
            flops_ratio = model.linear_flops_per_token_layer / _ref_linear_flops(dims)
            # the fixed part of small batches is weight-read bound, and weight bytes scale with
            # the same ratio as FLOPs for a 16-bit model
            self.beta_layer = beta * flops_ratio
            self.gamma_layer = gamma * flops_ratio
            self.source = f"vidur:{os.path.relpath(path, root)} x{flops_ratio:.3f}"
        else:  # roofline fallback
            self.beta_layer = model.linear_flops_per_token_layer / (gpu.flops * gpu.flops_eff)
            self.gamma_layer = model.layer_bytes / (gpu.hbm_bw * gpu.hbm_eff)
        self.att_flop_s = 1.0 / (gpu.flops * gpu.flops_eff)
        self.att_byte_s = 1.0 / (gpu.hbm_bw * gpu.hbm_eff)
        self.kv_layer = model.kv_bytes_per_token_layer
        self.att_coef = 4.0 * model.heads * model.head_dim
        # embedding + LM head: weights read once, logits FLOPs per sampled sequence
        self.fixed = model.nonlayer_bytes / 2 / (gpu.hbm_bw * gpu.hbm_eff) + 20e-6
        self.per_seq = 2.0 * model.hidden * model.vocab / (gpu.flops * gpu.flops_eff)
        self.layer_scale = 1.0

    def batch_time(self, pairs: Sequence[Pair]) -> float:
        if not pairs:
            return 0.0
        tok = 0
        att = 0.0
        cf, kb, fs, bs = self.att_coef, self.kv_layer, self.att_flop_s, self.att_byte_s
        for p, c in pairs:
            tok += c
            fl = cf * (p * c + (c * c + c) * 0.5) * fs
            mem = (p + c) * kb * bs
            att += fl if fl > mem else mem
        per_layer = self.beta_layer * tok + self.gamma_layer + att
        return self.model.layers * per_layer + self.fixed + self.per_seq * len(pairs)

    def describe(self) -> dict:
        return {"kind": "gpu", "source": self.source, "beta_layer_s": self.beta_layer,
                "gamma_layer_s": self.gamma_layer, "fixed_s": self.fixed}


def time_of(st: StepTime, pairs: Iterable[Pair]) -> float:
    return st.batch_time(list(pairs))
