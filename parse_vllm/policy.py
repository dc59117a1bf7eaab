"""Per-request PARSE state: when a request drafts a long window, and what it
does after a rejected draft.

  DRAFT    the draft model writes a window of W tokens; the target judges it.
  CONTINUE the target writes the rest of the answer (the paper), with
           token-level speculation of `spec_tokens` draft tokens.
  REWRITE  ("redraft" mode) the target writes up to `redraft_tokens` tokens or
           to the next sentence end, then the request goes back to DRAFT; at
           most `max_rounds` rewrites, then CONTINUE.

A draft the judge passed whole but the token guard cut is a token-level
correction, not a rejection: the request stays in DRAFT, and its next window
is about twice what the guard let through (at least GUARD_MIN_WINDOW),
doubling back towards W with each draft taken whole, so a draft that keeps
missing the target's top-k is not drafted W tokens deep every step.

Under `on_reject: adaptive` a request stays in DRAFT for good and a window policy
(window_policy.py) chooses, each time it could open a window, the window's length or
the token-level arm (`arm_window` 0) for a back-off; its drafts are judged only when
it opened a window.

A request whose threshold no judgment can reach (τ > 1) starts in CONTINUE:
its output is the target's either way, and a draft it cannot keep costs a
window of drafter steps and a target forward over W tokens.

Requests with PARSE off behave as vLLM's own draft-model speculation with
`spec_tokens` draft tokens (0: the target alone); under adaptive, a request on the
token-level arm drafts the k the policy chose for the step (`token_k`, at most
`spec_tokens`).

`draft_kv_len` is how far the draft model's KV is valid for the request: the
drafter runs only over requests that draft, and a request catches up from
there when it drafts next (drafting.py). While drafting, the drafter writes
its own draft tokens' KV (`draft_ahead` positions past it): as much of that
as the next step accepts stays valid and is not passed again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from parse_vllm.config import ParseConfig, RequestOptions
from parse_vllm.metrics import RequestCounts
from parse_vllm.window_policy import RequestPolicy

GUARD_MIN_WINDOW = 8


class Phase(enum.Enum):
    DRAFT = "draft"
    CONTINUE = "continue"
    REWRITE = "rewrite"


@dataclass
class RequestState:
    options: RequestOptions
    phase: Phase = Phase.DRAFT
    rounds: int = 0  # rewrites done (redraft mode)
    rewrite_left: int = 0  # tokens the target still writes before redrafting
    window_cap: int = 0  # after a guard cut: the next windows' length (0 = W)
    draft_kv_len: int = 0  # leading positions whose draft KV is valid
    # Positions after draft_kv_len whose draft KV the drafter wrote while drafting
    # (its own draft tokens): valid as far as the next step accepts that draft.
    draft_ahead: int = 0
    adaptive: RequestPolicy | None = None  # on_reject adaptive: the request's window policy state
    arm_window: int = 0  # adaptive: the window in flight (0: the token-level arm, or not decided)
    arm_parts: bool = False  # adaptive with judge_chunks: that window is judged in parts as drafted
    token_k: int | None = None  # adaptive: the token-level arm's k this step (None: spec_tokens)
    counts: RequestCounts = field(default_factory=RequestCounts)  # parse_vllm.get_request_stats

    def __post_init__(self) -> None:
        if self.options.enabled and self.options.threshold > 1:
            self.phase = Phase.CONTINUE

    @property
    def judging(self) -> bool:
        """Whether this request's drafts are judged semantically now."""
        if self.adaptive is not None:
            return self.options.enabled and self.phase is Phase.DRAFT and self.arm_window > 0
        return self.options.enabled and self.phase is Phase.DRAFT

    @property
    def will_draft(self) -> bool:
        """Whether this request drafts a window now or later (so a drafter
        that runs over the whole batch must keep up with its tokens)."""
        return self.options.enabled and self.phase in (Phase.DRAFT, Phase.REWRITE)

    def draft_len(self, config: ParseConfig, window: int) -> int:
        """How many draft tokens to schedule for this request next step."""
        if not self.judging:
            return config.spec_tokens if self.token_k is None else self.token_k
        if self.adaptive is not None:
            return self.arm_window
        return min(window, self.window_cap) if self.window_cap else window

    def after_judged_draft(
        self, config: ParseConfig, rejected: bool, *, guard_cut: bool = False, accepted: int = 0, window: int = 0
    ) -> None:
        """A judged draft was accepted whole, cut by the token guard (stay in
        DRAFT, with a shorter window), or rejected by the judge. (Under adaptive the
        window policy takes it: the request stays in DRAFT.)"""
        if self.adaptive is not None:
            self.arm_window = 0
            return
        if not rejected:
            if guard_cut:
                self.window_cap = min(window, max(GUARD_MIN_WINDOW, 2 * accepted))
            elif self.window_cap:
                self.window_cap = 0 if 2 * self.window_cap >= window else 2 * self.window_cap
            return
        if config.on_reject == "redraft" and self.rounds < config.max_rounds:
            self.phase = Phase.REWRITE
            self.rewrite_left = config.redraft_tokens
        else:
            self.phase = Phase.CONTINUE

    def after_tokens(self, tokens: list[int], sentence_end: np.ndarray) -> bool:
        """Tokens the target emitted this step for a REWRITE request; returns
        True when the request goes back to drafting."""
        if self.phase is not Phase.REWRITE or not tokens:
            return False
        self.rewrite_left -= len(tokens)
        ends_sentence = any(0 <= t < sentence_end.shape[0] and sentence_end[t] for t in tokens)
        if self.rewrite_left <= 0 or ends_sentence:
            self.phase = Phase.DRAFT
            self.rounds += 1
            return True
        return False
