"""Request validation at the front end: a bad request gets HTTP 400 and never reaches an engine.

Bodies are checked with vLLM's own request models (``CompletionRequest``,
``ChatCompletionRequest``: types and ranges exactly as ``vllm serve`` checks them), then against the
fleet: the model name, the prompt's length in tokens (tokenized here with the model's tokenizer),
and ``max_tokens`` (at least 1, as vLLM requires, and at most the model's length: a larger value can
never be produced, where vLLM would silently clamp it). Errors are OpenAI-style bodies
``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``.

:func:`validate` also decides whether a request is *movable*: a single streamed sequence whose
continuation from token ids is exact (no n > 1, beam search, logprobs, echo, tools or structured
output), which is what migration and mid-stream failover need.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgspec

__all__ = ["BadRequest", "Checked", "check_fields", "decode_json", "error_body", "parse_json", "prompt_counter",
           "shape_key", "validate"]

MAX_BODY_BYTES = 32 << 20
# sampling fields carried from a chat or completion request to its continuation (a completion)
CARRY = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
         "frequency_penalty", "repetition_penalty", "ignore_eos", "logit_bias", "skip_special_tokens",
         "spaces_between_special_tokens", "include_stop_str_in_output", "bad_words", "allowed_token_ids",
         "priority", "user")
_NOT_MOVABLE = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "tools", "response_format",
                "structured_outputs", "suffix", "prompt_embeds", "logprob_token_ids")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "BadRequestError",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.headers = headers or {}   # response headers (a 429's Retry-After)


def error_body(message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


#: msgspec reads a request body in 8 us where the json module takes 43 (a 130-byte completion
#: request, cold caches between requests); what it refuses, the json module reads as before
decode_json = msgspec.json.Decoder().decode


def parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", status=413)
    try:
        body = decode_json(raw)
    except RecursionError:   # msgspec and json both recurse per level: a body nested ~1000 deep
        raise BadRequest("request body is nested too deeply") from None
    except ValueError:   # msgspec refuses what json takes (NaN, 1e400, a lone surrogate's escape)
        try:
            body = json.loads(raw)
        except RecursionError:
            raise BadRequest("request body is nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


@dataclass(frozen=True)
class Checked:
    kind: str                      # "completion" | "chat"
    body: dict                     # the client's body as sent (validated)
    prompt_tokens: list[int]       # token count of each prompt (one per prompt)
    max_tokens: int                # the output budget per sequence (clamped like vLLM)
    movable: bool                  # one streamed sequence that can continue from token ids
    stream: bool


@functools.lru_cache(maxsize=1)
def load_request_models():
    """vLLM's ``CompletionRequest`` and ``ChatCompletionRequest`` (importing them takes seconds)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    return CompletionRequest, ChatCompletionRequest


def _pydantic_error(e: Exception) -> BadRequest:
    errs = getattr(e, "errors", None)
    if callable(errs):
        first = errs()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        return BadRequest(f"{loc or 'body'}: {first.get('msg', str(e))}", param=loc or None)
    return BadRequest(str(e))


def encodes(x: str) -> bool:
    """Whether ``x`` is text UTF-8 can carry (a lone surrogate, valid in JSON as ``"\\udc80"``, is not)."""
    try:
        x.encode()
    except UnicodeEncodeError:
        return False
    return True


def _text(x: Any) -> bool:
    """A non-empty string pydantic takes as it is (a lone surrogate is not one: it fails UTF-8)."""
    return type(x) is str and bool(x) and encodes(x)


def shape_key(kind: str, body: dict) -> tuple | None:
    """What the request models' verdict on ``body`` depends on, when that is less than the whole body:
    every field except the prompt (or messages) exactly, and the prompt's kind. vLLM 0.32's models
    and validators treat every non-empty valid string prompt alike (a type, an emptiness check),
    likewise a token-id list, and a chat whose messages are plain ``{"role", "content": text}``
    pairs. None where the verdict may depend on more (other prompt or message forms)."""
    if kind == "completion":
        p = body.get("prompt")
        if _text(p):
            shape: Any = "text"
        elif type(p) is list and p and all(type(t) is int and 0 <= t < 1 << 31 for t in p):
            shape = "ids"
        else:
            return None
        rest = {k: v for k, v in body.items() if k != "prompt"}
    else:
        msgs = body.get("messages")
        if type(msgs) is not list or not msgs:
            return None
        roles = []
        for m in msgs:
            if type(m) is not dict or m.keys() != {"role", "content"} or type(m["role"]) is not str \
                    or not _text(m["content"]):
                return None
            roles.append(m["role"])
        shape = tuple(roles)
        rest = {k: v for k, v in body.items() if k != "messages"}
    try:
        return kind, shape, json.dumps(rest, sort_keys=True)
    except (TypeError, ValueError):
        return None


class _Verdicts:
    """Bodies the request models accepted, by :func:`shape_key`: what validation derived from them.
    A client sends the same fields with a different prompt request after request; vLLM's models
    take 0.08 ms to check their ~80 fields with hot caches and 0.3 ms with the cold caches a request
    finds after a few ms of waiting (measured on a Zen 3 EPYC core), on the way to every first token.
    Only acceptances are kept (a rejection is checked again, for its message), and only where
    validation left the body as it was (a validator that rewrites a field must run on every body
    the engine will see)."""

    def __init__(self, size: int = 1024):
        self.size, self.kept = size, OrderedDict()

    def get(self, key: tuple | None) -> tuple | None:
        if key is None:
            return None
        got = self.kept.get(key)
        if got is not None:
            self.kept.move_to_end(key)
        return got

    def put(self, key: tuple | None, kind: str, body: dict, verdict: tuple) -> None:
        if key is None or shape_key(kind, body) != key:   # a validator rewrote the body
            return
        self.kept[key] = verdict
        if len(self.kept) > self.size:
            self.kept.popitem(last=False)


_verdicts = _Verdicts()


def check_fields(kind: str, body: dict) -> tuple[bool, int, bool]:
    """``body`` against vLLM's request model: (stream, n, use_beam_search), or BadRequest."""
    key = shape_key(kind, body)
    got = _verdicts.get(key)
    if got is not None:
        return got
    completion_cls, chat_cls = load_request_models()
    cls = completion_cls if kind == "completion" else chat_cls
    try:
        req = cls.model_validate(body)
    except Exception as e:  # pydantic.ValidationError, vLLM's own model validators
        raise _pydantic_error(e) from None
    verdict = (bool(getattr(req, "stream", False)), getattr(req, "n", 1) or 1,
               bool(getattr(req, "use_beam_search", False)))
    _verdicts.put(key, kind, body, verdict)
    return verdict


def validate(kind: str, body: dict, *, served: Sequence[str], max_model_len: int,
             count_tokens: Callable[[str, dict], list[int]]) -> Checked:
    """Check one request; ``count_tokens(kind, body)`` returns each prompt's token count."""
    stream, n, beam = check_fields(kind, body)
    model = body.get("model")
    if model is not None and model not in served:
        raise BadRequest(f"The model `{model}` does not exist. Served: {', '.join(served)}", param="model")
    if kind == "completion" and body.get("prompt") is None and body.get("prompt_embeds") is None:
        raise BadRequest("prompt: field required", param="prompt")
    if kind == "chat" and not body.get("messages"):
        raise BadRequest("messages: must be a non-empty list", param="messages")
    max_tokens = body.get("max_completion_tokens") if kind == "chat" else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens!r}", param="max_tokens")
        if max_tokens > max_model_len:
            raise BadRequest(f"max_tokens={max_tokens} exceeds the model's maximum length {max_model_len}; "
                             f"no request can produce that many tokens", param="max_tokens")
    counts = count_tokens(kind, body)
    for length in counts:
        if length + 1 > max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your "
                             f"prompt contains {length} input tokens, which leaves no room for output. Please reduce "
                             f"the length of the input prompt.", param="prompt")
    longest = max(counts) if counts else 0
    budget = max_model_len - longest if max_tokens is None else min(max_tokens, max_model_len - longest)
    movable = (stream and n == 1 and len(counts) == 1 and not beam
               and not any(body.get(k) not in (None, False, [], 0) for k in _NOT_MOVABLE))
    return Checked(kind, body, counts, budget, movable, stream)


#: texts on which a tokenizer's Rust backend must count as its transformers wrapper does before the
#: front end counts with the backend alone
_PROBES = ("", "a", " leading space", "trailing space ", "Hello, world! 123", "<s> </s> <|endoftext|>",
           "naïve café, 東京, 🙂", "tabs\tand\nnew lines\r\n", "  two  spaces  ")


def prompt_counter(tok: Any) -> Callable[[str, bool], int] | None:
    """``count(text, add_special_tokens)``: the token count of a prompt, as the engine will count it.

    A fast tokenizer's Rust backend (``tok._tokenizer.encode``) counts in a third of the time of
    the transformers call around it (measured on the tiny model's tokenizer: 34 vs 110 us hot, 144
    vs 425 us with the caches cold between requests, on every request's way to its first token).
    It is used only where it agrees with the wrapper on every probe text, both ways of special
    tokens; else the wrapper counts. A count the probes missed matters only at the model's length
    limit, where the engine checks again. None without a tokenizer (the engines check lengths)."""
    if tok is None:
        return None

    def wrapped(text: str, special: bool) -> int:
        return len(tok(text, add_special_tokens=special)["input_ids"])

    backend = getattr(tok, "_tokenizer", None)
    encode = getattr(backend, "encode", None)
    if encode is None:
        return wrapped

    def fast(text: str, special: bool) -> int:
        return len(encode(text, add_special_tokens=special).ids)

    try:
        same = all(fast(t, sp) == wrapped(t, sp) for t in _PROBES for sp in (True, False))
    except Exception:
        same = False
    return fast if same else wrapped


def max_token_id(tok: Any) -> int | None:
    """The largest prompt token id the engine takes, as vLLM bounds it (``renderers/base.py``
    ``validate_token_ids``): the larger of the tokenizer's largest id and the model's vocabulary
    size less one (a model may have ids its tokenizer lacks, and the reverse). None where it
    cannot be known (no tokenizer): the engines check."""
    if tok is None:
        return None
    try:
        bound = max(tok.get_vocab().values())
        size = getattr(tok, "vocab_size", None)
        if isinstance(size, int):
            bound = max(bound, size - 1)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary to read: the engines check
        return None
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(tok.name_or_path, local_files_only=True)   # where the tokenizer came from
        size = getattr(cfg.get_text_config(), "vocab_size", None)
        if isinstance(size, int):
            bound = max(bound, size - 1)
    except Exception as e:  # noqa: BLE001 - no model config beside the tokenizer: the tokenizer's bound
        logging.getLogger(__name__).debug("no model config for %s (%r): token ids bounded by the tokenizer",
                                          getattr(tok, "name_or_path", "?"), e)
    return bound


def check_token_ids(ids: Sequence[Any], bound: int | None) -> None:
    """A prompt of token ids: every one an id of the model's vocabulary, or BadRequest (400). vLLM
    finds an id out of it only after a streamed answer began, as an error event inside the stream."""
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0
                or (bound is not None and t > bound)), None)
    if bad is not None:
        raise BadRequest(f"prompt: token id {bad!r} is out of the model's vocabulary (ids 0.."
                         f"{bound if bound is not None else '?'})", param="prompt")


def continuation_body(body: dict, model: str, token_ids: Sequence[int], remaining: int, generated: int) -> dict:
    """A completion that continues a request from its prompt + generated token ids (re-prefill,
    or a prefix-cache hit on KV migrated there)."""
    out: dict[str, Any] = {k: body[k] for k in CARRY if k in body}
    out.update(model=model, prompt=list(token_ids), max_tokens=max(int(remaining), 1), stream=True,
               return_token_ids=True, add_special_tokens=False)
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, int(body["min_tokens"]) - generated)
    return out
