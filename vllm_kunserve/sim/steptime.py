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
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .hardware import GpuSpec, data_dir
from .models import ModelArch

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
