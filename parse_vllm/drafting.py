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
A shorter bucket also joins a longer one at most twice its length, for the
rows with room for the longer draft (`room`: a window's chunk joins the
token-level drafts' pass): a pass costs one drafter forward per token
whatever its rows, nearly all of it reading the weights, so a separate pass
of s tokens costs s forwards, and joining costs a few more rows in forwards
that run anyway. A joining row that finds the longer pass full drafts its
own length in a pass of its own. In the example above, with room
[4, 4, 0, 4] row 3 may draft 4: at capacity 10 the pass of 4 is full (9
tokens) and the passes stay as they are; at capacity 24 there is no catch-up
and one pass, draft 4 over rows [0, 1, 3], row 3 keeping 2 of its 4.

A window longer than `draft_chunk` is drafted over several engine steps
(windows.py): its rows join the step's rows (`DraftRows`) and the drafter
advances them with the rest.

A pass drafting more than TOKENS_PER_DRAFTER_CALL tokens calls the drafter
several times (`run_passes`); between calls the rows whose draft has ended (a
stop token, or as many as the row wants) leave, so a window is not drafted on
past the end of the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from parse_vllm.acceptance import first_stop_index

if TYPE_CHECKING:
    from parse_vllm._vllm.batch import BatchView
    from parse_vllm.windows import OpenWindow

# Draft tokens per drafter call (not the `draft_chunk` option: tokens a window advances per
# engine step, over as many calls as it takes). Each later call of a pass passes each
# row's last two draft tokens again (the first one's KV is the drafter's own; the second is
# where drafting continues).
TOKENS_PER_DRAFTER_CALL = 16


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
    room: np.ndarray | None = None,  # [B] the most draft tokens each row may be given (None: wants)
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
    own = {r: n for n, spans in by_len.items() for r, _, _ in spans}
    by_len = _join_shorter(by_len, wants if room is None else room)
    for n in sorted(by_len, reverse=True):
        for dp in _pack(by_len[n], n, max_tokens, max_rows):
            # a pass of joining rows alone (the longer pass was full) drafts their own length
            dp.num_draft = max(own[int(r)] for r in dp.row)
            passes.append(dp)
    kv_len[drafting] = end[drafting]
    return passes, kv_len


def _join_shorter(by_len: dict[int, list[tuple[int, int, int]]], room: np.ndarray) -> dict[int, list]:
    """Spans by draft length, each shorter length's rows moved to the longest length at most
    twice theirs, where their `room` holds it (module docstring)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    longer: int | None = None  # the length shorter ones join
    for n in sorted(by_len, reverse=True):
        spans = by_len[n]
        if longer is not None and n > 0 and longer <= 2 * n:
            joining = [sp for sp in spans if room[sp[0]] >= longer]
            out[longer] += joining
            spans = [sp for sp in spans if room[sp[0]] < longer]
            if not spans:
                continue
        out[n] = spans
        longer = n
    return out


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
    committed: np.ndarray,  # [N] tokens per row in `tokens` (DraftRows)
    new: list[np.ndarray],  # [N] x [n] each row's known tokens after them
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of each of the pass's spans, packed [Σ L], and their
    offsets cu [G + 1]. A row's positions below `committed` are in `tokens`,
    the rest are this step's `new` tokens. Worked example: committed 5, new
    [7, 8] (the row now has 7 tokens), span [4, 6]: tokens[4], 7, 8."""
    span = [
        np.concatenate(
            [
                tokens[r, s : min(e + 1, committed[r])] if s < committed[r] else tokens[:0, 0],
                new[r][max(0, s - committed[r]) : max(0, e + 1 - committed[r])],
            ]
        )
        for r, s, e in zip(dp.row, dp.start, dp.end)
    ]
    cu = np.concatenate([[0], np.cumsum([t.shape[0] for t in span])]).astype(np.int64)
    return np.concatenate(span).astype(np.int64) if span else np.zeros(0, dtype=np.int64), cu


@dataclass
class RowStates:
    """What the controller says of each batch row before drafting, [B] each."""

    wants: np.ndarray  # draft tokens the row's phase asks for from the draft model (0: none)
    judging: np.ndarray  # bool: the row drafts windows the judge reads
    kv_len: np.ndarray  # leading positions whose draft KV is valid
    ahead: np.ndarray  # positions past kv_len the drafter wrote while drafting its last draft


@dataclass
class DraftRows:
    """The rows the drafter may run over in one engine step: the input batch's
    B rows, then the O open windows (requests outside the batch). A row's
    known tokens are `tokens[row, :committed]` (the batch's token ids as of
    the step's start; open windows have none there) then `new[row]` (the
    row's tokens of this step; an open window's last known token and draft).
    Worked example, B 1, O 1: row 0 committed 30, new [a, b] (32 tokens
    known); row 1, a window opened at position 50 with 8 drafted: committed
    50, new [x, d1..d8] (59 known: its span is d7 d8 at 57, 58)."""

    req_ids: list[str]  # [B + O]
    wants: np.ndarray  # [B + O] draft tokens this step (0: none)
    kv_len: np.ndarray  # [B + O] leading positions whose draft KV is valid
    committed: np.ndarray  # [B + O]
    new: list[np.ndarray]  # [B + O]
    stops: list[frozenset[int]]  # [B + O] the token ids that end each request
    window_len: np.ndarray  # [B + O] draft tokens of a window opening this step in chunks (0: none)
    num_batch: int  # B
    # [B + O] the most draft tokens each row may be given this step (a window's tokens still
    # to draft; `wants` elsewhere): a row with room may draft in a longer pass (plan_passes)
    room: np.ndarray | None = None

    @property
    def known_len(self) -> np.ndarray:
        return self.committed + np.array([t.shape[0] for t in self.new], dtype=np.int64)

    @property
    def window_rows(self) -> np.ndarray:
        """Rows whose window advances in chunks this step: opening, then open."""
        opening = np.flatnonzero(self.window_len > 0)
        return np.concatenate([opening, np.arange(self.num_batch, len(self.req_ids))]).astype(np.int64)


def step_rows(
    view: BatchView,  # the step's batch
    states: RowStates,  # [B]
    new: list[np.ndarray],  # [B] this step's accepted draft tokens, then the sampled one
    windows: dict[str, OpenWindow],  # the open windows (requests outside the batch)
    *,
    max_len: int,  # the context: a token's position must stay below it
    chunk: int,  # draft_chunk (0: whole windows)
) -> DraftRows:
    """This step's DraftRows: each batch row's draft length within its own
    limits (`draft_lengths`), windows longer than `chunk` cut to their first
    chunk, then each open window's next chunk."""
    new_len = np.array([t.shape[0] for t in new], dtype=np.int64)
    known_len = view.num_tokens + new_len
    # The drafter's own KV of the draft tokens this step accepted stays valid.
    kv_len = credit_drafted_kv(states.kv_len, states.ahead, new_len - 1)
    n = draft_lengths(
        states.wants,
        known_len,
        view.max_tokens - view.output_len - new_len,
        max_len,
        view.prefilling,
        # A row whose tokens of this step end its answer is finished: a draft
        # for it would never be judged.
        np.array([ends_answer(t, s) for t, s in zip(new, view.stops)], dtype=bool),
    )
    window_len = np.where(states.judging & (chunk > 0) & (n > chunk), n, 0)
    n = np.where(window_len > 0, chunk, n)
    batch = DraftRows(
        req_ids=list(view.req_ids),
        wants=n.astype(np.int64),
        kv_len=kv_len.astype(np.int64),
        committed=view.num_tokens.astype(np.int64),
        new=list(new),
        stops=list(view.stops),
        window_len=window_len.astype(np.int64),
        num_batch=view.num_reqs,
        room=np.where(window_len > 0, window_len, n).astype(np.int64),
    )
    return with_open_windows(batch, windows, chunk)


def window_rows(windows: dict[str, OpenWindow], chunk: int) -> DraftRows:
    """The DraftRows of a step with no batch rows: the open windows alone."""
    none = np.zeros(0, dtype=np.int64)
    empty = DraftRows([], none, none, none, [], [], none, 0)
    return with_open_windows(empty, windows, chunk)


def with_open_windows(rows: DraftRows, windows: dict[str, OpenWindow], chunk: int) -> DraftRows:
    """`rows` followed by each open window's next chunk (its span: its last two tokens; a
    window whose judged part was all taken has one, its last known token, and the token
    before it goes first)."""
    opened = list(windows.values())
    # tokens known before each window's span: its start, less the one before it where its draft is empty
    before = [w.start - 1 if not w.draft and w.prev >= 0 else w.start for w in opened]
    room = rows.wants if rows.room is None else rows.room
    return DraftRows(
        req_ids=rows.req_ids + list(windows),
        wants=np.concatenate([rows.wants, [min(chunk, w.chunk_left) for w in opened]]).astype(np.int64),
        kv_len=np.concatenate(
            [rows.kv_len, [w.start + len(w.draft) - 1 if w.draft else s for s, w in zip(before, opened)]]
        ).astype(np.int64),
        committed=np.concatenate([rows.committed, before]).astype(np.int64),
        new=rows.new
        + [np.array(([w.prev] if s < w.start else []) + w.tokens, dtype=np.int64) for s, w in zip(before, opened)],
        stops=rows.stops + [w.stops for w in opened],
        window_len=np.concatenate([rows.window_len, np.zeros(len(opened))]).astype(np.int64),
        num_batch=rows.num_batch,
        room=np.concatenate([room, [w.chunk_left for w in opened]]).astype(np.int64),
    )


@dataclass
class Drafter:
    """The drafter as `run_passes` calls it (the runner binds vLLM's proposer). Each call
    returns the drafts [G, n] on the device and the rows they belong to ([G] on the device).
      first(i, n)   pass i's first call, over its staged spans, drafting n tokens (n 0:
                    only the spans' draft KV is written)
      more(rows, keep, prev, start, n)
                    a later call, for the pass's rows still drafting (`rows` [G']): each
                    one's last two draft tokens so far, from `prev` (the previous call's
                    drafts) at indices `keep` [G'], the first at position `start` [G']
      fetch(ids)    the drafts on the host, for the stop checks between calls"""

    first: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    more: Callable[[np.ndarray, np.ndarray, torch.Tensor, np.ndarray, int], tuple[torch.Tensor, torch.Tensor]]
    fetch: Callable[[torch.Tensor], np.ndarray]


@dataclass
class PassesRun:
    """What `run_passes` did: the drafts, and the drafter calls it made."""

    drafts: torch.Tensor  # [N, longest] on the device, N = rows of the step (DraftRows)
    calls: int = 0
    call_rows: int = 0  # Σ rows over the calls
    call_tokens: int = 0  # Σ tokens the calls wrote draft KV for (spans, or two draft tokens a row)
    forwards: int = 0  # the drafter's sequential forwards (a call drafting n tokens makes n; a catch-up, 1)
    drafted: int = 0  # Σ rows x tokens drafted


def run_passes(
    passes: list[DrafterPass],
    drafter: Drafter,
    wants: np.ndarray,  # [N] draft tokens each row wants
    stops: list[frozenset[int]],  # [N]
    num_rows: int,  # N
    device,
) -> PassesRun:
    """Every pass of the step, each drafting its bucket's length in calls of at most
    TOKENS_PER_DRAFTER_CALL tokens, the rows whose draft ended (a stop token, or all they
    want) leaving between calls: one read of each call's drafts but the last."""
    longest = max((dp.num_draft for dp in passes), default=0)
    run = PassesRun(torch.zeros((num_rows, longest), dtype=torch.int64, device=device))
    for i, dp in enumerate(passes):
        active = np.arange(dp.row.shape[0])  # rows of the pass still drafting
        done = 0
        n = min(TOKENS_PER_DRAFTER_CALL, dp.num_draft)
        ids, rows_t = drafter.first(i, n)
        run.call_tokens += int((dp.end - dp.start).sum()) + active.shape[0]
        while True:
            run.calls += 1
            run.call_rows += int(active.shape[0])
            run.forwards += max(n, 1)
            run.drafted += n * int(active.shape[0])
            if n == 0:
                break
            run.drafts[rows_t, done : done + n] = ids
            done += n
            if done >= dp.num_draft:
                break
            got = drafter.fetch(ids)
            going = [
                g for g, r in enumerate(dp.row[active]) if done < wants[r] and first_stop_index(got[g], stops[r]) < 0
            ]
            if not going:
                break
            active = active[going]
            n = min(TOKENS_PER_DRAFTER_CALL, dp.num_draft - done)
            ids, rows_t = drafter.more(dp.row[active], np.array(going), ids, dp.end[active] + done - 1, n)
            run.call_tokens += 2 * active.shape[0]
    return run
