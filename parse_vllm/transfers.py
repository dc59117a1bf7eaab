"""The runtime's device-to-host copies, in one place, counted per engine step.

On a GPU every read of a device value on the host waits for the stream, so
the runtime reads back as little and as rarely as it can: each engine step
copies its inputs back once (`HostCopies.fetch` takes several tensors and
moves them in one transfer), then once per verification call (the judge's
P(yes)) and once when some request takes more than token-level acceptance
did (the token sampled after its accepted prefix): at most `MAX_PER_STEP`,
whatever the batch. Drafts go back through vLLM's own asynchronous copy
(GPUModelRunner._copy_draft_token_ids_to_cpu); a draft longer than
drafting.DRAFT_CHUNK reads its chunk back after each drafter call but the
last, to stop rows whose draft has ended, and the windows drafted over several
steps read their step's chunks back once (`fetch(..., drafter=True)`, counted
apart: one per extra drafter call, plus one). Tests bound both
(tests/test_offline.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# step inputs (1) + verification calls (2: two-stage judges the holistic
# boundary first, earlier ones in a second call) + the resampled tokens (1)
MAX_PER_STEP = 4


@dataclass
class StepAudit:
    """High-water marks per engine step since the last reset."""

    steps: int = 0
    host_copies_max: int = 0  # the step's own device-to-host transfers in one step (<= MAX_PER_STEP)
    drafter_calls_max: int = 0  # drafter calls in one step
    drafter_reads_max: int = 0  # the drafter's stop checks in one step (one per call after a pass's first)


class HostCopies:
    """`fetch(*tensors)`: the tensors' values on the host, in one transfer.
    `new_step()` starts an engine step's count."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.audit = StepAudit()
        self.in_step = 0  # transfers in the current step
        self.drafter_calls = 0  # drafter calls in the current step
        self.drafter_reads = 0  # the drafter's stop checks in the current step
        self._pinned = torch.empty(0)

    def new_step(self) -> None:
        a = self.audit
        a.steps += 1
        self.in_step = self.drafter_calls = self.drafter_reads = 0

    def count_drafter_call(self) -> None:
        self.drafter_calls += 1
        self.audit.drafter_calls_max = max(self.audit.drafter_calls_max, self.drafter_calls)

    def fetch(self, *tensors: torch.Tensor, drafter: bool = False) -> list[np.ndarray]:
        """`fetch`, counted (as the drafter's stop check with `drafter`), through a
        pinned buffer on a GPU."""
        a = self.audit
        if drafter:
            self.drafter_reads += 1
            a.drafter_reads_max = max(a.drafter_reads_max, self.drafter_reads)
        else:
            self.in_step += 1
            a.host_copies_max = max(a.host_copies_max, self.in_step)
        return _fetch(tensors, self._to_host)

    def _to_host(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.device.type == "cpu":
            return flat
        # Into pinned memory (kept and grown), then wait for this copy only;
        # the result is the caller's (the next fetch reuses the buffer).
        n = flat.numel()
        if self._pinned.dtype != flat.dtype or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 2 * self._pinned.numel()), dtype=flat.dtype, pin_memory=True)
        dst = self._pinned[:n]
        dst.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(flat.device).synchronize()
        return dst.clone()


def fetch(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Each tensor's values as a numpy array of its shape, in one transfer
    (uncounted: for callers outside an engine step)."""
    return _fetch(tensors, lambda flat: flat.cpu())


def _fetch(tensors, to_host) -> list[np.ndarray]:
    """Flatten the tensors into one buffer on their device (int64 when all
    are integers, else float64, which holds token ids and float32 values
    exactly), move it with `to_host`, split it back."""
    floating = any(t.is_floating_point() for t in tensors)
    dtype = torch.float64 if floating else torch.int64
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors]) if tensors else torch.zeros(0, dtype=dtype)
    host = to_host(flat).numpy()
    out, at = [], 0
    for t in tensors:
        n = t.numel()
        part = host[at : at + n].reshape(tuple(t.shape))
        out.append(part if t.is_floating_point() else part.astype(np.int64, copy=False))
        at += n
    return out
