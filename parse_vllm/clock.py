"""Seconds a step spends in some of its device work (the drafter's), read without a sync.

On the CPU the work is synchronous: the host's clock around it is its time. On a GPU the host
only queues it, so each span records a pair of CUDA events, read at the next step: the drafts
are read back to the host in the step that writes them, so by then the events are done and
reading them waits for nothing.
"""

from __future__ import annotations

import contextlib
import time

import torch


class SpanClock:
    """`enabled` False: spans time nothing (an engine whose policy reads no step costs keeps
    no events)."""

    def __init__(self, device: str | torch.device = "cpu", enabled: bool = True):
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = enabled
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0

    @contextlib.contextmanager
    def span(self):
        """Time the work inside (added to what `take` returns next)."""
        if not self.enabled:
            yield
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._seconds += time.perf_counter() - t0

    def take(self) -> float:
        """Seconds inside spans since the last take."""
        seconds = self._seconds
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        self._events.clear()
        self._seconds = 0.0
        return seconds
