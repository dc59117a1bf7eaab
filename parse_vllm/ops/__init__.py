"""Compiled ops of parse-vllm.

The one op is `prefix_verify_attention`: the attention of PARSE's single
verification pass.  Its full contract is the docstring of
`prefix_verify_attention` below (mirrored in csrc/README.md).

Importing this module loads the extension `parse_vllm._C` (built by setup.py)
if it is there; a missing extension is only an error when the op is called.
The plain-PyTorch reference is `parse_vllm.ops.reference.prefix_verify_attention_ref`.
"""

from __future__ import annotations

import importlib.util

import torch

from parse_vllm.ops.metadata import PrefixVerifyMetadata
from parse_vllm.ops.reference import prefix_verify_attention_ref

__all__ = [
    "PrefixVerifyMetadata",
    "op_arguments",
    "prefix_verify_attention",
    "prefix_verify_attention_ref",
    "has_compiled_op",
    "has_cuda_op",
    "compiled_op_error",
    "compiled_op_unusable",
    "cuda_archs",
    "cuda_arch_unsupported",
    "cpu_isa",
    "SUPPORTED_HEAD_SIZES",
]

_OP_NAME = "parse_vllm::prefix_verify_attention"
_REBUILD_HINT = (
    "rebuild the compiled op from the repository root with "
    "`pip install --no-build-isolation -e .` (see setup.py; CUDA needs torch with CUDA and nvcc, "
    "or PARSE_VLLM_BUILD_CUDA=1 to insist)"
)

_REINSTALL_HINT = (
    "install vLLM first, then parse-vllm against vLLM's torch: "
    "in a clone of parse-vllm, `pip install --no-build-isolation --no-deps --force-reinstall '.[gpu]'` (README, Install)"
)

_load_error: str | None = None
_built = importlib.util.find_spec("parse_vllm._C") is not None  # a built library is here
try:  # registers torch.ops.parse_vllm.* (CPU always, CUDA when it was built)
    import parse_vllm._C  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the build
    _load_error = f"{type(e).__name__}: {e}"

# The shapes the CUDA kernel is judged at, (context, K, Hq, Hkv): head size 128, a
# 24-token suffix per copy, one request with K nested prefixes (issue 35's goal table,
# scripts/bench_kernel.py --goals). The verifier factory's `auto` trusts the kernel only
# where a recorded measurement shows it faster at every one of them.
GOAL_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (2048, 8, 8, 2),
    (2048, 16, 8, 2),
    (8192, 8, 8, 2),
    (32768, 4, 8, 2),
    (32768, 8, 8, 2),
    (32768, 16, 8, 2),
    (2048, 8, 32, 8),
    (8192, 8, 32, 8),
)

# Head sizes the kernels are built for (csrc/ops.h; none without the op).
SUPPORTED_HEAD_SIZES: tuple[int, ...] = (
    tuple(torch.ops.parse_vllm.supported_head_sizes()) if _load_error is None else ()
)


def has_compiled_op() -> bool:
    """True iff the extension is loaded and the op has a CPU kernel."""
    return _load_error is None and torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, "CPU")


def has_cuda_op() -> bool:
    """True iff the extension was built with the CUDA kernel."""
    return _load_error is None and torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, "CUDA")


def compiled_op_error() -> str | None:
    """Why the extension failed to load (None when it loaded)."""
    return _load_error


def built_for_torch() -> str | None:
    """The torch version the loaded extension was compiled against (None: none loaded)."""
    return torch.ops.parse_vllm.built_for_torch() if _load_error is None else None


def compiled_op_unusable() -> str | None:
    """Why the extension that was built here cannot serve this torch (None: it can, or none
    was built). A library compiled against another torch either fails to load (missing C++
    symbols) or loads with another ABI; both are errors, not a quiet fallback: it happens
    when pip replaces torch after the op was built (vLLM brings its own torch)."""
    if not _built:
        return None
    if _load_error is not None:
        return (
            f"parse_vllm._C is installed but does not load with torch {torch.__version__} ({_load_error}); "
            f"it was likely built against another torch: {_REINSTALL_HINT}"
        )
    built = built_for_torch()
    if built != torch.__version__.split("+")[0]:
        return f"parse_vllm._C was built against torch {built}, this is torch {torch.__version__}: {_REINSTALL_HINT}"
    return None


def cuda_archs() -> tuple[str, ...]:
    """The CUDA architectures the kernel was compiled for ("8.0", "9.0+PTX", ...; none without it)."""
    if not has_cuda_op():
        return ()
    return tuple(a for a in torch.ops.parse_vllm.cuda_archs().split(",") if a)


def cuda_arch_unsupported(capability: tuple[int, int], archs: tuple[str, ...] | None = None) -> str | None:
    """Why the kernel cannot run on a GPU of compute capability `capability` (None: it can).
    Machine code for sm_XY runs on sm_XZ with Z >= Y (same major); PTX for compute_XY is
    compiled by the driver for any later GPU."""
    archs = cuda_archs() if archs is None else archs
    major, minor = capability
    for arch in archs:
        ptx = arch.endswith("+PTX")
        a_major, a_minor = (int(x) for x in arch.removesuffix("+PTX").split("."))
        if (a_major == major and a_minor <= minor) or (ptx and (a_major, a_minor) <= (major, minor)):
            return None
    return (
        f"the CUDA kernel was built for {', '.join(archs) or 'no GPU'}, not for this GPU (sm_{major}{minor}); "
        "rebuild with PARSE_VLLM_CUDA_ARCHS naming it"
    )


def cpu_isa() -> str | None:
    """SIMD flavour the CPU twin was compiled for ('avx512', 'avx2', 'default')."""
    return torch.ops.parse_vllm.cpu_isa() if has_compiled_op() else None


def op_arguments(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: PrefixVerifyMetadata,
    out: torch.Tensor,
) -> tuple:
    """The compiled op's flat arguments in its schema's order (csrc/torch_bindings.cpp):
    the one place in Python that spells it (the face below; tests that call
    the op directly, e.g. inside a CUDA graph)."""
    T = md.num_actual_tokens
    return (
        out[:T],
        q[:T],
        k_new[:T],
        v_new[:T],
        key_cache,
        value_cache,
        md.block_table,
        md.copy_req,
        md.copy_prefix_len,
        md.cu_copy_lens,
        float(md.scale),
        float(md.softcap),
        int(md.sliding_window or 0),
        int(md.max_prefix_len or 0),
    )


def prefix_verify_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: PrefixVerifyMetadata,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of PARSE's verification pass: copies of a verification suffix,
    copy c seeing the first md.copy_prefix_len[c] cached tokens of its request
    plus its own suffix tokens causally. Rows [0, T) of `out` (allocated
    [T, Hq, D] when None) are written, T = md.num_actual_tokens; returns `out`.

    Compiled op: ``torch.ops.parse_vllm.prefix_verify_attention(out, q, k_new,
    v_new, key_cache, value_cache, block_table, copy_req, copy_prefix_len,
    cu_copy_lens, scale: float, softcap: float, sliding_window: int,
    max_prefix_len: int = 0) -> ()`` (mutates `out`; `sliding_window` 0 = off
    there; `max_prefix_len` 0 = bounded by the block table's width). This face is the one place
    that spells its argument order; the op checks its arguments once
    (csrc/torch_bindings.cpp, `check_prefix_verify_args`) and this face raises
    its complaints as ValueError.

    Notation: T suffix tokens in all, C copies, R requests (block-table rows),
    Hq query heads, Hkv kv heads (Hq % Hkv == 0; query head h uses kv head
    h // (Hq // Hkv)), D head size in SUPPORTED_HEAD_SIZES.

    Tensors (one dtype `dt` in {float32, float16, bfloat16} for all float
    tensors; accumulation is fp32; all tensors on one device; the last (head)
    dim of every float tensor must be contiguous, other strides are free):

    ==================  ===========================  =========  ==========================================
    argument            shape                        dtype      meaning
    ==================  ===========================  =========  ==========================================
    q                   [>= T, Hq, D]                dt         queries of the suffix tokens, packed by copy
    k_new, v_new        [>= T, Hkv, D]               dt         keys/values of the suffix tokens; scratch,
                                                                never written to (nor read from) the cache
    key_cache,          [num_blocks, block_size,     dt         paged KV cache as a strided view: vLLM's
    value_cache          Hkv, D]                                FlashAttention layout (kv_cache[0] /
                                                                kv_cache[1]); FlashInfer NHD
                                                                [num_blocks, 2, block_size, Hkv, D]:
                                                                kv[:, 0] / kv[:, 1]; HND
                                                                [num_blocks, Hkv, block_size, D]:
                                                                cache.transpose(1, 2). Any block size.
    md                  PrefixVerifyMetadata                    block table, copies, scale, softcap, window
    out                 [>= T, Hq, D] or None        dt         result (rows [0, T) written)
    ==================  ===========================  =========  ==========================================

    Scalars: `scale` (> 0); `softcap` (logits become softcap * tanh(scale *
    q.k / softcap) before the softmax; 0 = off); `sliding_window` (None or 0 =
    off; else a query at absolute position p sees only keys at positions
    > p - sliding_window); `max_prefix_len` (None, or an int >= every
    copy_prefix_len: the CUDA kernels size their key splits from it; checked
    when the index tensors are on the CPU).

    Semantics. Cached token i of a request is at absolute position i; suffix
    token j of copy c at position P_c + j. For suffix token t = cu[c] + j and
    query head h (kv head g = h // (Hq // Hkv)):

        keys  = [key_cache tokens 0..P_c-1 of request copy_req[c] ;  k_new[cu[c] .. t]]
        out[t, h] = softmax(scale * q[t, h] . keys[:, g]  (soft-capped, windowed)) . values[:, g]

    Copies of one request should be consecutive in the copy order (PARSE packs
    them that way): the kernels walk a request's cached blocks once per run of
    consecutive copies of that request and apply each block to every copy that
    sees it. Non-consecutive copies still give correct results.

    Checks: shapes, dtypes, devices, strides, head size and scalars always;
    index values (cu_copy_lens against T, copy_req within the block table,
    prefixes the table holds, block ids within the cache) when the index
    tensors are on the CPU. On CUDA the values are not read (that would
    synchronise): bad values are undefined behaviour there.
    """
    T = md.num_actual_tokens
    if out is None:
        out = torch.empty((T, *q.shape[1:]), dtype=q.dtype, device=q.device)
    if _load_error is not None:
        raise RuntimeError(f"parse_vllm: the compiled op is missing ({_load_error}); {_REBUILD_HINT}")
    key = "CUDA" if q.device.type == "cuda" else q.device.type.upper()
    if not torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, key):
        raise RuntimeError(
            f"parse_vllm: prefix_verify_attention has no {key} kernel in this build "
            f"(CPU kernel: {has_compiled_op()}, CUDA kernel: {has_cuda_op()}); {_REBUILD_HINT}"
        )
    try:
        torch.ops.parse_vllm.prefix_verify_attention(*op_arguments(q, k_new, v_new, key_cache, value_cache, md, out))
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else ""
        if first.startswith("prefix_verify_attention: "):
            raise ValueError(first) from None
        raise
    return out
