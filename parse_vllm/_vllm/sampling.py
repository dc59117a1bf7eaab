"""vLLM's spec-decode metadata, sampler and rejection-sampler output, as PARSE's
acceptance uses them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata


def __getattr__(name: str):
    if name in ("REJECTION_SAMPLER_MAX_SPEC_LEN", "PLACEHOLDER_TOKEN_ID"):
        # vllm.v1.sample.rejection_sampler.MAX_SPEC_LEN (same in 0.33): the
        # stock sampler (RejectionSampler.forward) asserts max_spec_len <= 128;
        # PARSE windows are longer, so the token-level check runs on at most
        # this many leading draft tokens per request.
        from vllm.v1.sample import rejection_sampler as rs

        globals()["REJECTION_SAMPLER_MAX_SPEC_LEN"] = rs.MAX_SPEC_LEN
        globals()["PLACEHOLDER_TOKEN_ID"] = int(rs.PLACEHOLDER_TOKEN_ID)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def spec_decode_metadata(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    cu_num_draft_tokens: torch.Tensor,
    cu_num_sampled_tokens: torch.Tensor,
    target_logits_indices: torch.Tensor,
    bonus_logits_indices: torch.Tensor,
    logits_indices: torch.Tensor,
) -> SpecDecodeMetadata:
    """vllm.v1.spec_decode.metadata.SpecDecodeMetadata (max_spec_len derived)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    return SpecDecodeMetadata(
        draft_token_ids=draft_token_ids,
        num_draft_tokens=num_draft_tokens,
        cu_num_draft_tokens=cu_num_draft_tokens,
        cu_num_sampled_tokens=cu_num_sampled_tokens,
        target_logits_indices=target_logits_indices,
        bonus_logits_indices=bonus_logits_indices,
        logits_indices=logits_indices,
    )


def cu_sampled_tokens(md: SpecDecodeMetadata):
    """SpecDecodeMetadata.cu_num_sampled_tokens on the host, without reading
    the device: every request samples its draft tokens and one more
    (vllm.v1.worker.gpu_model_runner.GPUModelRunner._calc_spec_decode_metadata,
    num_sampled_tokens = num_draft_tokens + 1). [B] int64."""
    import numpy as np

    return np.cumsum(np.asarray(md.num_draft_tokens, dtype=np.int64) + 1)


def sample_after_prefixes(
    sampler,
    logits: torch.Tensor,  # [num_reqs, vocab]: row i is the position after request i's prefix
    sampling_metadata,
    prefixes: dict[int, list[int]],  # input-batch row -> the draft tokens it accepted
) -> torch.Tensor:
    """One token per row, sampled with each request's own parameters as the
    rejection sampler samples its bonus tokens (vllm.v1.sample.sampler.Sampler
    with predict_bonus_token=True), for the rows in `prefixes`: penalties and
    bad words count the request's output plus its accepted prefix (passed as
    SamplingMetadata.spec_token_ids, which the sampler appends to the output
    for bonus tokens), and only those rows' seeded generators are used, so a
    seeded request's sampling does not depend on its neighbours. The other
    rows' samples mean nothing (their rows keep the batch's shape for the
    batch-indexed min-tokens processor). Returns [num_reqs]."""
    from dataclasses import replace

    md = replace(
        sampling_metadata,
        max_num_logprobs=None,
        logprob_token_ids=None,
        spec_token_ids=[prefixes.get(i, []) for i in range(logits.shape[0])],
        generators={i: g for i, g in sampling_metadata.generators.items() if i in prefixes},
    )
    return sampler(logits=logits, sampling_metadata=md, predict_bonus_token=True).sampled_token_ids.view(-1)


def truncate_spec_decode(
    logits: torch.Tensor,  # [Σ(d_i + 1), vocab]
    md: SpecDecodeMetadata,
    limit: int,
    to_device,
) -> tuple[torch.Tensor, SpecDecodeMetadata]:
    """The same verification with every draft cut to its first `limit`
    tokens, as logits + metadata in the stock layout
    (vllm.v1.worker.gpu_model_runner.GPUModelRunner._calc_spec_decode_metadata,
    same in 0.33), for the stock rejection sampler, which asserts
    max_spec_len <= 128. `to_device` moves the new indices over in one copy."""
    if md.max_spec_len <= limit:
        return logits, md
    import numpy as np

    d = np.asarray(md.num_draft_tokens, dtype=np.int64)  # [B]
    n = np.minimum(d, limit)  # [B]
    starts = cu_sampled_tokens(md) - (d + 1)
    keep = np.concatenate([np.arange(s, s + k + 1) for s, k in zip(starts, n)])
    cu_sampled = np.cumsum(n + 1)
    new_starts = cu_sampled - (n + 1)
    target = np.concatenate([np.arange(s, s + k) for s, k in zip(new_starts, n)] + [np.zeros(0, np.int64)])
    cu_draft_old = np.concatenate([[0], np.cumsum(d)])
    draft_idx = np.concatenate([np.arange(s, s + k) for s, k in zip(cu_draft_old[:-1], n)] + [np.zeros(0, np.int64)])
    cu_draft, cu_sampled_t, target_t, bonus_t, keep_t, draft_idx_t = to_device(
        np.cumsum(n).astype(np.int32),
        cu_sampled.astype(np.int32),
        target.astype(np.int32),
        (cu_sampled - 1).astype(np.int32),
        keep.astype(np.int32),
        draft_idx.astype(np.int64),
    )
    new_md = spec_decode_metadata(
        draft_token_ids=md.draft_token_ids[draft_idx_t].contiguous(),
        num_draft_tokens=n.tolist(),
        cu_num_draft_tokens=cu_draft,
        cu_num_sampled_tokens=cu_sampled_t,
        target_logits_indices=target_t,
        bonus_logits_indices=bonus_t,
        logits_indices=keep_t,
    )
    return logits[keep_t.long()], new_md


def widen_sampled(out, width: int):
    """Pad a rejection-sampler output [B, w] (and its per-position logprobs,
    B*w rows) to [B, width] with placeholders."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    ids = out.sampled_token_ids
    B, w = ids.shape
    if w >= width:
        return out
    wide = torch.full((B, width), PLACEHOLDER_TOKEN_ID, dtype=ids.dtype, device=ids.device)
    wide[:, :w] = ids
    lp = out.logprobs_tensors
    if lp is not None:

        def pad(x: torch.Tensor) -> torch.Tensor:
            x = x.view(B, w, *x.shape[1:])
            y = torch.zeros((B, width, *x.shape[2:]), dtype=x.dtype, device=x.device)
            y[:, :w] = x
            return y.view(B * width, *x.shape[2:])

        lp = lp._replace(
            logprob_token_ids=pad(lp.logprob_token_ids),
            logprobs=pad(lp.logprobs),
            selected_token_ranks=pad(lp.selected_token_ranks),
        )
    return SamplerOutput(sampled_token_ids=wide, logprobs_tensors=lp)
