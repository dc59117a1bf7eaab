"""Windows drafted over several engine steps, and what the scheduler is told after a step.

A window longer than `draft_chunk` is drafted over several engine steps, at most
`draft_chunk` tokens each (`OpenWindow`): the step it starts in drafts the first chunk, and
until it is complete (W tokens, a stop token, or as many as max_tokens and the context
allow) its request stays out of the target's batch (the scheduler holds it, `StepReport`)
while the drafter advances it beside the other requests, each step or, when no request is
scheduled, in a step of its own. Its span each step is its last two draft tokens (the first
one's KV is the drafter's own and is passed again, the second is where drafting continues).
Worked example, W 20, chunk 8, the request's last known token x at position 50:

    step  span (positions)   drafts        window
    t     catch-up .. 50     d1..d8        open, 8 of 20 (the request leaves the batch)
    t+1   [57, 58] = d7 d8   d9..d16       open, 16 of 20
    t+2   [65, 66]           d17..d20      complete: d1..d20 is the request's
                                           draft, judged in the next target step

Chunked judging (`judge_chunks`): a window need not wait to be complete. Once the part
drafted and not yet taken holds a boundary short of its end (`ready`), that part goes to
the target as the request's draft (the window *judging*: released by the scheduler, not
drafted on); the step judges the boundaries within it, the last chunk's end excluded
(step.py, `DraftBatch.partial`). If all pass, the request takes the prefix up to the last
one, or what token-level acceptance took if longer, and nothing of the target's
(`commit`): the window goes on from there, drafting its next chunk. The first failing
boundary ends it, as it would have ended the whole window (the maximal valid prefix is a
first-failure rule, and a boundary's judgment reads only the tokens before it), so a
rejected window throws away at most what was drafted since its last judgment instead of
the rest of W. Worked example, W 20, chunk 8, a sentence end after d6 and d14:

    step  drafts        window                       target
    t     d1..d8        open, 8 of 20; holds b=6     -
    t+1   -             judging d1..d8               b=6 passes: d1..d6 taken
    t+1   d9..d16       open: d7..d16 (b=14 -> 8)    -
    t+2   -             judging d7..d16              b=8 fails: d7.. rejected, the
                                                     target's token after d6

Pure: plain numbers in, windows and reports out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from parse_vllm.acceptance import cut_at_stop


@dataclass
class OpenWindow:
    """A window drafted over several engine steps (module docstring)."""

    tokens: list[int]  # the request's last known token, then the draft so far
    start: int  # the position of tokens[0]
    length: int  # draft tokens the window is to hold
    stops: frozenset[int]  # the token ids that end the request
    judging: bool = False  # its draft is out to the target for judgment (chunked judging)
    complete: bool = False  # drafted to its end (W, a stop token, its room)
    taken: int = 0  # draft tokens the request took of it so far (chunked judging)
    prev: int = -1  # after a commit, the token before tokens[0] (a drafter span needs two tokens)

    @property
    def draft(self) -> list[int]:
        return self.tokens[1:]

    def commit(self, n: int) -> None:
        """The request took the draft's first n tokens (a chunk's judgment passed): the
        window goes on after them."""
        if not 0 < n <= len(self.draft):
            raise ValueError(f"a window of {len(self.draft)} draft tokens cannot commit {n}")
        self.prev = self.tokens[n - 1]
        self.tokens = self.tokens[n:]
        self.start += n
        self.length -= n
        self.taken += n
        self.judging = False

    @property
    def chunk_left(self) -> int:
        """Draft tokens the window still wants."""
        return self.length - len(self.draft)

    def add(self, chunk) -> bool:
        """Append a step's chunk, up to its first stop token; whether the window is now
        complete."""
        kept = cut_at_stop(chunk, self.stops)
        self.tokens += kept
        return (bool(kept) and kept[-1] in self.stops) or len(self.draft) >= self.length


@dataclass
class StepReport:
    """What the runner tells the scheduler after a step (on the model runner's output):
    every request's draft for its next step (the batch's drafts, and the windows that
    completed outside the batch), and the requests whose window is still open (held out of
    the next step). The one way drafts reach the scheduler."""

    drafts: dict[str, list[int]] = field(default_factory=dict)
    open: frozenset[str] = frozenset()


def advance_windows(
    rows,  # drafting.DraftRows of the step
    got: np.ndarray,  # [len(rows.window_rows), n] this step's drafts of the window rows, in that order
    windows: dict[str, OpenWindow],  # the open windows, updated
    ready: Callable[[str, OpenWindow], bool] | None = None,  # chunked judging: (request, window) -> judge it now
) -> tuple[np.ndarray, dict[str, OpenWindow]]:
    """Each window row's chunk added to its window: a batch row's window opens (unless its
    first chunk already completes it), an open one advances; the ones complete outside the
    batch leave `windows`. With `ready` (chunked judging) a window complete, or whose draft
    is `ready` to be judged, stays in `windows`, judging. Returns the batch rows' draft
    lengths this step [B] (0 for a window left open: its request gets no draft this step)
    and the windows whose draft goes to the target next, by request."""
    B = rows.num_batch
    lens = rows.wants[:B].copy()
    out: dict[str, OpenWindow] = {}
    for r, chunk in zip(rows.window_rows.tolist(), got):
        req_id = rows.req_ids[r]
        chunk = chunk[: rows.wants[r]]
        if r < B:
            window = OpenWindow(
                [int(rows.new[r][-1])], int(rows.known_len[r]) - 1, int(rows.window_len[r]), rows.stops[r]
            )
        else:
            window = windows[req_id]
        window.complete = window.add(chunk)
        # Judged now, the window kept: a part of it, or its rest after a part was taken (its
        # boundaries counted from the window's start, its accounting the whole window's).
        if ready is not None and (window.taken or not window.complete) and (window.complete or ready(req_id, window)):
            window.judging = True
            windows[req_id] = out[req_id] = window
            if r < B:
                lens[r] = len(window.draft)
        elif window.complete:
            if r >= B:  # (a batch row's whole window is its draft this step, as any draft)
                out[req_id] = windows.pop(req_id)
        else:
            windows[req_id] = window
            if r < B:
                lens[r] = 0
    return lens, out
