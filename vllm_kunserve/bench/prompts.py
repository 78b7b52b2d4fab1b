"""Prompts with exactly the requested number of tokens for the served tokenizer.

Preferred mode ``ids``: the prompt is a list of token ids sent as the completions API ``prompt``
(vLLM accepts a list of ints and does not re-tokenize it), so the count is exact by construction.
Ids are drawn uniformly from the vocabulary minus special tokens with a per-request seed, so
prompts of different requests share no prefix (prefix caching cannot blur the memory picture).

Mode ``text`` builds a string from single-token words (vocabulary entries that decode to one
word with a leading space and re-encode to themselves) and checks the count by encoding it the
way the server does (special tokens included), adding or removing words until it matches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def load_tokenizer(name_or_path: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:  # pragma: no cover - transformers comes with vLLM
        raise ValueError("prompt synthesis needs `transformers` (pip install transformers)") from None
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {name_or_path!r}: {e}") from None


def vocab_size_from_config(model_dir: str | Path) -> int | None:
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    v = json.loads(cfg.read_text()).get("vocab_size")
    return int(v) if isinstance(v, int) else None


class PromptFactory:
    """Deterministic prompts: ``make(n, key)`` returns ``n`` tokens' worth for request ``key``."""

    def __init__(self, tokenizer: Any = None, *, vocab_size: int | None = None, mode: str = "ids", seed: int = 0):
        if mode not in ("ids", "text"):
            raise ValueError(f"prompt mode must be ids or text, got {mode!r}")
        if tokenizer is None and (mode == "text" or not vocab_size):
            raise ValueError("prompt synthesis needs the served tokenizer (--tokenizer or a local --model dir)")
        self.tokenizer, self.mode, self.seed = tokenizer, mode, seed
        if tokenizer is not None:
            size = len(tokenizer)
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
        else:
            size, special = int(vocab_size), set()
        if vocab_size:  # the model's embedding size bounds valid ids even if the tokenizer is larger
            size = min(size, int(vocab_size))
        ids = np.array([i for i in range(size) if i not in special], dtype=np.int64)
        if len(ids) == 0:
            raise ValueError("tokenizer has no usable (non-special) token ids")
        self._ids = ids
        self._words: list[str] | None = None
        self._n_special = 0
        if mode == "text":
            self._words = self._single_token_words()
            self._n_special = len(tokenizer("")["input_ids"])

    def _single_token_words(self) -> list[str]:
        tok = self.tokenizer
        words = []
        for i in self._ids[: min(len(self._ids), 50_000)]:
            s = tok.decode([int(i)])
            if len(s) >= 3 and s[0] == " " and s[1:].isascii() and s[1:].isalpha() and s[1:].islower():
                if tok(s, add_special_tokens=False)["input_ids"] == [int(i)]:
                    words.append(s)
        if len(words) < 16:
            raise ValueError("tokenizer has too few single-token words for text prompts; use --prompt-mode ids")
        return words

    def _rng(self, key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, int(key)])

    def make(self, n: int, key: int) -> list[int] | str:
        if n < 1:
            raise ValueError(f"prompt length must be >= 1 token, got {n}")
        rng = self._rng(key)
        if self.mode == "ids":
            return [int(x) for x in rng.choice(self._ids, size=n)]
        return self._text(n, rng)

    def count(self, prompt: list[int] | str) -> int:
        if isinstance(prompt, list):
            return len(prompt)
        return len(self.tokenizer(prompt)["input_ids"])

    def _text(self, n: int, rng: np.random.Generator) -> str:
        words = self._words
        assert words is not None
        k = max(1, n - self._n_special)
        chosen = [words[j] for j in rng.integers(0, len(words), size=k)]
        for _ in range(64):
            text = "".join(chosen).lstrip()
            got = self.count(text)
            if got == n:
                return text
            if got > n and len(chosen) > 1:
                del chosen[-max(1, min(got - n, len(chosen) - 1)):]
            elif got < n:
                chosen += [words[j] for j in rng.integers(0, len(words), size=n - got)]
            else:
                break
        raise ValueError(f"could not build a text prompt of exactly {n} tokens; use --prompt-mode ids")
