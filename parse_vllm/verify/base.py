"""The verification pass's contract and what both verifiers share.

`Verifier.judge(CopyBatch) -> Judgments`: every (request, boundary) copy of
the verification suffix judged by the target in one forward (or a few, when
one would not fit). Copy c sees the first `prefix_len[c]` cached tokens of
its request (prompt + output + draft up to its boundary, already in the paged
cache from this step's forward) and then its own suffix tokens, causally, at
positions prefix_len[c] .. prefix_len[c] + L - 1; the suffix's KV is scratch.

Worked example, two requests at input-batch rows 0 and 3, with 12 and 40
cached tokens before their drafts and boundaries [4, 9] and [6]:
    req_row     [0, 0, 3]
    prefix_len  [16, 21, 46]    # cached + b
Implementations: `forked.ForkedBlockTableVerifier` (vLLM's own paged
attention over forked block tables; the CPU path and the GPU fallback) and
`kernel.KernelVerifier` (the fused prefix-verify op, GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from parse_vllm import transfers
from parse_vllm.templates import LabelScoring


@dataclass
class CopyBatch:
    """The copies of one verification pass, packed."""

    req_row: np.ndarray  # [C] input-batch row of each copy's request
    prefix_len: np.ndarray  # [C] cached tokens the copy sees (tokens before the draft + b_k)


@dataclass
class Judgments:
    """One verification call's judgments, on the host. The step decides by `logit`: the
    zero-shot log-odds log P(yes) - log P(no), or a judge head's read-out of the same
    hidden state (judge_head.py); a copy passes when logit >= logit(τ)."""

    logit: np.ndarray  # [C] float64, the judgment's log-odds
    logprob_yes: np.ndarray  # [C] log P(labels[0]), the label's tokens summed
    logprob_no: np.ndarray  # [C] log P(labels[1])
    passes: int  # forwards it took (more than 1 only when one would not fit)
    # With check_isolation: whether the requests' own KV blocks were left
    # bit-for-bit unchanged by the pass.
    requests_kv_unchanged: bool | None = None
    hidden: np.ndarray | None = None  # [C, H] float32 at each copy's chat-suffix end (when recorded)

    @property
    def p_yes(self) -> np.ndarray:
        """[C] the judgment as a probability, sigmoid(logit) (1.0 once logit passes ~37)."""
        return 1.0 / (1.0 + np.exp(-self.logit))


def pass_ranges(
    num_copies: int,
    max_copies: int | None,
    need: np.ndarray | None = None,  # [C] units of a pooled resource each copy takes (scratch blocks)
    capacity: int | None = None,  # units of that resource one pass has
) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive copies, one per forward, each within `max_copies`
    copies and `capacity` units of `need`. Worked example: 5 copies needing [2, 1, 2, 2, 1]
    scratch blocks of 4, at most 3 copies a pass -> [(0, 2), (2, 4), (4, 5)]."""
    passes, start, used = [], 0, 0
    for c in range(num_copies):
        n = 0 if need is None else int(need[c])
        full = (max_copies is not None and c - start >= max_copies) or (capacity is not None and used + n > capacity)
        if full and c > start:
            passes.append((start, c))
            start, used = c, 0
        used += n
    if num_copies:
        passes.append((start, num_copies))
    return passes


class Verifier(Protocol):
    suffix_len: int

    def judge(self, copies: CopyBatch) -> Judgments: ...


class VerifierBase:
    """The suffix and labels, the loop over passes, the isolation check and
    P(yes); a verifier adds how copies are split into passes (`_passes`) and
    one pass (`_judge_pass`, returning both labels' log-probabilities)."""

    def __init__(
        self,
        target,
        *,
        suffix_ids: tuple[int, ...],
        labels: LabelScoring,
        kv_cache_group_id: int,
        layer_names: list[str],
        layer_caches: list[torch.Tensor],
        num_blocks: int,
        block_size: int,
        check_isolation: bool = False,
        read_out=None,
        max_tokens_per_pass: int | None = None,
        fetch=transfers.fetch,
        to_device=None,
    ):
        self.target = target  # _vllm.TargetAccess: the model, its device, the batch's block tables
        self.fetch = fetch  # device -> host, one transfer (the runner's HostCopies.fetch counts them)
        # host -> device, one staged copy per call (the runner's HostCopies.to_device counts them)
        self.to_device = to_device or functools.partial(transfers.to_device, torch.device(target.device))
        self.suffix = np.asarray(suffix_ids, dtype=np.int64)  # [L]
        if self.suffix.shape[0] == 0:
            raise ValueError("empty verification suffix")
        self.labels = labels
        self.group_id = kv_cache_group_id
        self.layer_names = list(layer_names)
        self.layer_caches = layer_caches  # addressed by the scheduler's block ids
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.check_isolation = check_isolation
        # A judge head (judge_head.ReadOut) in place of the zero-shot log-odds; None: zero-shot.
        self.read_out = read_out
        # Suffix tokens one forward may hold: the engine's max_num_batched_tokens, the
        # largest size vLLM compiles the model for (and profiles its activations at).
        self.max_tokens_per_pass = max_tokens_per_pass
        if max_tokens_per_pass is not None and max_tokens_per_pass < self.suffix_len:
            raise ValueError(
                f"a verification pass of at most {max_tokens_per_pass} tokens cannot hold one copy of the "
                f"{self.suffix_len}-token verification suffix; raise max_num_batched_tokens"
            )
        self.device = torch.device(target.device)

    @property
    def suffix_len(self) -> int:
        return int(self.suffix.shape[0])

    @property
    def max_copies_per_pass(self) -> int | None:
        """Copies one forward may hold within `max_tokens_per_pass` (None: no limit)."""
        return None if self.max_tokens_per_pass is None else self.max_tokens_per_pass // self.suffix_len

    def _passes(self, copies: CopyBatch) -> list[tuple[int, int]]:
        """[start, end) ranges of the copies, one per forward."""
        return pass_ranges(int(copies.req_row.shape[0]), self.max_copies_per_pass)

    def _judge_pass(self, req_row: np.ndarray, prefix_len: np.ndarray) -> torch.Tensor:
        """One forward over the copies: the target's final hidden states at each copy's
        label rows, [C * labels.rows, H] copy-major (`LabelScoring.row_index`)."""
        raise NotImplementedError

    def _read(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A pass's label rows [C * rows, H] -> (logit, log P(yes), log P(no)) [C] and the
        hidden state the judgment reads [C, H] (row 0: the chat suffix's last token)."""
        ly, ln = self.labels.log_probs(self.target.logits(hidden))
        h = hidden.view(-1, self.labels.rows, hidden.shape[-1])[:, 0]
        logit = ly - ln if self.read_out is None else self.read_out.logit(h, ly - ln)
        return logit, ly, ln, h

    @torch.inference_mode()
    def judge(self, copies: CopyBatch) -> Judgments:
        if copies.req_row.shape[0] == 0:
            empty = np.zeros(0, dtype=np.float64)
            return Judgments(empty, empty, empty, 0)
        passes = self._passes(copies)
        before = self._request_blocks(copies) if self.check_isolation else None
        read = [self._read(self._judge_pass(copies.req_row[s:e], copies.prefix_len[s:e])) for s, e in passes]
        logit, ly, ln, h = (torch.cat(x) for x in zip(*read))
        # One read-back: the judgments (and, when they are recorded, the hidden states).
        logit, ly, ln, *hidden = self.fetch(logit.double(), ly, ln, *([h.float()] if self.check_isolation else []))
        unchanged = None
        if before is not None:
            after = self._request_blocks(copies)
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
        return Judgments(logit, ly, ln, len(passes), unchanged, hidden[0].astype(np.float32) if hidden else None)

    def _request_blocks(self, copies: CopyBatch) -> list[torch.Tensor]:
        """Copies of every KV block (all target layers) that the judged
        requests own up to their longest judged prefix + suffix length."""
        tables = self.target.block_table(self.group_id)
        ids = set()
        for row in np.unique(copies.req_row):
            n = int(copies.prefix_len[copies.req_row == row].max()) + self.suffix_len
            ids.update(int(b) for b in tables[row, : min(tables.shape[1], -(-n // self.block_size))])
        (idx,) = self.to_device(np.array(sorted(ids), dtype=np.int64))
        return [c.unflatten(0, (self.num_blocks, -1))[idx].clone() for c in self.layer_caches]
