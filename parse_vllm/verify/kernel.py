"""The kernel path of the one-pass verification: every (request,
boundary) copy of the verification suffix judged by the target in one
forward, with the verification attention computed by the compiled op
`parse_vllm.ops.prefix_verify_attention` straight from the requests' paged
KV cache.

Same contract as `ForkedBlockTableVerifier` (base.py, forked.py): copy c sees the
first `prefix_len[c]` cached tokens of its request (prompt + draft up to its
boundary) and then its own suffix tokens, causally, at positions
prefix_len[c] .. prefix_len[c] + L - 1; `judge(CopyBatch) -> Judgments`.

How: the target model's own forward runs over the packed suffix tokens of all
copies. For its duration every target `Attention` layer's `impl` is wrapped
(`PrefixVerifyAttentionImpl`), and the forward context gives each layer a
`PrefixVerifyMetadata` and no slot mapping. So vLLM writes no KV
(`unified_kv_cache_update` only writes where there is a slot mapping, and the
wrapper's `do_kv_cache_update` skips this metadata anyway), and the wrapper's
`forward` computes the layer's attention with the op over the layer's cache
(read only) plus the copies' own suffix K/V (`prefix_verify_layer_attention`).
Nothing is copied, no scratch blocks are used, and the request's KV blocks
are never written.

The op reads the standard paged layout ([num_blocks, block_size, Hkv, D]
strided views of the GPU backends' caches, see `_vllm.standard_kv_cache_views`).
vLLM's CPU backend packs its cache per ISA, so on CPU the runner keeps the
forked-block-table verifier; this class refuses a CPU backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parse_vllm import _vllm
from parse_vllm import ops as _ops
from parse_vllm.ops import PrefixVerifyMetadata
from parse_vllm.verify.base import VerifierBase

__all__ = [
    "KernelVerifier",
    "PrefixVerifyMetadata",
    "PrefixVerifyAttentionImpl",
    "PackedCopies",
    "pack_copies",
    "prefix_verify_layer_attention",
]


def prefix_verify_layer_attention(
    query: torch.Tensor,  # [>= T, Hq, D]
    key: torch.Tensor,  # [>= T, Hkv, D], the suffix tokens' keys (after RoPE)
    value: torch.Tensor,  # [>= T, Hkv, D]
    kv_cache: torch.Tensor,  # the layer's bound cache (see _vllm.standard_kv_cache_views)
    md: PrefixVerifyMetadata,
    output: torch.Tensor | None = None,  # [>= T, Hq, D]; rows [0, T) are written
) -> torch.Tensor:
    """One layer's verification attention: rows [0, T) of the result are, for
    suffix token t of copy c, softmax attention over the first
    copy_prefix_len[c] cached tokens of its request and copy c's suffix tokens
    up to t. The cache is only read. Returns `output` (or a new [T, Hq, D])."""
    key_cache, value_cache = _vllm.standard_kv_cache_views(kv_cache, query.shape[-1])
    return _ops.prefix_verify_attention(query, key, value, key_cache, value_cache, md, out=output)


class PrefixVerifyAttentionImpl:
    """Stands in for a layer's vLLM attention impl during a kernel
    verification forward: `PrefixVerifyMetadata` goes to the op, anything
    else (and every other attribute) to the wrapped impl, untouched."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)

    @property
    def inner(self):
        return self._inner

    def __getattr__(self, name):  # only for names not found on the wrapper
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if not isinstance(attn_metadata, PrefixVerifyMetadata):
            return self._inner.forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        # vLLM's call: forward(layer, q, k, v, kv_cache, md, output=, output_scale=, output_block_scale=)
        names = ("output", "output_scale", "output_block_scale")
        extra = dict(zip(names, args))
        extra.update(kwargs)
        if extra.get("output_scale") is not None or extra.get("output_block_scale") is not None:
            raise NotImplementedError("PARSE kernel verification: fused output quantization")
        output = extra.get("output")
        return prefix_verify_layer_attention(query, key, value, kv_cache, attn_metadata, output)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        # vLLM passes no metadata here; the layer's is in the forward context.
        if isinstance(_vllm.current_layer_attn_metadata(layer.layer_name), PrefixVerifyMetadata):
            return None  # suffix KV is scratch: never written to the cache
        return self._inner.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping, *args, **kwargs)


@dataclass
class PackedCopies:
    """The copies of one kernel pass, packed (numpy, host side)."""

    input_ids: np.ndarray  # [T] int32, the suffix once per copy
    positions: np.ndarray  # [T] int64, prefix_len[c] + j
    block_table: np.ndarray  # [R, W] int32, manager block ids of the requests the copies use
    copy_req: np.ndarray  # [C] int32, row of block_table
    copy_prefix_len: np.ndarray  # [C] int32
    cu_copy_lens: np.ndarray  # [C + 1] int32
    last: np.ndarray  # [C] int64, index of each copy's last suffix token


def pack_copies(
    suffix: np.ndarray,  # [L] suffix token ids
    req_row: np.ndarray,  # [C] input-batch row of each copy's request
    prefix_len: np.ndarray,  # [C]
    request_tables: np.ndarray,  # [max_reqs, max_blocks] block table of the input batch
    block_size: int,  # tokens per manager block
) -> PackedCopies:
    """Copies in the given order (PARSE keeps a request's copies consecutive,
    which the kernels exploit); the block table is cut down to the requests
    the copies use and to the blocks their longest prefix needs."""
    L = int(suffix.shape[0])
    C = int(req_row.shape[0])
    prefix_len = np.asarray(prefix_len, dtype=np.int64)
    rows, copy_req = np.unique(np.asarray(req_row, dtype=np.int64), return_inverse=True)
    width = max(1, -(-int(prefix_len.max(initial=0)) // block_size))
    if width > request_tables.shape[1]:
        raise ValueError(f"prefix of {int(prefix_len.max())} tokens is longer than the block table holds")
    table = np.ascontiguousarray(request_tables[rows, :width], dtype=np.int32)
    return PackedCopies(
        input_ids=np.tile(np.asarray(suffix, dtype=np.int32), C),
        positions=(prefix_len[:, None] + np.arange(L)[None, :]).reshape(-1),
        block_table=table,
        copy_req=copy_req.reshape(-1).astype(np.int32),
        copy_prefix_len=prefix_len.astype(np.int32),
        cu_copy_lens=np.arange(0, (C + 1) * L, L, dtype=np.int32),
        last=np.arange(1, C + 1, dtype=np.int64) * L - 1,
    )


class KernelVerifier(VerifierBase):
    """`judge(CopyBatch) -> Judgments` with the verification attention of
    every target layer done by `parse_vllm.ops.prefix_verify_attention`.

    Constructor arguments as `ForkedBlockTableVerifier`'s; `scratch_ids` and
    `max_rows_per_pass` are accepted for a drop-in swap and unused (the kernel
    path needs no scratch blocks and no backend metadata builder).
    `max_tokens_per_pass` bounds the suffix tokens of one forward (the
    runner's activation budget, e.g. max_num_batched_tokens); more copies run
    in several passes. `layer_caches` (the runner's caches, addressed by
    manager block ids) are read only for `check_isolation`.
    """

    def __init__(
        self,
        target,
        *,
        scratch_ids: np.ndarray | None = None,
        max_rows_per_pass: int | None = None,
        **common,
    ):
        del scratch_ids, max_rows_per_pass  # see the class docstring
        super().__init__(target, **common)  # VerifierBase's arguments

        self.layers = _vllm.target_attention_layers(target.model, self.layer_names)
        cpu = [n for n, layer in self.layers.items() if _vllm.is_cpu_attention_backend(layer)]
        if cpu:
            raise NotImplementedError(
                "PARSE kernel verifier: the target's attention layers (e.g. "
                f"{cpu[0]}) use vLLM's CPU attention backend "
                f"({_vllm.attention_backend_name(self.layers[cpu[0]])}), whose paged KV "
                "cache is packed per CPU ISA; the prefix_verify_attention kernel reads "
                "only the standard [num_blocks, block_size, Hkv, D] layout of the GPU "
                "backends. On CPU use the forked-block-table verifier "
                "(parse_vllm.verify.forked.ForkedBlockTableVerifier)."
            )
        for name, layer in self.layers.items():
            reason = _vllm.kernel_verify_unsupported(layer)
            if reason is None and layer.head_size not in _ops.SUPPORTED_HEAD_SIZES:
                reason = f"head size {layer.head_size} (the kernel has {_ops.SUPPORTED_HEAD_SIZES})"
            if reason is not None:
                raise NotImplementedError(
                    f"PARSE kernel verifier: layer {name}: {reason} is not supported; "
                    "use the forked-block-table verifier"
                )
            # The bound cache must be readable as standard views (raises if not).
            key_cache, _ = _vllm.standard_kv_cache_views(_vllm.bound_kv_cache(layer), layer.head_size)
            if key_cache.shape[2] != layer.num_kv_heads:
                raise ValueError(f"layer {name}: cache has {key_cache.shape[2]} kv heads, layer {layer.num_kv_heads}")
        if _vllm.kv_transfer_configured(target.vllm_config):
            raise NotImplementedError(
                "PARSE kernel verifier: a KV connector (kv_transfer_config) would save "
                "the verification forward's KV; use the forked-block-table verifier"
            )
        has_kernel = (
            _ops.has_cuda_op() if self.device.type == "cuda" else (self.device.type == "cpu" and _ops.has_compiled_op())
        )
        if has_kernel and self.device.type == "cuda":
            why = _ops.cuda_arch_unsupported(torch.cuda.get_device_capability(self.device))
            if why is not None:
                raise NotImplementedError(f"PARSE kernel verifier: {why}")
        if not has_kernel:
            raise RuntimeError(
                f"PARSE kernel verifier: parse_vllm.ops.prefix_verify_attention has no "
                f"{self.device.type} kernel in this build ({_ops.compiled_op_error() or 'not compiled for it'}); "
                "rebuild with `pip install --no-build-isolation -e .` (CUDA needs nvcc), or "
                "use the forked-block-table verifier"
            )
        self.layer_params = {n: _vllm.attention_layer_params(layer) for n, layer in self.layers.items()}

    def layer_metadata(
        self, packed: PackedCopies
    ) -> tuple[dict[str, PrefixVerifyMetadata], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-layer metadata of one pass on the model's device, and the pass's input ids,
        positions and last rows [C] there: everything in one staged copy."""
        tables = self.target.layer_block_tables(self.group_id, packed.block_table)
        distinct = list({id(tables[n]): tables[n] for n in self.layer_names}.values())
        copy_req, copy_prefix_len, cu, input_ids, positions, last, *on_device = self.to_device(
            packed.copy_req,
            packed.copy_prefix_len,
            packed.cu_copy_lens,
            packed.input_ids,
            packed.positions,
            packed.last,
            *[np.ascontiguousarray(t) for t in distinct],
        )
        table_of = {id(t): d for t, d in zip(distinct, on_device)}
        T = int(packed.cu_copy_lens[-1])
        max_prefix = int(packed.copy_prefix_len.max()) if len(packed.copy_prefix_len) else 0
        out = {}
        for name in self.layer_names:
            scale, softcap, window = self.layer_params[name]
            out[name] = PrefixVerifyMetadata(
                block_table=table_of[id(tables[name])],
                copy_req=copy_req,
                copy_prefix_len=copy_prefix_len,
                cu_copy_lens=cu,
                num_actual_tokens=T,
                scale=scale,
                softcap=softcap,
                sliding_window=window,
                max_prefix_len=max_prefix,
            )
        return out, input_ids, positions, last

    def _judge_pass(self, req_row: np.ndarray, prefix_len: np.ndarray) -> torch.Tensor:
        packed = pack_copies(
            self.suffix,
            req_row,
            prefix_len,
            self.target.block_table(self.group_id),
            self.block_size,
        )
        md, input_ids, positions, last = self.layer_metadata(packed)
        with _vllm.replaced_attention_impls(self.layers, PrefixVerifyAttentionImpl):
            hidden = self.target.forward_with_layer_metadata(input_ids=input_ids, positions=positions, attn_metadata=md)
        return hidden[self.labels.row_index(last)]  # [C * rows, H]
