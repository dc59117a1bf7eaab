"""The metadata argument of `parse_vllm.ops.prefix_verify_attention` and its
references (own module: the references import it, and the op's module
imports the references)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefixVerifyMetadata:
    """Which cached tokens each copy of the verification suffix sees: the
    op's arguments besides the tensors it attends with (`prefix_verify_attention`).

    Worked example: two requests (block-table rows 0 and 1), three copies of
    a 4-token suffix: request 0 judged after 16 and 21 cached tokens, request
    1 after 46:
        copy_req         [0, 0, 1]
        copy_prefix_len  [16, 21, 46]
        cu_copy_lens     [0, 4, 8, 12]   # copy c owns suffix tokens [cu[c], cu[c+1])
    Tensors on the device of the attention's tensors; in the kernel verifier
    several layers share them (only the scalars are per layer)."""

    block_table: torch.Tensor  # [R, max_blocks] int32, physical block ids per request
    copy_req: torch.Tensor  # [C] int32, block-table row of copy c
    copy_prefix_len: torch.Tensor  # [C] int32, P_c: copy c sees cached tokens [0, P_c) of its request
    cu_copy_lens: torch.Tensor  # [C + 1] int32
    num_actual_tokens: int  # T = cu[C]; query rows past T (padding) are left alone
    scale: float  # > 0, usually D**-0.5
    softcap: float = 0.0  # 0 = off
    sliding_window: int | None = None  # None or 0 = off
    # >= every copy_prefix_len, known on the host (the verifier packs the prefixes there): the
    # CUDA kernels size their key splits from it.  None: bounded by the block table's width,
    # which in an engine is max_model_len and splits a 2k context as if it were 32k.  A CUDA
    # graph bakes it in: capture with the largest value the replays will need.
    max_prefix_len: int | None = None
