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

Pure: plain numbers in, windows and reports out.
"""

from __future__ import annotations

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

    @property
    def draft(self) -> list[int]:
        return self.tokens[1:]

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
) -> tuple[np.ndarray, dict[str, OpenWindow]]:
    """Each window row's chunk added to its window: a batch row's window opens (unless its
    first chunk already completes it), an open one advances; the ones complete outside the
    batch leave `windows`. Returns the batch rows' draft lengths this step [B] (0 for a
    window left open: its request gets no draft this step) and the completed windows by
    request."""
    B = rows.num_batch
    lens = rows.wants[:B].copy()
    done: dict[str, OpenWindow] = {}
    for r, chunk in zip(rows.window_rows.tolist(), got):
        req_id = rows.req_ids[r]
        chunk = chunk[: rows.wants[r]]
        if r < B:
            window = OpenWindow(
                [int(rows.new[r][-1])], int(rows.known_len[r]) - 1, int(rows.window_len[r]), rows.stops[r]
            )
            if not window.add(chunk):
                windows[req_id] = window
                lens[r] = 0
        elif windows[req_id].add(chunk):
            done[req_id] = windows.pop(req_id)
    return lens, done
