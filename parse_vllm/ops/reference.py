"""Plain-PyTorch references for `parse_vllm.ops.prefix_verify_attention`.

`prefix_verify_attention_ref` is the one the tests trust: for every copy it
gathers the copy's visible keys from the paged cache (prefix) and from the
packed suffix tokens, and runs a dense fp32 softmax over them.  Nothing clever:
one copy at a time, one explicit [Hq, L, P + L] score matrix, one explicit
visibility mask built from absolute positions.

`prefix_verify_attention_dense_ref` does the same for all copies at once with a
dense [T, keys] mask (what a generic masked-attention call would need); it is
here for the benchmark's baseline and as a second opinion in the tests.
"""

from __future__ import annotations

import torch

from parse_vllm.ops.metadata import PrefixVerifyMetadata

__all__ = ["prefix_verify_attention_ref", "prefix_verify_attention_dense_ref", "gather_prefix"]


def gather_prefix(cache: torch.Tensor, block_table: torch.Tensor, req: int, prefix_len: int) -> torch.Tensor:
    """The first `prefix_len` cached tokens of request `req` as [prefix_len, Hkv, D].

    `cache` is the logical [num_blocks, block_size, Hkv, D] view (any strides).
    """
    block_size = cache.shape[1]
    n_blocks = -(-prefix_len // block_size)
    blocks = block_table[req, :n_blocks].long()
    return cache[blocks].reshape(n_blocks * block_size, cache.shape[2], cache.shape[3])[:prefix_len]


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[Lq, Lk] bool: causal, plus the sliding window (key > query - window)."""
    vis = k_pos[None, :] <= q_pos[:, None]
    if window and window > 0:
        vis &= k_pos[None, :] > q_pos[:, None] - window
    return vis


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] (fp32), vis [Lq, Lk] -> [Lq, Hq, D] fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h uses kv head h // group
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def prefix_verify_attention_ref(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: PrefixVerifyMetadata,
) -> torch.Tensor:
    """Reference result, [T, Hq, D] in q's dtype (computed in fp32), one copy at a time.

    Same arguments and meaning as `parse_vllm.ops.prefix_verify_attention`
    (without `out`).
    """
    T = md.num_actual_tokens
    q, k_new, v_new = q[:T], k_new[:T], v_new[:T]
    window = int(md.sliding_window or 0)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    cu = md.cu_copy_lens.tolist()
    for c, (req, plen) in enumerate(zip(md.copy_req.tolist(), md.copy_prefix_len.tolist())):
        t0, t1 = cu[c], cu[c + 1]
        if t1 == t0:
            continue
        k = torch.cat([gather_prefix(key_cache, md.block_table, req, plen), k_new[t0:t1]]).float()
        v = torch.cat([gather_prefix(value_cache, md.block_table, req, plen), v_new[t0:t1]]).float()
        # absolute positions: cached key i at i, suffix token j at plen + j
        q_pos = plen + torch.arange(t1 - t0, device=q.device)
        k_pos = torch.arange(plen + t1 - t0, device=q.device)
        out[t0:t1] = _attend(q[t0:t1].float(), k, v, _visible(q_pos, k_pos, window), md.scale, md.softcap)
    return out.to(q.dtype)


def prefix_verify_attention_dense_ref(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: PrefixVerifyMetadata,
    use_sdpa: bool = True,
) -> torch.Tensor:
    """All copies in one masked attention call over a dense [T, keys] mask.

    keys = (for each distinct request, its longest copy prefix) + all T suffix
    tokens.  With `use_sdpa` (and no softcap) the call is
    torch.nn.functional.scaled_dot_product_attention with a boolean mask;
    otherwise an explicit fp32 softmax.  Memory grows with T * keys.
    """
    T = md.num_actual_tokens
    q, k_new, v_new = q[:T], k_new[:T], v_new[:T]
    block_table, scale, softcap, window = md.block_table, md.scale, md.softcap, int(md.sliding_window or 0)
    reqs = md.copy_req.tolist()
    plens = md.copy_prefix_len.tolist()
    cu = md.cu_copy_lens.tolist()
    longest: dict[int, int] = {}
    for r, p in zip(reqs, plens):
        longest[r] = max(longest.get(r, 0), p)
    k_parts, v_parts, base = [], [], {}
    off = 0
    for r, p in longest.items():
        base[r] = off
        k_parts.append(gather_prefix(key_cache, block_table, r, p))
        v_parts.append(gather_prefix(value_cache, block_table, r, p))
        off += p
    suffix_base = off
    k_all = torch.cat(k_parts + [k_new])
    v_all = torch.cat(v_parts + [v_new])
    n_keys = k_all.shape[0]
    # key metadata: owning request (-1 for suffix), absolute position, owning copy (-1 for prefix)
    key_req = torch.full((n_keys,), -1, dtype=torch.long, device=q.device)
    key_pos = torch.empty(n_keys, dtype=torch.long, device=q.device)
    key_copy = torch.full((n_keys,), -1, dtype=torch.long, device=q.device)
    for r, p in longest.items():
        key_req[base[r] : base[r] + p] = r
        key_pos[base[r] : base[r] + p] = torch.arange(p, device=q.device)
    q_req = torch.empty(T, dtype=torch.long, device=q.device)
    q_pos = torch.empty(T, dtype=torch.long, device=q.device)
    q_copy = torch.empty(T, dtype=torch.long, device=q.device)
    q_plen = torch.empty(T, dtype=torch.long, device=q.device)
    for c, (r, p) in enumerate(zip(reqs, plens)):
        t0, t1 = cu[c], cu[c + 1]
        q_req[t0:t1] = r
        q_plen[t0:t1] = p
        q_pos[t0:t1] = p + torch.arange(t1 - t0, device=q.device)
        q_copy[t0:t1] = c
        key_pos[suffix_base + t0 : suffix_base + t1] = p + torch.arange(t1 - t0, device=q.device)
        key_copy[suffix_base + t0 : suffix_base + t1] = c
    prefix_ok = (key_req[None, :] == q_req[:, None]) & (key_pos[None, :] < q_plen[:, None])
    suffix_ok = (key_copy[None, :] == q_copy[:, None]) & (key_pos[None, :] <= q_pos[:, None])
    mask = prefix_ok | suffix_ok
    if window > 0:
        mask &= key_pos[None, :] > q_pos[:, None] - window
    group = q.shape[1] // k_all.shape[1]
    if use_sdpa and not softcap:
        # 4-D inputs and an additive float mask: SDPA's fast (flash) CPU path
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k_all.transpose(0, 1)[None],
            v_all.transpose(0, 1)[None],
            attn_mask=bias,
            scale=scale,
            enable_gqa=group > 1,
        )
        return o[0].transpose(0, 1).to(q.dtype)
    return _attend(q.float(), k_all.float(), v_all.float(), mask, scale, softcap).to(q.dtype)
