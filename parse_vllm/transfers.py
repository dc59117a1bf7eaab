"""The runtime's copies between host and device, in one place, counted per engine step.

On a GPU every read of a device value on the host waits for the stream, so
the runtime reads back as little and as rarely as it can: each engine step
copies its inputs back once (`HostCopies.fetch` takes several tensors and
moves them in one transfer), then once per verification call (the judge's
P(yes)) and once when some request takes more than token-level acceptance
did (the token sampled after its accepted prefix): at most `MAX_PER_STEP`,
whatever the batch. Drafts go back through vLLM's own asynchronous copy
(GPUModelRunner._copy_draft_token_ids_to_cpu); a draft longer than
drafting.TOKENS_PER_DRAFTER_CALL reads its drafts back after each drafter call but the
last, to stop rows whose draft has ended, and the windows drafted over several
steps read their step's chunks back once (`fetch(..., drafter=True)`, counted
apart: one per extra drafter call, plus one). Tests bound both
(tests/test_offline.py).

The other way, every host array the step sends to the device goes through
`HostCopies.to_device`: packed into one buffer per call, pinned, copied with
`non_blocking=True`. From pageable memory a copy waits for the stream (a hidden
synchronisation, like a read-back); from pinned memory it is queued and the
host goes on. The audit counts the staged copies, and, when asked
(`watching`), any copy of PARSE's own code that bypasses them
(`PageableCopyCounter`): tests hold that at zero.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

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
    host_to_device_max: int = 0  # staged host-to-device copies (`to_device`) in one step
    pageable_copies_max: int = 0  # host-to-device moves of PARSE's code outside `to_device` (when watched)
    pageable_sites: tuple[str, ...] = ()  # where they were made (module:line)


class HostCopies:
    """`fetch(*tensors)`: the tensors' values on the host, in one transfer.
    `new_step()` starts an engine step's count."""

    def __init__(self, device: torch.device, watch_pageable: bool = False):
        self.device = torch.device(device)
        self.audit = StepAudit()
        self.in_step = 0  # transfers in the current step
        self.drafter_calls = 0  # drafter calls in the current step
        self.drafter_reads = 0  # the drafter's stop checks in the current step
        self.to_device_calls = 0  # staged host-to-device copies in the current step
        self._pinned = torch.empty(0)
        self.pageable = PageableCopyCounter(self.device, self._count_pageable) if watch_pageable else None

    def new_step(self) -> None:
        a = self.audit
        a.steps += 1
        self.in_step = self.drafter_calls = self.drafter_reads = self.to_device_calls = 0
        if self.pageable is not None:
            self.pageable.count = 0

    def take_audit(self) -> StepAudit:
        """The audit so far; counting starts again."""
        audit, self.audit = self.audit, StepAudit()
        if self.pageable is not None:
            self.pageable.sites.clear()
        return audit

    def watching(self):
        """A context in which PARSE's host-to-device copies outside `to_device` are counted
        (a no-op unless this HostCopies watches them)."""
        if self.pageable is None or self.pageable.active:  # (hooks run inside other hooks)
            return contextlib.nullcontext()
        return self.pageable

    def to_device(self, *arrays) -> list[torch.Tensor]:
        """Host arrays (numpy, or lists of numbers) on the device, each with its shape and
        dtype, in one copy from pinned memory that the host does not wait for. Counted."""
        self.to_device_calls += 1
        self.audit.host_to_device_max = max(self.audit.host_to_device_max, self.to_device_calls)
        return to_device(self.device, *arrays)

    def _count_pageable(self, count: int) -> None:
        self.audit.pageable_copies_max = max(self.audit.pageable_copies_max, count)
        self.audit.pageable_sites = tuple(sorted(self.pageable.sites))

    def count_drafter_calls(self, n: int = 1) -> None:
        self.drafter_calls += n
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

    def fetch_one(self, tensor: torch.Tensor, drafter: bool = False) -> np.ndarray:
        """`fetch` of one tensor."""
        return self.fetch(tensor, drafter=drafter)[0]

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


def to_device(device: torch.device, *arrays) -> list[torch.Tensor]:
    """`HostCopies.to_device`, uncounted. The arrays are packed into one int64 buffer (or
    float64 when any is floating: it holds int64 token ids below 2**53 and float32 values
    exactly), which on a GPU is pinned (vLLM's caching host allocator keeps it until the
    copy is done) and copied with non_blocking=True; the device views are cast back."""
    device = torch.device(device)
    parts = [np.asarray(a) for a in arrays]
    floating = any(p.dtype.kind == "f" for p in parts)
    flat_np = (
        np.concatenate([p.reshape(-1).astype(np.float64 if floating else np.int64) for p in parts])
        if parts
        else np.zeros(0, np.int64)
    )
    flat = torch.from_numpy(flat_np)
    if device.type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for p in parts:
        n = p.size
        dtype = torch.from_numpy(np.zeros(0, dtype=p.dtype)).dtype
        out.append(flat[at : at + n].view(p.shape).to(dtype))
        at += n
    return out


class PageableCopyCounter(TorchFunctionMode):
    """Counts, while active, the host-to-device moves that PARSE's own code (modules under
    parse_vllm, but this one) makes outside `to_device`: `.to(device)`, `.cuda()`,
    `torch.as_tensor(..., device=)`, `torch.tensor(..., device=)`, and on a GPU a copy_ or
    an index from a CPU tensor that is not pinned. vLLM's own code, called from PARSE's
    hooks, is not counted. On a CPU host and device are one, so every explicit move to the
    device counts: what would be a pageable copy on a GPU."""

    _MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.as_tensor, torch.tensor)
    _IMPLICIT = (torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__)

    def __init__(self, device: torch.device, on_count=None):
        super().__init__()
        self.device = torch.device(device)
        self.count = 0  # since the last reset (a step's start)
        self.on_count = on_count
        self.active = False
        self.sites: set[str] = set()  # module:line of every counted move, for the audit's report

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in self._MOVES or func in self._IMPLICIT) and self._moves_host_data(func, args, kwargs):
            site = _parse_caller()
            if site is not None:
                self.count += 1
                self.sites.add(site)
                if self.on_count is not None:
                    self.on_count(self.count)
        return func(*args, **kwargs)

    def _on_device(self, target) -> bool:
        if isinstance(target, torch.Tensor):
            target = target.device
        if isinstance(target, (str, torch.device)):
            try:
                return torch.device(target).type == self.device.type
            except (RuntimeError, TypeError):
                return False
        return False

    def _host(self, t) -> bool:
        """A host tensor that a copy to the device would have to wait for."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return False
        return self.device.type == "cpu" or not t.is_pinned()

    def _moves_host_data(self, func, args, kwargs) -> bool:
        if func in (torch.as_tensor, torch.tensor):
            return self._on_device(kwargs.get("device"))
        if func is torch.Tensor.cuda:
            return self._host(args[0])
        if func is torch.Tensor.to:
            if kwargs.get("non_blocking") and self.device.type != "cpu" and args[0].is_pinned():
                return False
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            return self._host(args[0]) and self._on_device(target) and (self.device.type != "cpu" or target is not None)
        if self.device.type == "cpu":
            return False  # copy_ and indexing cannot be told apart from device work on a CPU
        if func is torch.Tensor.copy_:
            return args[0].device.type != "cpu" and self._host(args[1]) and not kwargs.get("non_blocking")
        # indexing a device tensor with host index tensors (an implicit copy)
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        return args[0].device.type != "cpu" and any(self._host(i) and i.numel() > 1 for i in items)


def _parse_caller() -> str | None:
    """module:line of the first caller outside torch when it is PARSE code (other than this
    module); None otherwise."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch"):
        frame = frame.f_back
    name = "" if frame is None else frame.f_globals.get("__name__", "")
    if name.startswith("parse_vllm") and name != __name__:
        return f"{name}:{frame.f_lineno}"
    return None


def watched(hook):
    """A model-runner hook whose host-to-device copies are watched when the engine audits
    them (parse.audit_transfers: `PageableCopyCounter`); `self.parse` is its controller."""

    @functools.wraps(hook)
    def run(self, *args, **kwargs):
        with self.parse.host.watching() if self.parse is not None else contextlib.nullcontext():
            return hook(self, *args, **kwargs)

    return run
