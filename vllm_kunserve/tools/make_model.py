"""Build a Llama-architecture model with random weights and a BPE tokenizer, fully offline.

Used for tests, demos and CPU benchmarks where no model can be downloaded. The presets are sized
so that weights vs KV cache match a real deployment in the memory experiments:

- ``tiny``: 2 layers, hidden 64, head_dim 32 (~1 MB of fp32 weights), for functional tests;
- ``small``: 8 layers, hidden 512, 8 heads of 64 with 2 KV heads (GQA, like Llama-3/Qwen-2.5),
  ~88 MB of fp32 weights and 8 KiB of KV per token, so a KV budget of ~1.6x the weights holds
  ~17k tokens: weights are ~38% of the memory budget, like a 14B model on an 80 GB GPU.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from vllm_kunserve.workload.models import DTYPE_BYTES, ModelArch


@dataclass(frozen=True)
class CheckpointSpec:
    """A random-weight Llama checkpoint to build (its shape, dtype, context and seed)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_position: int = 4096
    dtype: str = "float32"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
        if self.head_dim not in (32, 64, 128):
            raise ValueError(
                f"head_dim = hidden/heads = {self.head_dim}; vLLM's CPU attention needs 32 or 64 (or 128)")
        if self.vocab < 300:
            raise ValueError(f"--vocab {self.vocab} too small for a byte-level BPE tokenizer (>= 300)")

    def arch(self) -> ModelArch:
        """This checkpoint's architecture figures (the simulator's too; untied embeddings, no bias)."""
        return ModelArch("checkpoint", hidden=self.hidden, layers=self.layers, heads=self.heads,
                         kv_heads=self.kv_heads, intermediate=self.intermediate, vocab=self.vocab,
                         dtype_bytes=DTYPE_BYTES[self.dtype])

    def weight_bytes(self) -> int:
        """Parameter bytes (embeddings and LM head untied)."""
        return self.arch().param_bytes

    def kv_bytes_per_token(self) -> int:
        return self.arch().kv_bytes_per_token


PRESETS: dict[str, CheckpointSpec] = {
    "tiny": CheckpointSpec(layers=2, hidden=64, heads=2, kv_heads=2, intermediate=128, vocab=512),
    "small": CheckpointSpec(layers=8, hidden=512, heads=8, kv_heads=2, intermediate=1024, vocab=4096),
    # the cluster-drop regime (issue 13): big enough that a decode step reads weights like a GPU
    # does (weight-bandwidth-bound), ~0.6 GB in bf16 (CPUs with avx512_bf16 / AMX) and ~1.2 GB in
    # fp32 (others: their bf16 matmul is compute-bound)
    "decode-bf16": CheckpointSpec(layers=12, hidden=1536, heads=24, kv_heads=4, intermediate=4096, vocab=4096,
                                  dtype="bfloat16"),
    "decode-fp32": CheckpointSpec(layers=12, hidden=1536, heads=24, kv_heads=4, intermediate=4096, vocab=4096),
    # the paper-like memory ratio (issue 34, R1): full multi-head attention (kv heads = heads), so a
    # token's KV is 72 KiB in bf16 (6x decode-bf16's) and KV binds at a weight share of 0.5-0.65
    # while a decode step is still mostly the weight read (672 MB)
    "decode-bf16-mha": CheckpointSpec(layers=12, hidden=1536, heads=24, kv_heads=24, intermediate=4096,
                                      vocab=4096, dtype="bfloat16"),
    # R1 on CPUs without avx512_bf16 (Zen 3, Cascade Lake: their bf16 matmul is compute-bound): the
    # same shape in fp32, 1.41 GB of weights and 144 KiB of KV per token
    "decode-fp32-mha": CheckpointSpec(layers=12, hidden=1536, heads=24, kv_heads=24, intermediate=4096,
                                      vocab=4096),
}

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there one all we their can has been if more when will would who "
    "so no memory cache layer model token request burst serve weight drop restore pipeline group "
    "queue latency kernel block tensor stream copy host device batch prefill decode cluster"
).split()


def _corpus(seed: int, n_lines: int = 4000):
    rng = random.Random(seed)
    for _ in range(n_lines):
        n = rng.randint(4, 24)
        words = []
        for _ in range(n):
            if rng.random() < 0.8:
                words.append(rng.choice(_WORDS))
            else:  # made-up words so BPE learns sub-word merges too
                words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 99999)))
        yield " ".join(words) + rng.choice([".", ",", "?", "!", ""])


def build_tokenizer(out: Path, spec: CheckpointSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=spec.max_position,
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(str(out))
    return fast


def build_model(out: str | Path, spec: CheckpointSpec) -> Path:
    """Write a loadable HF model directory (config, safetensors weights, tokenizer) to ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, spec)
    cfg = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg)
    # Larger-than-default init so greedy decoding is not dominated by one token and outputs
    # actually depend on every layer (a drop/remap bug then changes tokens).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    model = model.to(getattr(torch, spec.dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "kunserve_model.json").write_text(json.dumps(
        {"spec": asdict(spec), "weight_bytes": spec.weight_bytes(),
         "kv_bytes_per_token": spec.kv_bytes_per_token(),
         "note": "random weights, made offline by `kunserve make-model`"}, indent=2))
    return out


def spec_from_args(preset: str, **overrides) -> CheckpointSpec:
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r}: choose one of {', '.join(PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[preset], **given)
