"""The PARSE step: how many draft tokens each judged request takes.

Terms, as in vLLM's RejectionSampler:
  draft      the d tokens the draft model proposed for a request this step.
  L_tok      draft tokens vLLM's rejection sampler accepted (token-level, lossless).
  text       the draft before its first stop token and within max_tokens
             (`acceptance.view_draft`); only text is judged.
  boundary   b: the judge reads draft[:b]; b_1 < ... < b_K = len(text).
  L_sem      the maximal valid prefix: the largest b_k with b_1..b_k all
             passing (the judgment's log-odds >= logit(τ): P(yes) >= τ, but
             τ = 1 never passes, however sure the judge), 0 if b_1 fails;
             boundaries start past L_tok.
  cut        a limit that is not the judge's: the token guard (the first draft
             token outside the target's top-k), the request's constraints
             (grammar bitmask, allowed token ids), or the context (a copy of
             the suffix must fit in max_model_len).
  accepted   max(L_sem within the cuts, L_tok) draft tokens (+1 for the stop
             token when the whole text passed); a request that takes more than
             L_tok is *resampled*: draft[:accepted], then one token sampled
             from the target at that position.
  rejected   the judge failed a boundary before the end of the text (or a
             constraint cut it): the request leaves the DRAFT phase.
  partial    the draft is the part of a window drafted so far (chunked judging,
             windows.py): its end is no boundary unless it is a cut of its own,
             and where no boundary fails the request *commits*: it takes
             max(L_sem, L_tok) tokens and nothing of the target's, and its window
             goes on. The first failing boundary rejects as in a whole window.

The step, in order (`parse_step`):
  1. view each draft: text length, stop token             -> text_len [R]
  2. the guard and the constraints over the whole batch   -> guard_len, allowed_len [R]
  3. boundaries, none within what token-level acceptance took (those
     tokens are the target's own, taken either way), none past the guard's
     or the context's cut
  4. one verification pass over the copies whose outcome τ leaves open
     (0 < τ <= 1; τ <= 0 passes and τ > 1 fails every boundary unjudged);
     two-stage: the holistic boundary first, earlier ones only where it failed
  5. L_sem, the cuts, accepted lengths, who resamples, who is rejected

Pure: no vLLM object. The runner builds a `DraftBatch` from vLLM's batch and
applies the `StepResult`; the judge is any callable over a `CopyBatch`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from parse_vllm.acceptance import (
    DraftView,
    constrained_view,
    final_accept_len,
    guard_mask,
    maximal_valid_prefix,
    view_draft,
)
from parse_vllm.boundaries import BoundaryRule
from parse_vllm.judge_head import judgment_passes
from parse_vllm.transfers import fetch
from parse_vllm.transfers import to_device as fetch_to_device
from parse_vllm.verify import CopyBatch

NO_LIMIT = np.iinfo(np.int64).max  # guard_len of a request without a guard


@dataclass
class DraftBatch:
    """The drafts PARSE judges this step, packed flat (R requests).

    Worked example: a batch of 3 requests with 3, 4 and 2 draft tokens, where
    request 1 has PARSE off. vLLM's logits hold each request's last token and
    draft: rows 0..3 for request 0, 4..8 for request 1, 9..11 for request 2.
        row           [0, 2]
        draft         [a0 a1 a2 c0 c1]   # [Σd]
        cu_draft      [0, 3, 5]          # [R + 1]: request k's draft is draft[cu_draft[k]:cu_draft[k+1]]
        logits_start  [0, 9]             # logits[logits_start[k] + j] predicts draft token j
    """

    row: np.ndarray  # [R] input-batch row of each request
    draft: np.ndarray  # [Σd] int64, the drafts as scheduled (-1 placeholders possible)
    cu_draft: np.ndarray  # [R + 1]
    logits_start: np.ndarray  # [R] row of `logits` whose distribution draft token 0 was drawn against
    cached_len: np.ndarray  # [R] tokens in the KV cache before the draft (prompt + output so far)
    output_len: np.ndarray  # [R] output tokens before this step's draft
    max_tokens: np.ndarray  # [R] 0: no limit
    min_tokens: np.ndarray  # [R]
    stop_ids: list[frozenset[int]]  # [R] tokens that end each request
    l_tok: np.ndarray  # [R] draft tokens the rejection sampler accepted
    threshold: np.ndarray  # [R] τ
    guard: np.ndarray  # [R] top-k of the token guard, 0 = off
    greedy: np.ndarray  # [R] bool: the request samples greedily
    bad_words: np.ndarray  # [R] bool: the request has bad_words (no draft token beyond L_tok)
    logits: torch.Tensor  # [N, vocab] the target's logits, constraints (grammar bitmask) applied
    forbidden: torch.Tensor | None = None  # [R, vocab] bool, allowed_token_ids as a mask (True = forbidden)
    # What a caller that fetches the step's inputs together computed first
    # (None: the step computes them): `draft_views`, and `token_checks` on the
    # host, [2, R] guard_len and allowed_len.
    views: list[DraftView] | None = None
    checks: np.ndarray | None = None
    # [2, R, width] on the host, when a judge head reads evidence (evidence.py): per draft
    # token, the target's log-probability of it (row 0) and whether its greedy token differs
    # (row 1); fetched with `checks` in the step's one read (`token_checks_with_evidence`).
    evidence: np.ndarray | None = None
    # Chunked judging (None: every draft whole): [R] bool, the draft is the part of a window
    # drafted so far; [R] the window's tokens taken before it (its boundaries count from
    # the window's start).
    partial: np.ndarray | None = None
    window_offset: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.row.shape[0])

    def draft_of(self, k: int) -> np.ndarray:
        return self.draft[self.cu_draft[k] : self.cu_draft[k + 1]]


def judged_drafts(
    view,  # the step's _vllm.BatchView, [B] rows
    num_draft: np.ndarray,  # [B] draft tokens scheduled per row (SpecDecodeMetadata.num_draft_tokens)
    drafts: np.ndarray,  # [Σd] the scheduled drafts, row after row
    logits_start: np.ndarray,  # [B] row of the logits of each row's last token
    judging: np.ndarray,  # [B] bool: the row's drafts are judged (DRAFT phase, PARSE on)
    options: list,  # [B] each row's config.RequestOptions
    logits: torch.Tensor,  # [N, vocab]
) -> DraftBatch:
    """The DraftBatch of the rows PARSE judges this step: those judging with a draft.
    `l_tok` is filled once the rejection sampler has run; `forbidden` by the caller, who
    holds the sampler's masks."""
    cu_all = np.concatenate([[0], np.cumsum(num_draft)])
    rows = np.flatnonzero((num_draft > 0) & judging)
    opts = [options[i] for i in rows]
    return DraftBatch(
        row=rows,
        draft=np.concatenate([drafts[cu_all[i] : cu_all[i + 1]] for i in rows]) if rows.shape[0] else drafts[:0],
        cu_draft=np.concatenate([[0], np.cumsum(num_draft[rows])]).astype(np.int64),
        logits_start=logits_start[rows],
        cached_len=view.num_computed[rows] + 1,
        output_len=view.output_len[rows],
        max_tokens=view.max_tokens[rows],
        min_tokens=view.min_tokens[rows],
        stop_ids=[view.stops[i] for i in rows],
        l_tok=np.zeros(rows.shape[0], dtype=np.int64),
        threshold=np.array([o.threshold for o in opts], dtype=np.float64),
        guard=np.array([o.guard for o in opts], dtype=np.int64),
        greedy=view.greedy[rows],
        bad_words=view.bad_words[rows],
        logits=logits,
    )


@dataclass(frozen=True)
class StepSettings:
    """What the step needs from the engine's PARSE configuration."""

    rule: BoundaryRule
    two_stage: bool
    vocab_size: int
    suffix_len: int  # tokens of the verification suffix (a copy's length)
    max_model_len: int  # a copy's last position must stay below it


@dataclass
class StepResult:
    """Per request of the DraftBatch, [R] each."""

    text_len: np.ndarray  # draft tokens that could be judged (0: nothing to judge)
    accepted: np.ndarray  # draft tokens taken, >= l_tok
    resample: np.ndarray  # bool: accepted > l_tok (sample one target token after draft[:accepted])
    rejected: np.ndarray  # bool: leaves the DRAFT phase
    cut: np.ndarray  # bool: the guard or the context stopped a draft the judge passed
    guard_cut: np.ndarray  # bool: the cut was the guard's
    first_fail: np.ndarray  # index of the first failed boundary, -1 if none
    judged: np.ndarray  # bool: the request's draft went to the judge (not taken whole token-level)
    commit: np.ndarray  # bool: a partial draft no boundary failed: draft[:accepted] and no target token


Judge = Callable[[CopyBatch], np.ndarray]  # copies -> the judgments' log-odds [C]


def parse_step(batch: DraftBatch, judge: Judge, s: StepSettings) -> StepResult:
    """One PARSE step over a DraftBatch (module docstring)."""
    R = batch.num_reqs
    l_tok = batch.l_tok.astype(np.int64)

    # 1. What each draft offers.
    views = batch.views if batch.views is not None else draft_views(batch, s.vocab_size)
    text_len = np.array([v.text_len for v in views], dtype=np.int64)
    # A window's part drafted so far, as long as nothing (max_tokens) cut it: its end is the
    # window's end only where it is a boundary of its own.
    d = np.diff(batch.cu_draft)
    partial = np.zeros(R, dtype=bool) if batch.partial is None else batch.partial & (text_len == d)
    offset = np.zeros(R, dtype=np.int64) if batch.window_offset is None else batch.window_offset
    # Taken whole token-level, or nothing to judge: the judge is not asked.
    judged = (text_len > 0) & (l_tok < text_len)

    # 2. The guard and the constraints, for the whole batch at once.
    guard_len, allowed_len = batch.checks if batch.checks is not None else draft_token_checks(batch, views)

    # 3. Boundaries. The guard first: no boundary past the first one at or
    #    beyond the guard's cut can add accepted tokens. Then the context: a
    #    copy of the suffix after draft[:b] must fit in max_model_len.
    tau = batch.threshold
    asked = judged & (tau > 0) & (tau <= 1)
    context_len = s.max_model_len - s.suffix_len - batch.cached_len  # [R] longest judgeable prefix
    bounds: list[np.ndarray] = []
    for k in range(R):
        # Boundaries within what token-level acceptance took need no judgment:
        # those tokens are the target's own and are taken either way.
        b = (
            s.rule.select(
                batch.draft_of(k)[: text_len[k]], after=int(l_tok[k]), offset=int(offset[k]), holistic=not partial[k]
            )
            if judged[k]
            else np.zeros(0, dtype=np.int64)
        )
        if batch.guard[k]:
            b = b[:0] if guard_len[k] <= l_tok[k] else b[: np.searchsorted(b, guard_len[k]) + 1]
        if asked[k]:
            b = b[b <= context_len[k]]
        if s.two_stage and b.shape[0] > 1 and asked[k]:
            b = b[-1:]  # holistic check first; earlier boundaries only if it fails
        bounds.append(b)

    # 4. Judge: a judgment is a probability, so τ <= 0 passes and τ > 1 fails every
    #    copy without a pass; only the requests in between are asked, and
    #    compared in log-odds (logit(1) = inf: τ = 1 fails every copy too).
    def ask(ks: list[int], bs: list[np.ndarray]) -> list[np.ndarray]:
        c = CopyBatch(
            req_row=np.repeat(batch.row[ks], [b.shape[0] for b in bs]),
            prefix_len=np.concatenate([batch.cached_len[k] + b for k, b in zip(ks, bs)]),
        )
        p = np.asarray(judge(c))
        return np.split(p, np.cumsum([b.shape[0] for b in bs])[:-1])

    passed = [np.full(b.shape[0], tau[k] <= 0) for k, b in enumerate(bounds)]
    ks = [k for k in range(R) if asked[k] and bounds[k].shape[0]]
    if ks:
        for k, z in zip(ks, ask(ks, [bounds[k] for k in ks])):
            passed[k] = judgment_passes(z, tau[k])
    if s.two_stage:
        failed = [k for k in ks if not passed[k][0]]
        earlier = {
            k: _earlier_bounds(s, batch, k, text_len[k], bounds[k][0], context_len[k], l_tok[k], offset[k], partial[k])
            for k in failed
        }
        earlier = {k: b for k, b in earlier.items() if b.shape[0]}
        if earlier:
            for k, z in zip(earlier, ask(list(earlier), list(earlier.values()))):
                bounds[k] = np.concatenate([earlier[k], bounds[k]])
                passed[k] = np.concatenate([judgment_passes(z, tau[k]), passed[k]])

    cu_bounds = np.concatenate([[0], np.cumsum([b.shape[0] for b in bounds])]).astype(np.int64)
    l_sem, first_fail = maximal_valid_prefix(
        np.concatenate(bounds) if R else np.zeros(0, dtype=np.int64),
        np.concatenate(passed) if R else np.zeros(0, dtype=bool),
        cu_bounds,
    )

    # 5. Accepted lengths within the cuts.
    accepted = l_tok.copy()
    rejected = np.zeros(R, dtype=bool)
    cut = np.zeros(R, dtype=bool)
    guard_cut = np.zeros(R, dtype=bool)
    for k in np.flatnonzero(judged):
        view, lt = views[k], int(l_tok[k])
        judge_passed = first_fail[k] < 0
        ls = l_c = int(l_sem[k])
        view_c = view
        if ls > lt:
            # Semantic acceptance takes tokens the rejection sampler did not:
            # they must obey the request's constraints and pass its guard.
            view_c, l_c = constrained_view(view, ls, int(allowed_len[k]))
            view, ls = constrained_view(view, ls, min(int(allowed_len[k]), int(guard_len[k])))
        accepted[k] = final_accept_len(ls, lt, view)
        # The guard cut the draft: it took fewer tokens than the judge and the
        # constraints gave, or it bounded what was judged and the judge passed
        # all of that. A draft the judge passed but a cut stopped (guard or
        # context) is not a rejection: the request keeps drafting.
        reduced = accepted[k] < final_accept_len(l_c, lt, view_c)
        bounded = bool(batch.guard[k]) and guard_len[k] < min(text_len[k], allowed_len[k] + 1)
        guard_cut[k] = reduced or (bounded and judge_passed)
        context_cut = bool(asked[k]) and context_len[k] < text_len[k]
        cut[k] = (guard_cut[k] or context_cut) and judge_passed
        # (a partial draft's tail past its last boundary is not judged yet: no rejection)
        rejected[k] = accepted[k] < text_len[k] and not cut[k] and not (partial[k] and judge_passed)
    # A part of a window that no boundary failed, nothing cut: its window goes on (taken
    # whole token-level included: the target's token after it need not be the window's).
    # One that takes nothing (the scheduler gave it fewer draft tokens than the part, none
    # past a boundary) ends its window as a cut does: a step must give the request a token.
    open_part = partial & ~rejected & ~cut & (text_len > 0)
    cut |= open_part & (accepted == 0)
    commit = open_part & (accepted > 0)
    return StepResult(
        text_len=text_len,
        accepted=accepted,
        resample=(accepted > l_tok) & ~commit,
        rejected=rejected,
        cut=cut,
        guard_cut=guard_cut,
        first_fail=first_fail,
        judged=judged,
        commit=commit,
    )


def resampled_rows(
    prefixes: dict[int, list[int]], rows: np.ndarray, tail: np.ndarray, width: int, pad: int
) -> np.ndarray:
    """[len(rows), width] the sampled tokens of the rows that take more than token-level
    acceptance: each one's accepted prefix (`prefixes` by row), then the token sampled
    after it (`tail` [len(rows)]), then `pad`."""
    new = np.full((rows.shape[0], width), pad, dtype=np.int64)
    for j, r in enumerate(rows):
        prefix = prefixes[int(r)]
        new[j, : len(prefix)] = prefix
        new[j, len(prefix)] = tail[j]
    return new


def _earlier_bounds(
    s: StepSettings,
    batch: DraftBatch,
    k: int,
    text_len: int,
    holistic: int,
    context_len: int,
    l_tok: int,
    offset: int,
    partial: bool,
):
    b = s.rule.select(batch.draft_of(k)[:text_len], after=int(l_tok), offset=int(offset), holistic=not partial)
    return b[(b < holistic) & (b <= context_len)]


def draft_views(batch: DraftBatch, vocab_size: int) -> list[DraftView]:
    """What each draft offers: its text (before a stop token, within
    max_tokens) and the stop token after it."""
    return [
        view_draft(
            batch.draft_of(k),
            batch.stop_ids[k],
            int(batch.output_len[k]),
            int(batch.max_tokens[k]),
            int(batch.min_tokens[k]),
            vocab_size=vocab_size,
        )
        for k in range(batch.num_reqs)
    ]


def draft_token_checks(batch: DraftBatch, views: list[DraftView]) -> tuple[np.ndarray, np.ndarray]:
    """`token_checks`, fetched: (guard_len [R], allowed_len [R]) on the host."""
    (checks,) = fetch(token_checks(batch, views))
    return checks[0], checks[1]


def token_checks(batch: DraftBatch, views: list[DraftView], to_device=None) -> torch.Tensor:
    """`token_checks_with_evidence` without the evidence."""
    return token_checks_with_evidence(batch, views, to_device)[0]


def token_checks_with_evidence(
    batch: DraftBatch, views: list[DraftView], to_device=None, evidence: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(checks, evidence). checks: [2, R] int64 on the logits' device, not read back: for every draft
    with text, how many leading draft tokens (text and the stop token after
    it) the token guard lets through (row 0), and how many the request's
    constraints allow (row 1). One pass over the logits, no transfer: the
    runner fetches it with the step's other inputs. `to_device` moves its
    host indices over (`transfers.HostCopies.to_device`; default uncounted).

    guard_len: every token within the target's top-`guard` at its position
    (`guard` 1 = the greedy choice exactly, argmax; the strictest guard on a
    sampling request lets none through: token-level acceptance only); no
    guard = no limit (NO_LIMIT). allowed_len: a token whose logit is -inf (the
    grammar bitmask, applied to the logits before sampling) or that
    allowed_token_ids forbid ends it; bad_words depend on the tokens before
    each position, which the sampler does not hold for draft tokens: such
    requests take none.

    Worked example: two requests checked, n = [3, 2] positions, guard [2, 0]:
        pos      [s0, s0+1, s0+2, s1, s1+1]   # logits rows, flat [Σn]
        in_guard [T,  F,    T,    T,  T   ]   # request 1 has no guard: all True
        padded   [[T, F, T], [T, T, F]]       # [R, max n], False past n
        guard_len = cumprod(padded).sum(1) = [1, NO_LIMIT (no guard)]

    evidence (with `evidence`, else None): [2, R, max n] float32 on the same device, from the
    same gathered logits rows and indices (no forward, no copy more): per draft position,
    the target's log-probability of the draft token and 1.0 where its argmax differs
    (`evidence.token_evidence`); zeros past each draft's n. The runner fetches it with the
    checks.
    """
    from parse_vllm.evidence import token_evidence

    R = batch.num_reqs
    dev = batch.logits.device
    to_device = to_device or functools.partial(fetch_to_device, dev)
    out = torch.full((2, R), NO_LIMIT, dtype=torch.int64, device=dev)
    ks = np.array([k for k in range(R) if views[k].text_len > 0], dtype=np.int64)
    if ks.shape[0] == 0:
        return out, (torch.zeros((2, R, 0), dtype=torch.float32, device=dev) if evidence else None)
    n = np.array([views[k].text_len + (views[k].stop_index == views[k].text_len) for k in ks], dtype=np.int64)
    cu_n = np.concatenate([[0], np.cumsum(n)])
    j = np.arange(cu_n[-1]) - np.repeat(cu_n[:-1], n)  # position within its draft
    req = np.repeat(np.arange(ks.shape[0]), n)  # index into ks
    top_k = batch.guard[ks][req]  # [Σn], 0 = no guard
    # Every index and flag the checks read, moved in one copy.
    pos_t, tok_t, row_t, no_words, guard_t, no_guard_pass, ks_t, guarded, req_t, j_t = to_device(
        batch.logits_start[ks][req] + j,
        batch.draft[batch.cu_draft[ks][req] + j],
        ks[req],
        batch.bad_words[ks][req],
        top_k,
        (top_k == 1) & ~batch.greedy[ks][req],  # the strictest guard on a sampling request
        ks,
        batch.guard[ks] > 0,
        req,
        j,
    )
    logits = batch.logits[pos_t]  # [Σn, vocab]
    tok_logit = logits.gather(1, tok_t[:, None])[:, 0]

    allowed = torch.isfinite(tok_logit)
    if batch.forbidden is not None:
        allowed &= ~batch.forbidden[row_t, tok_t]
    allowed &= ~no_words

    in_guard = torch.ones_like(allowed)
    if top_k.any():
        in_guard = torch.where(guard_t == 0, in_guard, guard_mask(logits, tok_t, top_k, guard_t))
        in_guard &= ~no_guard_pass  # sampling: none

    width = int(j.max()) + 1
    lens = _leading_true_lengths(torch.stack([in_guard, allowed]), req_t, j_t, ks.shape[0], width)
    out[0, ks_t] = torch.where(guarded, lens[0], NO_LIMIT)
    out[1, ks_t] = lens[1]
    ev = None
    if evidence:
        ev = torch.zeros((2, R, width), dtype=torch.float32, device=dev)
        ev[:, row_t, j_t] = token_evidence(logits, tok_t)
    return out, ev


def _leading_true_lengths(masks: torch.Tensor, req: torch.Tensor, j: torch.Tensor, R: int, width: int) -> torch.Tensor:
    """masks [M, Σn] bool, position j [Σn] (< width) of request req [Σn] of R -> [M, R]:
    the length of each request's all-True head."""
    padded = torch.zeros((masks.shape[0], R, width), dtype=torch.int64, device=masks.device)
    padded[:, req, j] = masks.long()
    return padded.cumprod(dim=2).sum(dim=2)
