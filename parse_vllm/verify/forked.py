"""The verification pass with forked block tables (contract: base.py).

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

import numpy as np
import torch

from parse_vllm import _vllm
from parse_vllm.verify.base import CopyBatch, VerifierBase, pass_ranges


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


class ForkedBlockTableVerifier(VerifierBase):
    """Each copy a pseudo-request over forked block tables (module docstring).
    `scratch_ids` [R]: the block ids held back from the scheduler for the
    suffixes; `max_rows_per_pass`: the row limit of backends with per-request
    buffers (None: none)."""

    def __init__(self, target, *, scratch_ids: np.ndarray, max_rows_per_pass: int | None = None, **common):
        super().__init__(target, **common)  # VerifierBase's arguments
        self.scratch_ids = scratch_ids
        self.max_rows_per_pass = max_rows_per_pass
        worst = self.blocks_per_copy(self.block_size - 1)
        if worst > scratch_ids.shape[0]:
            raise ValueError(
                f"PARSE needs at least {worst} scratch KV blocks for one "
                f"verification copy (suffix of {self.suffix_len} tokens, block "
                f"size {self.block_size}) but has {scratch_ids.shape[0]}; raise "
                "parse.scratch_blocks"
            )

    def blocks_per_copy(self, offset_in_block: int) -> int:
        """Scratch blocks for one copy whose prefix ends `offset_in_block`
        tokens into a block: the copied partial block plus the suffix."""
        return -(-(offset_in_block + self.suffix_len) // self.block_size)

    def _need(self, prefix_len: np.ndarray) -> np.ndarray:
        return np.array([self.blocks_per_copy(int(n) % self.block_size) for n in prefix_len])

    def _passes(self, copies: CopyBatch) -> list[tuple[int, int]]:
        # As many copies per pass as the scratch pool holds, within the token and row limits.
        limits = [n for n in (self.max_copies_per_pass, self.max_rows_per_pass) if n is not None]
        return pass_ranges(
            int(copies.req_row.shape[0]),
            min(limits) if limits else None,
            need=self._need(copies.prefix_len),
            capacity=int(self.scratch_ids.shape[0]),
        )

    def _judge_pass(self, req_row: np.ndarray, prefix_len: np.ndarray) -> torch.Tensor:
        B, L = self.block_size, self.suffix_len
        C = req_row.shape[0]
        need = self._need(prefix_len)
        req_tables = self.target.block_table(self.group_id)
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
        positions = (prefix_len[:, None] + np.arange(L)[None, :]).reshape(-1).astype(np.int64)  # [C*L]
        rows = np.repeat(np.arange(C), L)
        slots = table[rows, positions // B].astype(np.int64) * B + positions % B
        input_ids = np.tile(self.suffix, C)
        seq_lens = (prefix_len + L).astype(np.int32)
        qsl = np.arange(0, (C + 1) * L, L, dtype=np.int32)

        ids_t, pos_t, qsl_t, seq_lens_t, table_t, slots_t, last_t = self.to_device(
            input_ids.astype(np.int32), positions, qsl, seq_lens, table, slots, qsl[1:] - 1
        )
        hidden = self.target.forward(
            input_ids=ids_t,
            positions=pos_t,
            query_start_loc=qsl_t,
            query_start_loc_cpu=torch.from_numpy(qsl),
            seq_lens=seq_lens_t,
            block_table=table_t,
            slot_mapping=slots_t,
            kv_cache_group_id=self.group_id,
            layer_names=self.layer_names,
            max_query_len=L,
            max_seq_len=int(seq_lens.max()),
        )
        return hidden[self.labels.row_index(last_t)]  # [C * rows, H]
