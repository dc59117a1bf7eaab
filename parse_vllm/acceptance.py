"""How many draft tokens a request accepts in one step.

L_sem: the largest boundary b_k such that every boundary b_1..b_k passed the
judge (p_j >= τ), 0 if b_1 failed. L_tok: what vLLM's standard token-level
verification accepted (lossless). The request takes max(L_sem, L_tok) draft
tokens and then one token sampled from the target at that position.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch


def maximal_valid_prefix(
    bounds: np.ndarray,  # [C] boundaries of all copies, grouped by request
    passed: np.ndarray,  # [C] bool, judged valid
    cu_copies: np.ndarray,  # [R + 1] copy offsets per request
) -> tuple[np.ndarray, np.ndarray]:
    """Per request: (L_sem [R], index of the first failed boundary [R], -1 if
    none failed)."""
    num_reqs = cu_copies.shape[0] - 1
    l_sem = np.zeros(num_reqs, dtype=np.int64)
    first_fail = np.full(num_reqs, -1, dtype=np.int64)
    for r in range(num_reqs):
        s, e = cu_copies[r], cu_copies[r + 1]
        fails = np.flatnonzero(~passed[s:e])
        k = fails[0] if fails.shape[0] else e - s  # boundaries [0, k) all passed
        first_fail[r] = fails[0] if fails.shape[0] else -1
        l_sem[r] = bounds[s + k - 1] if k > 0 else 0
    return l_sem, first_fail


@dataclass(frozen=True)
class DraftView:
    """One request's scheduled draft, cut where it must stop."""

    text_len: int  # draft tokens that may be judged: before any stop token, within max_tokens
    stop_index: int  # index of the first stop token in the draft, -1 if none
    stop_allowed: bool  # accepting that stop token respects min_tokens


def first_stop_index(draft, stop_ids: frozenset[int]) -> int:
    """Index of the first token of `draft [d]` that ends the request, -1 if none."""
    if not stop_ids:
        return -1
    hits = np.flatnonzero(np.isin(np.asarray(draft, dtype=np.int64), np.fromiter(stop_ids, dtype=np.int64)))
    return int(hits[0]) if hits.shape[0] else -1


def cut_at_stop(draft, stop_ids: frozenset[int]) -> list[int]:
    """`draft` up to and including its first token that ends the request (all of it
    without one): what the drafter wrote after a stop token is no part of the answer. The
    one place a draft is cut there (windows, and the drafts the scheduler is given)."""
    tokens = [int(t) for t in draft]
    stop = first_stop_index(tokens, stop_ids)
    return tokens if stop < 0 else tokens[: stop + 1]


def view_draft(
    draft: np.ndarray,  # [d] as scheduled
    stop_ids: frozenset[int],
    output_len: int,  # tokens generated before this step's draft
    max_tokens: int,
    min_tokens: int,
    vocab_size: int | None = None,
) -> DraftView:
    d = int(draft.shape[0])
    # Placeholder drafts (-1: vLLM pads new one-token decodes to the spec
    # length) and out-of-vocab ids are not text: the draft ends before them.
    invalid = np.flatnonzero((draft < 0) | ((draft >= vocab_size) if vocab_size else False))
    if invalid.shape[0]:
        d = int(invalid[0])
        draft = draft[:d]
    stop_index = first_stop_index(draft, stop_ids)
    text_len = d if stop_index < 0 else stop_index
    if max_tokens > 0:
        text_len = max(0, min(text_len, max_tokens - output_len))
    # The stop token would be output token number output_len + stop_index;
    # min_tokens forbids stop tokens before index min_tokens.
    stop_allowed = stop_index >= 0 and output_len + stop_index >= min_tokens
    return DraftView(text_len=text_len, stop_index=stop_index, stop_allowed=stop_allowed)


def final_accept_len(l_sem: int, l_tok: int, view: DraftView) -> int:
    """Draft tokens taken: max(L_sem, L_tok). A draft judged valid up to its
    stop token takes the stop token too (the answer is complete)."""
    if l_sem > 0 and l_sem == view.text_len and view.stop_index == view.text_len and view.stop_allowed:
        l_sem += 1
    return max(l_sem, l_tok)


def constrained_view(view: DraftView, l_sem: int, allowed: int) -> tuple[DraftView, int]:
    """Cut a judged draft to its first `allowed` tokens (the request's
    constraints — grammar, allowed token ids — forbid the next one): L_sem
    cannot pass it, and the stop token counts only if it is allowed too."""
    if allowed > view.text_len:
        return view, l_sem
    return replace(view, stop_allowed=False), min(l_sem, allowed)


def guard_mask(
    logits: torch.Tensor, draft: torch.Tensor, top_k: int | np.ndarray, top_k_device: torch.Tensor | None = None
) -> torch.Tensor:
    """The token guard: whether each draft token is among the target's `top_k`
    tokens at its position.

    logits [n, vocab]: the target's logits at the n draft positions (row j
    predicts draft[j]); draft [n]; top_k: one k, or [n] one per position on
    the host (each >= 1), and the same on the logits' device when the caller
    has moved it already (`top_k_device`). Returns [n] bool. top_k = 1 is the
    target's greedy choice exactly (argmax, as the greedy sampler picks it);
    ties at the k-th value pass."""
    kmax = min(int(np.max(top_k)), logits.shape[-1])
    k = torch.as_tensor(top_k).to(logits.device) if top_k_device is None else top_k_device
    k = k.clamp(1, kmax).expand(draft.shape[0])  # [n]
    kth = torch.topk(logits, kmax, dim=-1).values.gather(1, (k - 1)[:, None].long())[:, 0]  # [n]
    within = logits.gather(1, draft[:, None].long())[:, 0] >= kth
    return torch.where(k == 1, logits.argmax(dim=-1) == draft, within)
