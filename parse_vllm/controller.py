"""Per-engine PARSE state: what the model runner holds, as one object.

The configuration and what follows from it (window, boundary rule, template,
verifier), each request's phase (`policy.RequestState`), the counters and
their Prometheus export, the recorded judgments and the KV audit. It turns a
`step.StepResult` into counters and phase changes; the step itself is
`step.parse_step`. No vLLM object: the runner passes plain values.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from parse_vllm.boundaries import BoundaryRule
from parse_vllm.config import ParseConfig, RequestOptions
from parse_vllm.drafting import OpenWindow
from parse_vllm.metrics import KvAudit, ParseStats, PromExporter
from parse_vllm.policy import Phase, RequestState
from parse_vllm.step import DraftBatch, StepResult, StepSettings
from parse_vllm.templates import VerificationTemplate
from parse_vllm.transfers import HostCopies
from parse_vllm.verify import CopyBatch, Verifier


@dataclass
class JudgedRequests:
    """Who a step's DraftBatch rows are, gathered once by the runner."""

    req_ids: list[str]  # [R]
    context: list[np.ndarray]  # [R] each request's tokens before its draft (only when judgments are recorded)


@dataclass
class ParseController:
    config: ParseConfig
    window: int  # W = num_speculative_tokens
    rule: BoundaryRule
    sentence_end: np.ndarray  # [vocab] bool
    template: VerificationTemplate
    layer_names: list[str]
    served_model_name: str
    device: str = "cpu"  # the model's
    verifier: Verifier | None = None  # set once the KV cache exists
    read_out: object | None = None  # the judge head on the device (judge_head.ReadOut); None: zero-shot

    def __post_init__(self) -> None:
        # every copy between host and device of a step, counted
        self.host = HostCopies(self.device, watch_pageable=self.config.audit_transfers)
        self.states: dict[str, RequestState] = {}
        self.windows: dict[str, OpenWindow] = {}  # windows drafted over several steps, by request
        self.stats = ParseStats()
        self._exported = ParseStats()
        self._prom = PromExporter({"model_name": self.served_model_name})
        self.judgments: collections.deque = collections.deque(maxlen=max(1, self.config.record_judgments))
        self.kv_audit: KvAudit | None = KvAudit() if self.config.audit_kv_blocks else None

    # -- requests -----------------------------------------------------------

    def state(self, req_id: str, options: Callable[[], RequestOptions]) -> RequestState:
        """The request's state, created from `options()` on first sight."""
        state = self.states.get(req_id)
        if state is None:
            state = self.states[req_id] = RequestState(options())
        return state

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)
            self.windows.pop(req_id, None)

    def drop_windows(self, req_ids) -> None:
        """Preempted or resumed: the window's blocks are gone; it starts again
        when the request drafts next."""
        for req_id in req_ids:
            if self.windows.pop(req_id, None) is not None:
                self.states[req_id].draft_kv_len = self.states[req_id].draft_ahead = 0
                self.stats.windows_dropped += 1

    def rewriting(self, req_id: str) -> bool:
        """Whether the target is writing for the request (REWRITE phase): its
        tokens count towards the next draft."""
        state = self.states.get(req_id)
        return state is not None and state.phase is Phase.REWRITE

    def draft_len(self, state: RequestState) -> int:
        """Draft tokens to schedule for the request next step."""
        return state.draft_len(self.config, self.window)

    # -- the step -------------------------------------------------------------

    def settings(self, vocab_size: int, max_model_len: int) -> StepSettings:
        return StepSettings(
            rule=self.rule,
            two_stage=self.config.two_stage,
            vocab_size=vocab_size,
            suffix_len=self.template.suffix_len,
            max_model_len=max_model_len,
        )

    def judge(self, copies: CopyBatch, batch: DraftBatch, judged: JudgedRequests) -> np.ndarray:
        """One verification call through the verifier over copies of `batch`'s
        drafts; the judgments' log-odds [C]. A recorded judgment names its copy's
        request, boundary and token ids (`judged`)."""
        j = self.verifier.judge(copies)
        n = int(copies.req_row.shape[0])
        self.stats.verification_passes += j.passes
        self.stats.copies += n
        self.stats.suffix_tokens += n * self.template.suffix_len
        if self.config.record_judgments:
            k_of = {int(r): k for k, r in enumerate(batch.row)}
            for c in range(n):
                k = k_of[int(copies.req_row[c])]
                boundary = int(copies.prefix_len[c]) - int(batch.cached_len[k])
                self.judgments.append(
                    {
                        "req_id": judged.req_ids[k],
                        "boundary": boundary,
                        "token_ids": judged.context[k].tolist() + batch.draft_of(k)[:boundary].tolist(),
                        "p_yes": float(j.p_yes[c]),
                        "logit": float(j.logit[c]),
                        "logprob_yes": float(j.logprob_yes[c]),
                        "logprob_no": float(j.logprob_no[c]),
                        "hidden": None if j.hidden is None else j.hidden[c],
                        "requests_kv_unchanged": j.requests_kv_unchanged,
                    }
                )
        return j.logit

    def apply(self, req_ids: list[str], batch: DraftBatch, result: StepResult) -> None:
        """Counters and phase changes for the step's outcome; `req_ids` [R]
        names the DraftBatch's requests."""
        stats = self.stats
        for k, req_id in enumerate(req_ids):
            text_len = int(result.text_len[k])
            if text_len == 0:
                continue  # nothing was offered (placeholder drafts, or a stop first)
            l_tok = int(batch.l_tok[k])
            stats.drafts += 1
            stats.draft_tokens += text_len
            stats.tokens_accepted_token_level += l_tok
            if not result.judged[k]:  # token-level verification took it whole
                stats.drafts_accepted_whole += 1
                continue
            accepted = int(result.accepted[k])
            stats.tokens_accepted_semantic += max(0, accepted - l_tok)
            stats.guard_cuts += int(result.guard_cut[k])
            if result.rejected[k]:
                stats.reject_at(max(0, int(result.first_fail[k])))
            elif accepted >= text_len:
                stats.drafts_accepted_whole += 1
            state = self.states[req_id]
            before = state.phase
            state.after_judged_draft(
                self.config,
                bool(result.rejected[k]),
                guard_cut=bool(result.cut[k]),
                accepted=accepted,
                window=self.window,
            )
            if state.phase is Phase.REWRITE and before is not Phase.REWRITE:
                stats.rounds += 1

    def after_tokens(self, req_id: str, tokens: list[int]) -> None:
        """Tokens the target emitted for a request not judged this step."""
        state = self.states.get(req_id)
        if state is not None and state.phase is Phase.REWRITE:
            state.after_tokens(tokens, self.sentence_end)

    # -- counters -------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = ParseStats()
        self._exported = ParseStats()

    def export(self) -> None:
        """Add what the counters gained since the last export to Prometheus."""
        self._prom.add(self.stats.minus(self._exported))
        self._exported = self.stats.copy()

    def scratch_ids(self) -> np.ndarray:
        """The scratch KV block ids held back from the scheduler (empty on the kernel path)."""
        scratch = getattr(self.verifier, "scratch_ids", None)
        return np.zeros(0, dtype=np.int64) if scratch is None else np.asarray(scratch)

    def audit(self, num_reqs: int, held: set[int]) -> None:
        if self.kv_audit is not None:
            self.kv_audit.record(num_reqs, len(held), len(held.intersection(self.scratch_ids().tolist())))
