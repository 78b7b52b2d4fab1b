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
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["BadRequest", "Checked", "parse_json", "validate", "error_body"]

MAX_BODY_BYTES = 32 << 20
# sampling fields carried from a chat or completion request to its continuation (a completion)
CARRY = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
         "frequency_penalty", "repetition_penalty", "ignore_eos", "logit_bias", "skip_special_tokens",
         "spaces_between_special_tokens", "include_stop_str_in_output", "bad_words", "allowed_token_ids",
         "priority", "user")
_NOT_MOVABLE = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "tools", "response_format",
                "structured_outputs", "suffix", "prompt_embeds", "logprob_token_ids")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", status=413)
    try:
        body = json.loads(raw)
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


def validate(kind: str, body: dict, *, served: Sequence[str], max_model_len: int,
             count_tokens: Callable[[str, dict], list[int]]) -> Checked:
    """Check one request; ``count_tokens(kind, body)`` returns each prompt's token count."""
    completion_cls, chat_cls = load_request_models()
    cls = completion_cls if kind == "completion" else chat_cls
    try:
        req = cls.model_validate(body)
    except Exception as e:  # pydantic.ValidationError, vLLM's own model validators
        raise _pydantic_error(e) from None
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
    for n in counts:
        if n + 1 > max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your "
                             f"prompt contains {n} input tokens, which leaves no room for output. Please reduce "
                             f"the length of the input prompt.", param="prompt")
    longest = max(counts) if counts else 0
    budget = max_model_len - longest if max_tokens is None else min(max_tokens, max_model_len - longest)
    stream = bool(getattr(req, "stream", False))
    n = getattr(req, "n", 1) or 1
    movable = (stream and n == 1 and len(counts) == 1 and not getattr(req, "use_beam_search", False)
               and not any(body.get(k) not in (None, False, [], 0) for k in _NOT_MOVABLE))
    return Checked(kind, body, counts, budget, movable, stream)


def continuation_body(body: dict, model: str, token_ids: Sequence[int], remaining: int, generated: int) -> dict:
    """A completion that continues a request from its prompt + generated token ids (re-prefill,
    or a prefix-cache hit on KV migrated there)."""
    out: dict[str, Any] = {k: body[k] for k in CARRY if k in body}
    out.update(model=model, prompt=list(token_ids), max_tokens=max(int(remaining), 1), stream=True,
               return_token_ids=True, add_special_tokens=False)
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, int(body["min_tokens"]) - generated)
    return out
