"""Forwards of the target model outside vLLM's own step, over given inputs and
attention metadata."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def run_target_forward(
    runner,
    *,
    input_ids: torch.Tensor,  # [num_tokens]
    positions: torch.Tensor,  # [num_tokens]
    query_start_loc: torch.Tensor,  # [num_rows + 1] int32
    query_start_loc_cpu: torch.Tensor,  # the same on the host (no read back from the device)
    seq_lens: torch.Tensor,  # [num_rows] int32
    block_table: torch.Tensor,  # [num_rows, max_blocks] int32
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    kv_cache_group_id: int,
    layer_names: Sequence[str],
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """One forward of the runner's target model over pseudo-requests with the
    given block tables, through the model's own nn.Module and the backend's
    own metadata builders (vllm.v1.worker.utils.AttentionGroup.build_metadata;
    vllm.forward_context.set_forward_context). Returns the hidden states
    [num_tokens, hidden]."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    num_rows = int(seq_lens.shape[0])
    num_tokens = int(input_ids.shape[0])
    cm = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=seq_lens,
        num_reqs=num_rows,
        num_actual_tokens=num_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        causal=True,
        positions=positions,
    )
    # Only the target's groups: the draft model's and an EAGLE head's layers share the KV
    # group but take no part in a target forward.
    wanted = set(layer_names)
    per_layer: dict[str, Any] = {}
    for group in runner.attn_groups[kv_cache_group_id]:
        if wanted.isdisjoint(group.layer_names):
            continue
        md = group.build_metadata(cm)
        for name in group.layer_names:
            per_layer[name] = md
    missing = wanted - per_layer.keys()
    if missing:
        raise RuntimeError(f"no attention metadata for target layers {sorted(missing)}")
    return run_target_forward_with_layer_metadata(
        runner,
        input_ids=input_ids,
        positions=positions,
        attn_metadata=per_layer,
        slot_mapping={name: slot_mapping for name in per_layer},
    )


def run_target_forward_with_layer_metadata(
    runner,
    *,
    input_ids: torch.Tensor,  # [num_tokens]
    positions: torch.Tensor,  # [num_tokens]
    attn_metadata: dict[str, Any],  # layer name -> metadata, every target layer
    slot_mapping: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One forward of the runner's target model with the given per-layer
    attention metadata (vllm.forward_context.set_forward_context). With no
    slot mapping, vllm.model_executor.layers.attention.attention.unified_kv_cache_update
    writes nothing (same in 0.33). Returns hidden states [num_tokens, hidden]."""
    from vllm.forward_context import set_forward_context

    with set_forward_context(
        attn_metadata,
        runner.vllm_config,
        num_tokens=int(input_ids.shape[0]),
        slot_mapping=slot_mapping or {},
    ):
        hidden = runner.model(
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=None,
            inputs_embeds=None,
        )
    if isinstance(hidden, tuple):  # models returning aux hidden states
        hidden = hidden[0]
    return hidden


def target_logits(runner, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits [n, vocab] for hidden states [n, hidden]."""
    return runner.model.compute_logits(hidden)


class TargetAccess:
    """What a verification forward needs of the model runner, and nothing more: the
    target model, its device and config, the input batch's block tables, the runner's
    attention groups and limits. The verifiers take this, never the runner."""

    def __init__(self, runner):
        self._runner = runner

    @property
    def model(self):
        return self._runner.model

    @property
    def device(self) -> torch.device:
        return torch.device(self._runner.device)

    @property
    def vllm_config(self):
        return self._runner.vllm_config

    def block_table(self, kv_cache_group_id: int):
        """The input batch's block table of one KV-cache group, numpy [max_reqs, max_blocks]
        (rows = input-batch rows, manager block ids)."""
        from .batch import request_block_table

        return request_block_table(self._runner, kv_cache_group_id)

    def layer_block_tables(self, kv_cache_group_id: int, table):
        from .attention import layer_block_tables

        return layer_block_tables(self._runner, kv_cache_group_id, table)

    def rows_limit(self, kv_cache_group_id: int) -> int | None:
        from .attention import attention_rows_limit

        return attention_rows_limit(self._runner, kv_cache_group_id)

    def max_batched_tokens(self) -> int:
        from .attention import max_batched_tokens

        return max_batched_tokens(self._runner)

    def forward(self, **kwargs) -> torch.Tensor:
        """`run_target_forward` over the given pseudo-requests."""
        return run_target_forward(self._runner, **kwargs)

    def forward_with_layer_metadata(self, **kwargs) -> torch.Tensor:
        """`run_target_forward_with_layer_metadata`."""
        return run_target_forward_with_layer_metadata(self._runner, **kwargs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return target_logits(self._runner, hidden)
