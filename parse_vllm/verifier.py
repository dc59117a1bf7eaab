"""The one-pass multi-prefix verification: every (request, boundary) copy of
the verification suffix judged by the target in one forward.

Copy c sees the first `prefix_len[c]` tokens of its request's KV (prompt +
the draft up to its boundary, already in the paged cache from this step's
verification forward) and then its own suffix tokens, causally, at positions
prefix_len[c] .. prefix_len[c] + L - 1.

Forked block tables (the CPU path, and the GPU fallback): copy c becomes a
pseudo-request whose block table is its request's blocks holding only
prefix tokens, followed by scratch blocks. The block that holds the prefix's
last partial block is copied whole into the first scratch block (whole-block
copies are layout-agnostic under the CPU backend's per-ISA packing), the
suffix KV is written into the scratch slots after the prefix, and the
backend's ordinary causal paged attention then computes exactly
"prefix + own causal suffix". Request blocks are only read; scratch blocks
are never handed out by the scheduler (ParseScheduler) and are reused by the
next pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parse_vllm import _vllm
from parse_vllm.templates import LabelScoring


@dataclass
class CopyBatch:
    """The copies of one verification pass, packed."""

    req_row: np.ndarray  # [C] input-batch row of each copy's request
    prefix_len: np.ndarray  # [C] cached tokens the copy sees (c + 1 + b_k)


@dataclass
class Judgments:
    p_yes: torch.Tensor  # [C] P(yes) / (P(yes) + P(no)), float32
    logprob_yes: torch.Tensor  # [C] log P(labels[0]), the label's tokens summed
    logprob_no: torch.Tensor  # [C] log P(labels[1])
    passes: int  # forwards it took (more than 1 only when scratch ran out)
    # With check_isolation: whether the requests' own KV blocks were left
    # bit-for-bit unchanged by the pass.
    requests_kv_unchanged: bool | None = None


def scratch_block_count(
    requested: int, num_blocks: int, verifier: str = "forked", suffix_blocks_hint: int = 2, copies_hint: int = 64
) -> int:
    """Scratch blocks held back from the scheduler. Deterministic in its
    inputs, because the scheduler (engine-core process) and the runner
    (worker process) compute it independently and must agree. The kernel
    path needs none; "auto" keeps them for its fallback."""
    if verifier == "kernel":
        return 0
    if requested:
        if requested >= num_blocks:
            raise ValueError(
                f"parse.scratch_blocks={requested} leaves no KV cache for requests ({num_blocks} blocks in all)"
            )
        return requested
    return max(suffix_blocks_hint, min(num_blocks // 8, copies_hint * suffix_blocks_hint))


class ForkedBlockTableVerifier:
    def __init__(
        self,
        runner,
        *,
        suffix_ids: tuple[int, ...],
        labels: LabelScoring,
        kv_cache_group_id: int,
        layer_names: list[str],
        layer_caches: list[torch.Tensor],
        num_blocks: int,
        block_size: int,
        scratch_ids: np.ndarray,  # [R] block ids never given to requests
        max_rows_per_pass: int | None = None,
        check_isolation: bool = False,
    ):
        self.runner = runner
        self.suffix = np.asarray(suffix_ids, dtype=np.int64)  # [L]
        self.labels = labels
        self.group_id = kv_cache_group_id
        self.layer_names = layer_names
        self.layer_caches = layer_caches
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_ids = scratch_ids
        self.max_rows_per_pass = max_rows_per_pass
        self.check_isolation = check_isolation
        self.device = runner.device
        worst = self.blocks_per_copy(block_size - 1)
        if worst > scratch_ids.shape[0]:
            raise ValueError(
                f"PARSE needs at least {worst} scratch KV blocks for one "
                f"verification copy (suffix of {len(self.suffix)} tokens, block "
                f"size {block_size}) but has {scratch_ids.shape[0]}; raise "
                "parse.scratch_blocks"
            )

    @property
    def suffix_len(self) -> int:
        return int(self.suffix.shape[0])

    def blocks_per_copy(self, offset_in_block: int) -> int:
        """Scratch blocks for one copy whose prefix ends `offset_in_block`
        tokens into a block: the copied partial block plus the suffix."""
        B, L = self.block_size, self.suffix_len
        return -(-(offset_in_block + L) // B)

    def judge(self, copies: CopyBatch) -> Judgments:
        C = copies.req_row.shape[0]
        if C == 0:
            empty = torch.zeros(0, dtype=torch.float32)
            return Judgments(empty, empty, empty, 0)
        B = self.block_size
        need = np.array([self.blocks_per_copy(int(n) % B) for n in copies.prefix_len])
        # Chunk the copies so each pass fits the scratch pool (and the row
        # limit of backends with per-request buffers).
        chunks, start, used = [], 0, 0
        for c in range(C):
            rows = c - start
            limit_hit = self.max_rows_per_pass is not None and rows >= self.max_rows_per_pass
            if used + need[c] > self.scratch_ids.shape[0] or limit_hit:
                chunks.append((start, c))
                start, used = c, 0
            used += need[c]
        chunks.append((start, C))
        before = self._request_blocks(copies) if self.check_isolation else None
        lp_yes, lp_no = [], []
        for s, e in chunks:
            ly, ln = self._judge_chunk(copies.req_row[s:e], copies.prefix_len[s:e], need[s:e])
            lp_yes.append(ly)
            lp_no.append(ln)
        ly = torch.cat(lp_yes).cpu()
        ln = torch.cat(lp_no).cpu()
        unchanged = None
        if before is not None:
            after = self._request_blocks(copies)
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
        return Judgments(torch.sigmoid(ly - ln), ly, ln, len(chunks), unchanged)

    def _request_blocks(self, copies: CopyBatch) -> list[torch.Tensor]:
        """Copies of every KV block (all target layers) that the judged
        requests own up to their longest judged prefix + suffix length."""
        tables = self.runner.input_batch.block_table[self.group_id].get_numpy_array()
        ids = set()
        for row in np.unique(copies.req_row):
            n = int(copies.prefix_len[copies.req_row == row].max()) + self.suffix_len
            ids.update(int(b) for b in tables[row, : -(-n // self.block_size)])
        idx = torch.tensor(sorted(ids), dtype=torch.long)
        return [c.unflatten(0, (self.num_blocks, -1))[idx.to(c.device)].clone() for c in self.layer_caches]

    def _judge_chunk(self, req_row: np.ndarray, prefix_len: np.ndarray, need: np.ndarray):
        B, L = self.block_size, self.suffix_len
        C = req_row.shape[0]
        req_tables = self.runner.input_batch.block_table[self.group_id].get_numpy_array()
        width = int(max(int(n) // B + k for n, k in zip(prefix_len, need)))
        table = np.zeros((C, width), dtype=np.int32)  # [C, width]
        block_copies: list[tuple[int, int]] = []
        next_scratch = 0
        for c in range(C):
            n, row = int(prefix_len[c]), int(req_row[c])
            full = n // B
            scratch = self.scratch_ids[next_scratch : next_scratch + need[c]]
            next_scratch += need[c]
            table[c, :full] = req_tables[row, :full]
            table[c, full : full + need[c]] = scratch
            if n % B:
                # The prefix ends inside request block `full`: that block also
                # holds draft tokens past the boundary (overwritten by the
                # suffix in the copy), so the copy gets its own duplicate.
                block_copies.append((int(req_tables[row, full]), int(scratch[0])))
        _vllm.copy_kv_blocks(self.layer_caches, self.num_blocks, block_copies)

        # Suffix tokens of copy c sit at positions n_c .. n_c + L - 1.
        positions = (prefix_len[:, None] + np.arange(L)[None, :]).reshape(-1)  # [C*L]
        rows = np.repeat(np.arange(C), L)
        slots = table[rows, positions // B].astype(np.int64) * B + positions % B
        input_ids = np.tile(self.suffix, C)
        seq_lens = (prefix_len + L).astype(np.int32)
        qsl = np.arange(0, (C + 1) * L, L, dtype=np.int32)

        dev = self.device
        hidden = _vllm.run_target_forward(
            self.runner,
            input_ids=torch.from_numpy(input_ids.astype(np.int32)).to(dev),
            positions=torch.from_numpy(positions.astype(np.int64)).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_table=torch.from_numpy(table).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            kv_cache_group_id=self.group_id,
            layer_names=self.layer_names,
            max_query_len=L,
            max_seq_len=int(seq_lens.max()),
        )
        last = torch.from_numpy(qsl[1:] - 1).to(dev).long()
        logits = self.runner.model.compute_logits(hidden[self.labels.row_index(last)])  # [C * rows, vocab]
        return self.labels.log_probs(logits)
