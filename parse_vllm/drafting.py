"""Which requests the drafter runs over this step, and over which tokens.

vLLM's draft-model proposer runs for the whole batch at one window: its first
pass consumes every request's new tokens (to keep the draft's KV in sync),
then it drafts W tokens for every request. Under continuous batching that
makes a request long past its rejection pay W draft steps whenever any
other request drafts. Here the drafter runs only over the requests that draft
this step, at their own length; a request skipped for a while (a rejection in
`redraft` mode, a new request waiting for its turn) catches up when it drafts
next: its pass starts where its draft KV ends (`draft_kv_len`), so the pass is
a prefill of what it missed.

A row's span is the tokens [start, end] the drafter writes KV for, where
`end` is the position of the row's last known token (the one the target just
sampled); the draft continues after it. After the pass the draft's KV is
valid below `end` (the token at `end` is passed again next time, like vLLM's
own first pass does).

Worked example, capacity 10 tokens per pass, window 4, spec_tokens 0:

    row  draft_kv_len  known_len  wants
    0    10            13         4      # drafting: span [10, 12], 3 tokens
    1    0             6          4      # new, or back from rewriting: [0, 5]
    2    20            22         0      # past its rejection: not in any pass
    3    5             18         2      # catch-up longer than a pass: [5, 17]

    passes:
      catch-up   row [3]     start [5]       end [14]      num_draft 0
      draft 4    row [0, 1]  start [10, 0]   end [12, 5]   num_draft 4
      draft 2    row [3]     start [14]      end [17]      num_draft 2
    draft_kv_len after: row 0 -> 12, row 1 -> 5, row 2 stays 20, row 3 -> 17

Rows wanting different lengths share a pass when their lengths round up to
the same bucket (the next power of two, or exactly `window` and
`spec_tokens`); a row drafts its bucket's length and keeps what it wanted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Draft tokens per drafter call. A pass drafting more makes several calls, and
# between calls the rows whose draft has ended (a stop token, or as many as the
# row wants) stop: a window is not drafted on past the end of the answer. Each
# later call passes each row's last two draft tokens again (the first one's KV
# is the drafter's own; the second is where drafting continues).
DRAFT_CHUNK = 16


@dataclass
class DrafterPass:
    """One call of the drafter over some rows of the batch."""

    row: np.ndarray  # [G] input-batch rows
    start: np.ndarray  # [G] first position of each row's span
    end: np.ndarray  # [G] last position (the token drafting continues from)
    num_draft: int  # draft tokens each row gets (0: catch-up only)

    @property
    def num_tokens(self) -> int:
        return int((self.end - self.start + 1).sum())


def bucket(n: int, window: int, spec_tokens: int) -> int:
    """The draft length a pass runs for a row that wants n tokens."""
    if n <= 0 or n in (window, spec_tokens):
        return max(n, 0)
    return min(window, 1 << (n - 1).bit_length())


def plan_passes(
    wants: np.ndarray,  # [B] draft tokens each row wants this step (0: none)
    draft_kv_len: np.ndarray,  # [B] leading positions whose draft KV is valid
    known_len: np.ndarray,  # [B] tokens the row has after this step
    *,
    window: int,
    spec_tokens: int,
    max_tokens: int,  # tokens per pass (the drafter's buffers)
    max_rows: int,  # rows per pass
) -> tuple[list[DrafterPass], np.ndarray]:
    """The drafter's passes for this step and every row's `draft_kv_len`
    after them."""
    if max_tokens < 2:
        raise ValueError(f"a drafter pass needs room for at least 2 tokens, got {max_tokens}")
    kv_len = draft_kv_len.astype(np.int64).copy()
    end = known_len.astype(np.int64) - 1
    drafting = np.flatnonzero(wants > 0)
    passes: list[DrafterPass] = []

    # Catch-up: spans longer than a pass are synced in chunks first.
    chunks: list[tuple[int, int, int]] = []  # (row, start, end)
    for r in drafting:
        while end[r] - kv_len[r] + 1 > max_tokens:
            chunks.append((int(r), int(kv_len[r]), int(kv_len[r]) + max_tokens - 1))
            kv_len[r] += max_tokens - 1
    passes += _pack(chunks, 0, max_tokens, max_rows)

    by_len: dict[int, list[tuple[int, int, int]]] = {}
    for r in drafting:
        by_len.setdefault(bucket(int(wants[r]), window, spec_tokens), []).append((int(r), int(kv_len[r]), int(end[r])))
    for n in sorted(by_len, reverse=True):
        passes += _pack(by_len[n], n, max_tokens, max_rows)
    kv_len[drafting] = end[drafting]
    return passes, kv_len


def _pack(spans: list[tuple[int, int, int]], num_draft: int, max_tokens: int, max_rows: int) -> list[DrafterPass]:
    """Spans (row, start, end) into passes of at most max_tokens tokens and max_rows rows, in order."""
    passes, current, used = [], [], 0
    for span in spans:
        n = span[2] - span[1] + 1
        if current and (used + n > max_tokens or len(current) == max_rows):
            passes.append(_as_pass(current, num_draft))
            current, used = [], 0
        current.append(span)
        used += n
    if current:
        passes.append(_as_pass(current, num_draft))
    return passes


def _as_pass(spans: list[tuple[int, int, int]], num_draft: int) -> DrafterPass:
    a = np.array(spans, dtype=np.int64).reshape(-1, 3)
    return DrafterPass(row=a[:, 0], start=a[:, 1], end=a[:, 2], num_draft=num_draft)


def credit_drafted_kv(draft_kv_len: np.ndarray, draft_ahead: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """Each row's valid draft KV after a step that took `accepted` [B] draft tokens, when
    the drafter had written `draft_ahead` [B] positions past `draft_kv_len` [B] while
    drafting them (its KV of the draft tokens it was given, all but the last one drafted).
    Worked example: draft_kv_len 40 (the last known token at 40), 16 drafted (KV written
    for 41..55: ahead 15), 9 accepted then one target token at 50: valid up to 49, so 49
    (the token at 49 is passed again, as at 40 before)."""
    return draft_kv_len + np.minimum(draft_ahead, np.maximum(accepted, 0))


def draft_lengths(
    wants: np.ndarray,  # [B] draft tokens each row's phase asks for (0: none)
    known_len: np.ndarray,  # [B] tokens the row has after this step
    tokens_left: np.ndarray,  # [B] output tokens its max_tokens still allows after this step's
    max_len: int,  # the context: a token's position must stay below it
    prefilling: np.ndarray,  # [B] bool: the prompt is still being prefilled
    ended: np.ndarray | None = None,  # [B] bool: this step's tokens end the answer (ends_answer)
) -> np.ndarray:
    """Draft tokens each row gets this step: none where they could not be
    taken (a prompt still being prefilled, past max_tokens, an answer that
    just ended), and no more than the row's own room in the context (never a
    neighbour's)."""
    n = np.minimum(np.minimum(wants, tokens_left), max_len - known_len)
    n[prefilling] = 0
    if ended is not None:
        n[ended] = 0
    return np.maximum(n, 0)


def ends_answer(new: np.ndarray, stops: frozenset[int]) -> bool:
    """Whether the tokens a row gained this step end its answer: vLLM's
    check_stop ends a request at a stop token (EOS, stop_token_ids) before it
    looks at min_tokens, whose logits processor keeps them from being sampled
    early. (A row judged ended that goes on only skips one step's draft.)"""
    return any(int(t) in stops for t in new)


def pass_spans(
    dp: DrafterPass,
    tokens: np.ndarray,  # [max_reqs, max_len] the batch's token ids as of the step's start
    committed: np.ndarray,  # [B] tokens per row as of the step's start
    new: list[np.ndarray],  # [B] x [n] the tokens each row gained this step
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of each of the pass's spans, packed [Σ L], and their
    offsets cu [G + 1]. A row's positions below `committed` are in `tokens`,
    the rest are this step's `new` tokens. Worked example: committed 5, new
    [7, 8] (the row now has 7 tokens), span [4, 6]: tokens[4], 7, 8."""
    span = [
        np.concatenate(
            [tokens[r, s : min(e + 1, committed[r])], new[r][max(0, s - committed[r]) : max(0, e + 1 - committed[r])]]
        )
        for r, s, e in zip(dp.row, dp.start, dp.end)
    ]
    cu = np.concatenate([[0], np.cumsum([t.shape[0] for t in span])]).astype(np.int64)
    return np.concatenate(span).astype(np.int64) if span else np.zeros(0, dtype=np.int64), cu
