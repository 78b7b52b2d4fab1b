"""Model architecture figures from a HuggingFace config: :class:`ModelArch`.

The shape of the model a workload runs on, as numbers: parameter bytes (whole model and per decoder
layer), KV bytes per token, and linear FLOPs per token. The simulator sizes memory and step times
with them, ``tools.make_model`` sizes the checkpoints it builds. Built-in configs cover the models
the project benchmarks; any decoder-only HF ``config.json`` with the usual Llama/Qwen keys also
works. The policies see the model through its memory shape only (``policy.snapshot.ModelSpec``,
built by ``sim.adapters.policy_model``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "float16": 2, "half": 2,
               "bf16": 2, "fp16": 2, "float8": 1, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer's shape (what a HF ``config.json`` says)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    head_dim: int = 0  # 0: hidden // heads
    tie_embeddings: bool = False
    qkv_bias: bool = False
    gated_mlp: bool = True

    def __post_init__(self) -> None:
        for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "dtype_bytes"):
            if getattr(self, k) <= 0:
                raise ValueError(f"model {self.name}: {k}={getattr(self, k)} must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads={self.heads} not a multiple of kv_heads={self.kv_heads}")
        if not self.head_dim:
            if self.hidden % self.heads:
                raise ValueError(f"model {self.name}: hidden={self.hidden} not divisible by heads={self.heads}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    # ---- parameters -------------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate
        return attn + mlp + 2 * h  # two RMSNorm weights

    @property
    def params(self) -> int:
        emb = self.vocab * self.hidden
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.layers * self.layer_params + emb + head + self.hidden

    @property
    def layer_bytes(self) -> int:
        return self.layer_params * self.dtype_bytes

    @property
    def param_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def nonlayer_bytes(self) -> int:
        return self.param_bytes - self.layers * self.layer_bytes

    # ---- KV -----------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_bytes_per_token_layer

    # ---- compute -----------------------------------------------------------------------------
    @property
    def linear_flops_per_token_layer(self) -> int:
        """2 FLOPs per multiply-add over the layer's matrices (attention projections and MLP)."""
        return 2 * (self.layer_params - 2 * self.hidden)

    def attn_flops_per_layer(self, prefix: int, chunk: int) -> float:
        """QK^T and PV FLOPs of one chunk attending to its prefix and causally to itself."""
        pairs = prefix * chunk + (chunk * chunk + chunk) / 2
        return 4.0 * self.heads * self.head_dim * pairs

    def activation_bytes_per_token(self) -> int:
        """Hidden state passed between pipeline stages, per token."""
        return self.hidden * self.dtype_bytes

    def summary(self) -> dict:
        return {"name": self.name, "params": self.params, "param_bytes": self.param_bytes,
                "layer_bytes": self.layer_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
                "layers": self.layers, "dtype_bytes": self.dtype_bytes}


BUILTIN: dict[str, ModelArch] = {
    # Qwen/Qwen2.5-14B-Instruct config.json
    "qwen2.5-14b": ModelArch("qwen2.5-14b", hidden=5120, layers=48, heads=40, kv_heads=8,
                             intermediate=13824, vocab=152064, dtype_bytes=2, qkv_bias=True),
    # meta-llama/Llama-2-7b-hf, Llama-2-70b-hf config.json
    "llama2-7b": ModelArch("llama2-7b", hidden=4096, layers=32, heads=32, kv_heads=32,
                           intermediate=11008, vocab=32000, dtype_bytes=2),
    "llama2-70b": ModelArch("llama2-70b", hidden=8192, layers=80, heads=64, kv_heads=8,
                            intermediate=28672, vocab=32000, dtype_bytes=2),
    # the project's tiny random-weight model (kunserve make-model)
    "small": ModelArch("small", hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1024,
                       vocab=4096, dtype_bytes=4),
}


def spec_from_hf_config(cfg: dict, name: str = "custom", dtype: str | None = None) -> ModelArch:
    """Build a :class:`ModelArch` from a parsed HF ``config.json``; raises ValueError naming a missing key."""
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"HF config {name}: missing key(s) {', '.join(missing)}")
    dt = dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if str(dt) not in DTYPE_BYTES:
        raise ValueError(f"HF config {name}: dtype {dt!r} unknown; one of {', '.join(DTYPE_BYTES)}")
    mt = str(cfg.get("model_type", ""))
    return ModelArch(
        name=name, hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
        heads=int(cfg["num_attention_heads"]),
        kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
        dtype_bytes=DTYPE_BYTES[str(dt)], head_dim=int(cfg.get("head_dim") or 0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", mt == "qwen2")),
        gated_mlp=cfg.get("hidden_act", "silu") in ("silu", "swiglu", "gelu_pytorch_tanh") and mt != "gpt2",
    )


def load_model_spec(name_or_path: str, dtype: str | None = None) -> ModelArch:
    """A built-in name (``qwen2.5-14b``, ``llama2-7b``, ``llama2-70b``, ``small``), a HF model
    directory or a ``config.json`` path."""
    key = name_or_path.lower()
    if key in BUILTIN:
        spec = BUILTIN[key]
        if dtype:
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"dtype {dtype!r} unknown; one of {', '.join(DTYPE_BYTES)}")
            spec = ModelArch(**{**spec.__dict__, "dtype_bytes": DTYPE_BYTES[dtype]})
        return spec
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"model {name_or_path!r}: not a built-in ({', '.join(BUILTIN)}) nor a HF config file/dir")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"HF config {path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"HF config {path}: expected a JSON object")
    return spec_from_hf_config(cfg, name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path,
                               dtype=dtype)
