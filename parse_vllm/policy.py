"""Per-request PARSE state: when a request drafts a long window, and what it
does after a rejected draft.

  DRAFT    the draft model writes a window of W tokens; the target judges it.
  CONTINUE the target writes the rest of the answer (the paper), with
           token-level speculation of `spec_tokens` draft tokens.
  REWRITE  ("redraft" mode) the target writes up to `redraft_tokens` tokens or
           to the next sentence end, then the request goes back to DRAFT; at
           most `max_rounds` rewrites, then CONTINUE.

Requests with PARSE off behave as vLLM's own draft-model speculation with
`spec_tokens` draft tokens (0: the target alone).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from parse_vllm.config import ParseConfig, RequestOptions


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

    @property
    def judging(self) -> bool:
        """Whether this request's drafts are judged semantically now."""
        return self.options.enabled and self.phase is Phase.DRAFT

    @property
    def will_draft(self) -> bool:
        """Whether this request drafts a window now or later (so the drafter
        must keep up with its tokens)."""
        return self.options.enabled and self.phase in (Phase.DRAFT, Phase.REWRITE)

    def draft_len(self, config: ParseConfig, window: int) -> int:
        """How many draft tokens to schedule for this request next step."""
        return window if self.judging else config.spec_tokens

    def after_judged_draft(self, config: ParseConfig, rejected: bool) -> None:
        """A judged draft was fully accepted (stay in DRAFT) or not."""
        if not rejected:
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
