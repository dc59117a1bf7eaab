"""Compiled ops of parse-vllm.

The one op is `prefix_verify_attention`: the attention of PARSE's single
verification pass.  Its full contract is the docstring of
`prefix_verify_attention` below (mirrored in csrc/README.md).

Importing this module loads the extension `parse_vllm._C` (built by setup.py)
if it is there; a missing extension is only an error when the op is called.
The plain-PyTorch reference is `parse_vllm.ops.reference.prefix_verify_attention_ref`.
"""

from __future__ import annotations

import torch

from parse_vllm.ops.reference import prefix_verify_attention_ref

__all__ = [
    "prefix_verify_attention",
    "prefix_verify_attention_ref",
    "check_inputs",
    "has_compiled_op",
    "has_cuda_op",
    "compiled_op_error",
    "cpu_isa",
    "SUPPORTED_HEAD_SIZES",
]

SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 128, 256)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OP_NAME = "parse_vllm::prefix_verify_attention"
_REBUILD_HINT = (
    "rebuild the compiled op from the repository root with "
    "`pip install --no-build-isolation -e .` (see setup.py; CUDA needs torch with CUDA and nvcc, "
    "or PARSE_VLLM_BUILD_CUDA=1 to insist)"
)

_load_error: str | None = None
try:  # registers torch.ops.parse_vllm.* (CPU always, CUDA when it was built)
    import parse_vllm._C  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the build
    _load_error = f"{type(e).__name__}: {e}"


def has_compiled_op() -> bool:
    """True iff the extension is loaded and the op has a CPU kernel."""
    return _load_error is None and torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, "CPU")


def has_cuda_op() -> bool:
    """True iff the extension was built with the CUDA kernel."""
    return _load_error is None and torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, "CUDA")


def compiled_op_error() -> str | None:
    """Why the extension failed to load (None when it loaded)."""
    return _load_error


def cpu_isa() -> str | None:
    """SIMD flavour the CPU twin was compiled for ('avx512', 'avx2', 'default')."""
    return torch.ops.parse_vllm.cpu_isa() if has_compiled_op() else None


def _fail(msg: str) -> None:
    raise ValueError(f"prefix_verify_attention: {msg}")


def check_inputs(
    out: torch.Tensor | None,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    copy_req: torch.Tensor,
    copy_prefix_len: torch.Tensor,
    cu_copy_lens: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    sliding_window: int | None = None,
    *,
    check_values: bool | None = None,
) -> None:
    """Raise ValueError naming the first problem with the arguments.

    Shapes, dtypes, devices and strides are always checked (metadata only).
    Values (cu_copy_lens consistent with T, copy_req within the block table,
    prefixes no longer than the block table holds, block ids within the cache)
    are checked when `check_values` is True, or when it is None and the index
    tensors are on the CPU (free there; on a GPU it would synchronise).
    """
    tensors = dict(
        q=q,
        k_new=k_new,
        v_new=v_new,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        copy_req=copy_req,
        copy_prefix_len=copy_prefix_len,
        cu_copy_lens=cu_copy_lens,
    )
    if out is not None:
        tensors["out"] = out
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        _fail(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    T, Hq, D = q.shape
    for name in ("k_new", "v_new"):
        t = tensors[name]
        if t.dim() != 3 or t.shape[0] != T or t.shape[2] != D:
            _fail(f"{name} must be [T={T}, Hkv, D={D}], got shape {tuple(t.shape)}")
    if k_new.shape != v_new.shape:
        _fail(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} differ")
    Hkv = k_new.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        _fail(f"Hq={Hq} query heads is not a multiple of Hkv={Hkv} kv heads")
    if D not in SUPPORTED_HEAD_SIZES:
        _fail(f"head size D={D} not supported (supported: {SUPPORTED_HEAD_SIZES})")
    if out is not None and out.shape != q.shape:
        _fail(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    for name in ("key_cache", "value_cache"):
        t = tensors[name]
        if t.dim() != 4 or t.shape[2] != Hkv or t.shape[3] != D:
            _fail(
                f"{name} must be a [num_blocks, block_size, Hkv={Hkv}, D={D}] view, got shape "
                f"{tuple(t.shape)} (HND caches: pass cache.transpose(1, 2); FlashInfer's "
                f"[num_blocks, 2, block_size, Hkv, D]: pass kv[:, 0] and kv[:, 1])"
            )
    if key_cache.shape != value_cache.shape:
        _fail(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ")
    if block_table.dim() != 2:
        _fail(f"block_table must be [R, max_blocks], got shape {tuple(block_table.shape)}")
    for name in ("copy_req", "copy_prefix_len", "cu_copy_lens"):
        if tensors[name].dim() != 1:
            _fail(f"{name} must be 1-D, got shape {tuple(tensors[name].shape)}")
    C = copy_req.shape[0]
    if copy_prefix_len.shape[0] != C:
        _fail(f"copy_prefix_len has {copy_prefix_len.shape[0]} entries, copy_req has {C}")
    if cu_copy_lens.shape[0] != C + 1:
        _fail(f"cu_copy_lens must have C+1={C + 1} entries, got {cu_copy_lens.shape[0]}")
    if q.dtype not in _DTYPES:
        _fail(f"q has dtype {q.dtype}; supported: float32, float16, bfloat16")
    for name in ("out", "k_new", "v_new", "key_cache", "value_cache"):
        if name in tensors and tensors[name].dtype != q.dtype:
            _fail(f"{name} has dtype {tensors[name].dtype}, q has {q.dtype} (all must match)")
    for name in ("block_table", "copy_req", "copy_prefix_len", "cu_copy_lens"):
        if tensors[name].dtype != torch.int32:
            _fail(f"{name} must be int32, got {tensors[name].dtype}")
        if tensors[name].numel() > 1 and tensors[name].stride(-1) != 1:
            _fail(f"{name} needs a contiguous last dim (stride {tensors[name].stride()})")
    for name, t in tensors.items():
        if t.device != q.device:
            _fail(f"{name} is on {t.device}, q on {q.device} (all tensors must share a device)")
    for name in ("out", "q", "k_new", "v_new", "key_cache", "value_cache"):
        t = tensors.get(name)
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            _fail(f"{name} must have a contiguous head dim (last stride 1), got strides {t.stride()}")
    if not (isinstance(scale, (int, float)) and scale > 0 and scale == scale and scale != float("inf")):
        _fail(f"scale must be a finite float > 0, got {scale!r}")
    if not (isinstance(softcap, (int, float)) and 0 <= softcap < float("inf")):
        _fail(f"softcap must be >= 0 (0 = off), got {softcap!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 0):
        _fail(f"sliding_window must be None/0 (off) or a positive int, got {sliding_window!r}")

    if check_values is None:
        check_values = copy_req.device.type == "cpu"
    if not check_values:
        return
    cu = cu_copy_lens.tolist()
    if C > 0 and cu[0] != 0:
        _fail(f"cu_copy_lens[0] must be 0, got {cu[0]}")
    if cu[-1] != T:
        _fail(f"cu_copy_lens[-1]={cu[-1]} must equal the number of suffix tokens T={T}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        _fail(f"cu_copy_lens must be non-decreasing, got {cu}")
    R, max_blocks = block_table.shape
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    reqs, plens = copy_req.tolist(), copy_prefix_len.tolist()
    for c, (r, p) in enumerate(zip(reqs, plens)):
        if not 0 <= r < R:
            _fail(f"copy_req[{c}]={r} is not a block-table row (R={R})")
        if p < 0:
            _fail(f"copy_prefix_len[{c}]={p} is negative")
        if p > max_blocks * block_size:
            _fail(
                f"copy_prefix_len[{c}]={p} is longer than the block table holds "
                f"({max_blocks} blocks x {block_size} tokens = {max_blocks * block_size})"
            )
    longest: dict[int, int] = {}
    for r, p in zip(reqs, plens):
        longest[r] = max(longest.get(r, 0), p)
    for r, p in longest.items():
        used = block_table[r, : -(-p // block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            _fail(
                f"block_table row {r} names blocks outside the cache (0..{num_blocks - 1}) within its first {p} tokens"
            )


def prefix_verify_attention(
    out: torch.Tensor | None,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    copy_req: torch.Tensor,
    copy_prefix_len: torch.Tensor,
    cu_copy_lens: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    sliding_window: int | None = None,
    *,
    check_values: bool | None = None,
) -> torch.Tensor:
    """Attention of PARSE's verification pass: K copies of a verification suffix,
    copy c seeing the first copy_prefix_len[c] cached tokens of its request plus
    its own suffix tokens causally.  Writes and returns `out`.

    Compiled op: ``torch.ops.parse_vllm.prefix_verify_attention(out, q, k_new,
    v_new, key_cache, value_cache, block_table, copy_req, copy_prefix_len,
    cu_copy_lens, scale: float, softcap: float, sliding_window: int) -> ()``
    (mutates `out`; `sliding_window` 0 = off there).  This wrapper checks the
    arguments (ValueError), allocates `out` when it is None and calls it.

    Notation: T suffix tokens in all, C copies, R requests (block-table rows),
    Hq query heads, Hkv kv heads (Hq % Hkv == 0; query head h uses kv head
    h // (Hq // Hkv)), D head size in {32, 64, 80, 96, 128, 256}.

    Tensors (one dtype `dt` in {float32, float16, bfloat16} for all float
    tensors; accumulation is fp32; all tensors on one device; the last (head)
    dim of every float tensor must be contiguous, other strides are free):

    ==================  ===========================  =========  ==========================================
    argument            shape                        dtype      meaning
    ==================  ===========================  =========  ==========================================
    out                 [T, Hq, D]                   dt         result (every element written); None: allocated
    q                   [T, Hq, D]                   dt         queries of the suffix tokens, packed by copy
    k_new, v_new        [T, Hkv, D]                  dt         keys/values of the suffix tokens; scratch,
                                                                never written to (nor read from) the cache
    key_cache,          [num_blocks, block_size,     dt         paged KV cache as a strided view: vLLM's
    value_cache          Hkv, D]                                FlashAttention layout (kv_cache[0] /
                                                                kv_cache[1]); FlashInfer NHD
                                                                [num_blocks, 2, block_size, Hkv, D]:
                                                                kv[:, 0] / kv[:, 1]; HND
                                                                [num_blocks, Hkv, block_size, D]:
                                                                cache.transpose(1, 2). Any block size.
    block_table         [R, max_blocks]              int32      physical block ids per request
    copy_req            [C]                          int32      request (block-table row) of copy c
    copy_prefix_len     [C]                          int32      P_c: copy c sees cached tokens [0, P_c)
                                                                of its request (P_c may be 0)
    cu_copy_lens        [C + 1]                      int32      copy c owns suffix tokens
                                                                [cu[c], cu[c+1]); cu[0] = 0, cu[C] = T
    ==================  ===========================  =========  ==========================================

    Scalars: `scale` (> 0, usually D**-0.5); `softcap` (logits become
    softcap * tanh(scale * q.k / softcap) before the softmax; 0 = off);
    `sliding_window` (None or 0 = off; else a query at absolute position p sees
    only keys at positions > p - sliding_window).

    Semantics.  Cached token i of a request is at absolute position i; suffix
    token j of copy c at position P_c + j.  For suffix token t = cu[c] + j and
    query head h (kv head g = h // (Hq // Hkv)):

        keys  = [key_cache tokens 0..P_c-1 of request copy_req[c] ;  k_new[cu[c] .. t]]
        out[t, h] = softmax(scale * q[t, h] . keys[:, g]  (soft-capped, windowed)) . values[:, g]

    Copies of one request should be consecutive in the copy order (PARSE packs
    them that way): the kernels walk a request's cached blocks once per run of
    consecutive copies of that request and apply each block to every copy that
    sees it.  Non-consecutive copies still give correct results.

    `check_values`: see `check_inputs` (default: check index values when they
    are on the CPU; never synchronises a GPU unless asked).
    """
    check_inputs(
        out,
        q,
        k_new,
        v_new,
        key_cache,
        value_cache,
        block_table,
        copy_req,
        copy_prefix_len,
        cu_copy_lens,
        scale,
        softcap,
        sliding_window,
        check_values=check_values,
    )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if _load_error is not None:
        raise RuntimeError(f"parse_vllm: the compiled op is missing ({_load_error}); {_REBUILD_HINT}")
    key = "CUDA" if q.device.type == "cuda" else q.device.type.upper()
    if not torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, key):
        raise RuntimeError(
            f"parse_vllm: prefix_verify_attention has no {key} kernel in this build "
            f"(CPU kernel: {has_compiled_op()}, CUDA kernel: {has_cuda_op()}); {_REBUILD_HINT}"
        )
    torch.ops.parse_vllm.prefix_verify_attention(
        out,
        q,
        k_new,
        v_new,
        key_cache,
        value_cache,
        block_table,
        copy_req,
        copy_prefix_len,
        cu_copy_lens,
        float(scale),
        float(softcap),
        int(sliding_window or 0),
    )
    return out
