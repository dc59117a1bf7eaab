"""The draft-model proposer run over chosen rows of the batch.

vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids calls
vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer.propose once,
over every request, with this step's scheduled tokens as the first pass. Here
the same `propose` is called with inputs built for a subset of the rows: each
row's span of tokens whose draft KV is missing (its "target tokens"), the
token drafting continues from (its "next token", the extra input slot of
draft-model proposers: `needs_extra_input_slots`), and a
vllm.v1.attention.backend.CommonAttentionMetadata for just those rows (their
block-table rows; the proposer computes the slot mapping of the extended
inputs itself, vllm.v1.spec_decode.utils.compute_new_slot_mapping). A
step's calls are staged together (`DrafterStaging`): one host-to-device copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def proposer_call(args: tuple, kwargs: dict) -> dict:
    """A GPUModelRunner.propose_draft_token_ids call's arguments after
    scheduler_output, by name."""
    names = (
        "sampled_token_ids",
        "sampling_metadata",
        "hidden_states",
        "sample_hidden_states",
        "aux_hidden_states",
        "spec_decode_metadata",
        "common_attn_metadata",
        "slot_mappings",
    )
    return dict(zip(names, args)) | kwargs


def proposer_arguments(args: tuple, kwargs: dict):
    """(sampled_token_ids, sampling_metadata, common_attn_metadata) of a
    GPUModelRunner.propose_draft_token_ids call (after scheduler_output)."""
    bound = proposer_call(args, kwargs)
    return bound["sampled_token_ids"], bound["sampling_metadata"], bound["common_attn_metadata"]


def rows_drafting_unsupported(runner) -> str | None:
    """Why the drafter cannot run over chosen rows here (None: it can).
    Proposers other than the draft model's, parallel drafting, M-RoPE and
    multimodal drafters build their first pass differently; probabilistic
    draft sampling keeps per-row probabilities for the rejection sampler."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    drafter = getattr(runner, "drafter", None)
    if not isinstance(drafter, DraftModelProposer):
        return f"the drafter is {type(drafter).__name__}, not DraftModelProposer"
    if drafter.parallel_drafting or not drafter.needs_extra_input_slots:
        return "parallel drafting"
    if drafter.uses_mrope or drafter.supports_mm_inputs:
        return "an M-RoPE or multimodal drafter"
    if drafter._enable_probabilistic_draft_probs:
        return "probabilistic draft sampling (draft_sample_method='probabilistic')"
    if runner.speculative_config.disable_padded_drafter_batch:
        return "disable_padded_drafter_batch (the drafter runs after bookkeeping)"
    return None


@dataclass
class StagedPass:
    """One drafter call's inputs: device views of the step's staged buffer,
    and the host values CommonAttentionMetadata keeps beside them."""

    rows: torch.Tensor  # [G] int64, input-batch rows
    target_tokens: torch.Tensor  # [Σ q] int32, each span without its last token
    positions: torch.Tensor  # [Σ q] int64
    next_tokens: torch.Tensor  # [G] int32, each span's last token (drafting continues from it)
    query_start_loc: torch.Tensor  # [G + 1] int32
    seq_lens: torch.Tensor  # [G] int32
    query_start_loc_cpu: torch.Tensor  # [G + 1] int32
    seq_lens_cpu: torch.Tensor  # [G] int32
    max_query_len: int
    max_seq_len: int


class DrafterStaging:
    """Every drafter call's inputs of one engine step, written into one host
    buffer (pinned on a GPU, vllm.v1.utils.CpuGpuBuffer, kept and grown) and
    moved to the device in one copy before the first call: no call waits for
    a copy from pageable memory, and a later call's inputs never overwrite
    an earlier call's in flight.

    Per call, int64: [target tokens (Σq) | positions (Σq) | next tokens (G)
    | query_start_loc (G + 1) | seq_lens (G) | rows (G)]. A draft made in chunks
    appends its later calls' inputs (`stage_continuation`), one small copy each."""

    @classmethod
    def for_runner(cls, runner) -> DrafterStaging:
        """Sized for a step's first passes (vllm.config.SchedulerConfig max_num_batched_tokens
        and max_num_seqs); catch-up beyond it grows it."""
        sc = runner.scheduler_config
        return cls(runner.device, 4 * (sc.max_num_batched_tokens + sc.max_num_seqs))

    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        self.buffer = None
        self.used = 0  # the step's staged values so far
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        from vllm.v1.utils import CpuGpuBuffer

        self.buffer = CpuGpuBuffer(capacity, dtype=torch.int64, device=self.device)

    def _put(self, flat: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `flat` to the step's staged values and copy it over: (device, host) views.
        (A bigger buffer replaces a full one; views of the old stay valid.)"""
        n = flat.shape[0]
        if self.used + n > self.buffer.np.shape[0]:
            self._grow(max(self.used + n, 2 * self.buffer.np.shape[0]))
            self.used = 0
        a, b = self.used, self.used + n
        self.buffer.np[a:b] = flat
        self.buffer.gpu[a:b].copy_(self.buffer.cpu[a:b], non_blocking=True)
        self.used = b
        return self.buffer.gpu[a:b], self.buffer.cpu[a:b]

    def stage_continuation(
        self, rows: np.ndarray, keep: np.ndarray, prev: torch.Tensor, start: np.ndarray
    ) -> StagedPass:
        """The next call of a draft in calls: for rows `rows` [G], each row's last two
        draft tokens so far, from `prev` (the previous call's drafts on the device) at
        indices `keep` [G]: the first at position `start` [G] (its KV the drafter wrote, but
        it is passed again), the second where drafting continues."""
        G = rows.shape[0]
        seq_lens = start + 1
        dev, host = self._put(np.concatenate([start, np.arange(G + 1), seq_lens, rows, keep]).astype(np.int64))
        last_two = prev[dev[4 * G + 1 :]][:, -2:]
        return StagedPass(
            rows=dev[3 * G + 1 : 4 * G + 1],
            target_tokens=last_two[:, 0].to(torch.int32),
            positions=dev[:G],
            next_tokens=last_two[:, 1].to(torch.int32),
            query_start_loc=dev[G : 2 * G + 1].to(torch.int32),
            seq_lens=dev[2 * G + 1 : 3 * G + 1].to(torch.int32),
            query_start_loc_cpu=host[G : 2 * G + 1].to(torch.int32),
            seq_lens_cpu=host[2 * G + 1 : 3 * G + 1].to(torch.int32),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
        )

    def stage(self, calls: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> list[StagedPass]:
        """calls: per drafter call (rows [G], tokens [Σ L] each row's span
        packed, cu_tokens [G + 1], start [G] the position of each span's first
        token)."""
        parts, layout = [], []
        for rows, tokens, cu_tokens, start in calls:
            q_len = np.diff(cu_tokens) - 1  # [G] target tokens per row (the span without its next token)
            last = cu_tokens[1:] - 1
            keep = np.ones(tokens.shape[0], dtype=bool)
            keep[last] = False
            cu_q = np.concatenate([[0], np.cumsum(q_len)])
            row_of = np.repeat(np.arange(rows.shape[0]), q_len)
            positions = start[row_of] + np.arange(int(cu_q[-1])) - cu_q[row_of]
            seq_lens = start + q_len  # tokens up to and including each row's last target token
            fields = [tokens[keep], positions, tokens[last], cu_q, seq_lens, rows]
            layout.append([f.shape[0] for f in fields])
            parts += fields
        flat = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        self.used = 0  # a new step: the last step's copies are done (its reads synchronised)
        dev, host = self._put(flat)
        staged, at = [], 0
        for sizes, (_, _, cu_tokens, start) in zip(layout, calls):
            views, host_views = [], []
            for k in sizes:
                views.append(dev[at : at + k])
                host_views.append(host[at : at + k])
                at += k
            q_len = np.diff(cu_tokens) - 1
            staged.append(
                StagedPass(
                    rows=views[5],
                    target_tokens=views[0].to(torch.int32),
                    positions=views[1],
                    next_tokens=views[2].to(torch.int32),
                    query_start_loc=views[3].to(torch.int32),
                    seq_lens=views[4].to(torch.int32),
                    query_start_loc_cpu=host_views[3].to(torch.int32),
                    seq_lens_cpu=host_views[4].to(torch.int32),
                    max_query_len=int(q_len.max()),
                    max_seq_len=int((start + q_len).max()),
                )
            )
        return staged


def drafting_block_table(
    runner, batch_table: torch.Tensor | None, num_batch: int, others: list[str], to_device
) -> torch.Tensor:
    """The block table [B + O, max_blocks] of a step's drafting rows: the
    input batch's B rows (`batch_table`, the step's
    CommonAttentionMetadata.block_table_tensor), then O requests outside the
    batch (windows drafted over several steps), from the runner's
    vllm.v1.worker.gpu_input_batch.CachedRequestState.block_ids of KV-cache
    group 0, the group the draft-model proposer's metadata reads (as the
    batch's table: manager block ids, vllm.v1.worker.block_table.BlockTable.append_row).
    `to_device` moves host arrays to the device (the caller's staged copies)."""
    if not others:
        return batch_table
    width = runner.input_batch.block_table[0].get_numpy_array().shape[1]
    table = np.zeros((len(others), width), dtype=np.int32)
    for i, req_id in enumerate(others):
        ids = runner.requests[req_id].block_ids[0]
        table[i, : len(ids)] = ids
    (out,) = to_device(table)
    if num_batch == 0 or batch_table is None:
        return out
    return torch.cat([batch_table[:num_batch], out.to(batch_table.dtype)])


def propose_rows(
    runner,
    block_table: torch.Tensor,  # [rows, max_blocks] every drafting row's (drafting_block_table)
    sampling_metadata,
    inputs: StagedPass,
    num_draft: int,
) -> torch.Tensor:
    """Run the drafter over the staged rows' spans; draft token ids
    [G, num_draft] on the device (num_draft 0: only the spans' draft KV is
    written)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    drafter = runner.drafter
    sub = CommonAttentionMetadata(
        query_start_loc=inputs.query_start_loc,
        query_start_loc_cpu=inputs.query_start_loc_cpu,
        seq_lens=inputs.seq_lens,
        seq_lens_cpu_upper_bound=inputs.seq_lens_cpu,
        num_reqs=int(inputs.rows.shape[0]),
        num_actual_tokens=int(inputs.target_tokens.shape[0]),
        max_query_len=inputs.max_query_len,
        max_seq_len=inputs.max_seq_len,
        block_table_tensor=block_table[inputs.rows].contiguous(),
        # Draft-model proposers (extra input slots) compute the slot mapping
        # of their extended inputs themselves and never read this one
        # (SpecDecodeBaseProposer.set_inputs_first_pass, compute_new_slot_mapping).
        slot_mapping=torch.empty(0, dtype=torch.int64, device=runner.device),
        causal=True,
    )
    return drafter.propose(
        num_speculative_tokens=num_draft,
        target_token_ids=inputs.target_tokens,
        target_positions=inputs.positions,
        target_hidden_states=torch.empty(0, device=runner.device),
        next_token_ids=inputs.next_tokens,
        token_indices_to_sample=None,
        common_attn_metadata=sub,
        sampling_metadata=sampling_metadata,
        num_rejected_tokens_gpu=None,
    )


class RowsDrafter:
    """vLLM's draft-model proposer over chosen rows, as drafting.run_passes calls it (the
    `drafting.Drafter` contract): a pass's first call over its staged spans, later calls
    from each row's last two draft tokens, and the read of a call's drafts."""

    def __init__(
        self, runner, staging: DrafterStaging, staged: list[StagedPass], block_table, sampling_metadata, fetch
    ):
        self.runner, self.staging, self.staged = runner, staging, staged
        self.block_table, self.sampling_metadata, self.fetch = block_table, sampling_metadata, fetch

    def first(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self.staged[i]
        return propose_rows(self.runner, self.block_table, self.sampling_metadata, inputs, n), inputs.rows

    def more(self, rows, keep, prev, start, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self.staging.stage_continuation(rows, keep, prev, start)
        return propose_rows(self.runner, self.block_table, self.sampling_metadata, inputs, n), inputs.rows
