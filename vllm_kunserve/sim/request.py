"""Per-request simulation state (mutable, slotted for speed)."""

from __future__ import annotations

from .trace import TraceRequest


class Req:
    __slots__ = ("id", "arrival", "prompt", "output", "computed", "generated", "blocks", "first_t",
                 "finish_t", "preempts", "swapped", "server", "migrations", "last_tok_t", "finishes", "member")

    def __init__(self, tr: TraceRequest):
        self.id = tr.id
        self.arrival = tr.arrival_s
        self.prompt = tr.prompt
        self.output = tr.output
        self.computed = 0      # tokens whose KV is held (on GPU, or on host when swapped)
        self.generated = 0     # output tokens produced
        self.blocks = 0        # KV blocks held on the GPU
        self.first_t = None    # time of the first output token
        self.finish_t = None
        self.preempts = 0
        self.swapped = False
        self.server = None
        self.migrations = 0
        self.last_tok_t = None
        self.finishes = 0      # conservation check: must end at exactly 1
        self.member = 0        # its member's index in a group whose members keep their requests

    @property
    def need(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return self.prompt + self.generated - self.computed

    @property
    def length(self) -> int:
        return self.prompt + self.generated

    def record(self) -> dict:
        ttft = self.first_t - self.arrival
        lat = self.finish_t - self.arrival
        tpot = (self.finish_t - self.first_t) / (self.output - 1) if self.output > 1 else 0.0
        return {"id": self.id, "arrival_s": self.arrival, "prompt": self.prompt, "output": self.output,
                "ttft_s": ttft, "tpot_s": tpot, "latency_s": lat, "preemptions": self.preempts,
                "migrations": self.migrations}
