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
inputs itself, vllm.v1.spec_decode.utils.compute_new_slot_mapping).
"""

from __future__ import annotations

import numpy as np
import torch


def proposer_arguments(args: tuple, kwargs: dict):
    """(sampled_token_ids, sampling_metadata, common_attn_metadata) of a
    GPUModelRunner.propose_draft_token_ids call (after scheduler_output)."""
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
    bound = dict(zip(names, args)) | kwargs
    return bound["sampled_token_ids"], bound["sampling_metadata"], bound["common_attn_metadata"]


def rows_drafting_unsupported(runner) -> str | None:
    """Why the drafter cannot run over chosen rows here (None: it can).
    Proposers other than the draft model's, parallel drafting, M-RoPE and
    multimodal drafters build their first pass differently; probabilistic
    draft sampling keeps per-row probabilities for the rejection sampler;
    data-parallel ranks must run the same number of drafter forwards."""
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
    if runner.parallel_config.data_parallel_size > 1:
        return "data parallelism"
    return None


def propose_rows(
    runner,
    common_attn_metadata,  # this step's, for the whole batch
    sampling_metadata,
    rows: np.ndarray,  # [G] input-batch rows
    tokens: np.ndarray,  # [Σ L] each row's span, packed; the last of each is its next token
    cu_tokens: np.ndarray,  # [G + 1]
    start: np.ndarray,  # [G] position of each span's first token
    num_draft: int,
) -> torch.Tensor:
    """Run the drafter over the rows' spans; draft token ids [G, num_draft]
    (num_draft 0: only the spans' draft KV is written)."""
    drafter, device = runner.drafter, runner.device
    span = np.diff(cu_tokens)  # [G] L
    q_len = span - 1  # [G] target tokens per row (the span without its next token)
    last = cu_tokens[1:] - 1
    keep = np.ones(tokens.shape[0], dtype=bool)
    keep[last] = False
    # Positions of the target tokens: start, start + 1, ... per row.
    row_of = np.repeat(np.arange(rows.shape[0]), q_len)
    cu_q = np.concatenate([[0], np.cumsum(q_len)])
    positions = start[row_of] + np.arange(int(cu_q[-1])) - cu_q[row_of]
    seq_lens = start + q_len  # tokens up to and including each row's last target token

    def dev(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    block_table = common_attn_metadata.block_table_tensor[dev(rows, torch.long)].contiguous()
    query_start_loc_cpu = torch.from_numpy(cu_q.astype(np.int32))
    seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
    n_tokens = int(cu_q[-1])
    block_size = drafter.block_size
    block_idx = dev(row_of, torch.long) * block_table.shape[1] + dev(positions // block_size, torch.long)
    slot_mapping = block_table.view(-1)[block_idx] * block_size + dev(positions % block_size, torch.long)
    from vllm.v1.attention.backend import CommonAttentionMetadata

    sub = CommonAttentionMetadata(
        query_start_loc=query_start_loc_cpu.to(device),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu_upper_bound=seq_lens_cpu,
        num_reqs=int(rows.shape[0]),
        num_actual_tokens=n_tokens,
        max_query_len=int(q_len.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        causal=True,
    )
    return drafter.propose(
        num_speculative_tokens=num_draft,
        target_token_ids=dev(tokens[keep], torch.int32),
        target_positions=dev(positions, torch.long),
        target_hidden_states=torch.empty(0, device=device),
        next_token_ids=dev(tokens[last], torch.int32),
        token_indices_to_sample=None,
        common_attn_metadata=sub,
        sampling_metadata=sampling_metadata,
        num_rejected_tokens_gpu=None,
    )


def resumed_request_ids(scheduler_output) -> set[str]:
    """Requests resumed from preemption this step (their KV was recomputed,
    the draft's included only as far as the drafter runs over them again)."""
    return set(scheduler_output.scheduled_cached_reqs.resumed_req_ids or ())
