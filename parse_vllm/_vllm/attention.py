"""The target's attention layers and their paged KV caches: which layers, in
which KV-cache group, bound to which cache in which layout, through which
backend; what the kernel verification path may stand in for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def attention_layer_names(model: torch.nn.Module) -> list[str]:
    """Names of the Attention layers inside `model` (the target only: the
    drafter's layers live in its own module tree)."""
    from vllm.model_executor.layers.attention.attention import Attention

    return [m.layer_name for m in model.modules() if isinstance(m, Attention)]


def kv_cache_group_of_layers(kv_cache_config, layer_names: Iterable[str]) -> int:
    """Index of the one KV-cache group holding all `layer_names`; raises if the
    target's layers are split over several groups (hybrid KV cache)."""
    wanted = set(layer_names)
    groups = [gid for gid, g in enumerate(kv_cache_config.kv_cache_groups) if wanted & set(g.layer_names)]
    if len(groups) != 1:
        raise NotImplementedError(
            "PARSE's verification pass forks the target's block table, so it "
            "needs all of the target's attention layers in one KV-cache group; "
            f"this model's layers are in groups {groups}. For models with "
            "sliding-window layers (e.g. Gemma 3) pass "
            "--disable-hybrid-kv-cache-manager."
        )
    return groups[0]


def copy_kv_blocks(
    kv_caches: Sequence[torch.Tensor],
    num_blocks: int,
    pairs: Sequence[tuple[int, int]],
) -> None:
    """Whole-block copies src -> dst in every given layer cache, with vLLM's
    own layout-agnostic copier (vllm.v1.worker.utils.copy_kv_cache_blocks_inplace): whole blocks stay
    valid under the CPU backend's per-ISA packing of K and V."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    copy_kv_cache_blocks_inplace(kv_caches, num_blocks, [KVCacheBlockCopy(s, d) for s, d in pairs])


# --- kernel verification path ---
#
# What parse_vllm/verify/kernel.py needs from vLLM, read against vLLM 0.32.0
# and 0.33.0 (the same unless said otherwise):
#
# - vllm.model_executor.layers.attention.attention.Attention.forward calls
#   `unified_kv_cache_update(key, value, layer_name)` (same module), which
#   writes the KV cache only when the forward context holds a slot mapping
#   for the layer, then `unified_attention_with_output` (same module), which
#   calls `layer.impl.forward(layer, query, key, value, kv_cache,
#   attn_metadata, output=, output_scale=, output_block_scale=)` with the
#   layer's metadata from `get_attention_context` (same module: a dict of
#   per-layer metadata is indexed by layer name) and the layer's bound cache
#   `layer.kv_cache`. `layer.impl` is looked up at call time, so it can be
#   swapped around one forward. 0.33 adds `Attention.kv_cache_update_bypass`:
#   a model that writes KV in its own fused op calls attention with key=None
#   (only the muse_spark AMD model in 0.33); the kernel path refuses such
#   layers.
# - vllm.forward_context.set_forward_context(attn_metadata, vllm_config,
#   num_tokens=, slot_mapping=).
# - FlashAttentionImpl.forward / .do_kv_cache_update
#   (vllm.v1.attention.backends.flash_attn), TritonAttentionImpl
#   (vllm.v1.attention.backends.triton_attn) and FlashInferImpl
#   (vllm.v1.attention.backends.flashinfer), the same methods: the per-layer
#   KV cache of these GPU backends is one logical [num_blocks, Hkv,
#   block_size, 2 * D] view (K in content [0, D), V in [D, 2D); physical
#   order set by KVCacheLayout), read as `kv_cache.transpose(1, 2).split(D,
#   dim=-1)` -> two [num_blocks, block_size, Hkv, D] strided views. Older
#   vLLMs (and maybe others) bind [2, num_blocks, block_size, Hkv, D]; both
#   are accepted below.
# - vllm.v1.attention.backends.cpu_attn: CPU_ATTN packs K/V per ISA, which the
#   kernel cannot read.
# - vllm.v1.worker.utils.AttentionGroup (module identical in 0.33): with
#   `kernel_block_size` set, the layers' bound caches and block tables
#   address kernel blocks (`AttentionGroup.map_to_kernel_block_table`: kernel
#   block j of block b is b * (kernel_block_stride or blocks_per_block) + j).

# Backends whose bound per-layer cache is the logical [num_blocks, Hkv,
# block_size, 2*D] view above (unquantized). A backend class may also opt in
# by setting `parse_standard_kv_layout = True`.
KERNEL_VERIFY_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"})
# vLLM's CPU backends: ISA-packed KV blocks.
CPU_ATTENTION_BACKENDS = frozenset({"CPU_ATTN", "CPU_MLA", "AMX_MLA"})


def attention_backend_name(layer) -> str:
    """The name vLLM gives the layer's attention backend ("FLASH_ATTN", "CPU_ATTN", ...)."""
    return str(layer.attn_backend.get_name())


def is_cpu_attention_backend(layer) -> bool:
    backend = layer.attn_backend
    return attention_backend_name(layer) in CPU_ATTENTION_BACKENDS or backend.__module__.startswith(
        "vllm.v1.attention.backends.cpu_attn"
    )


def target_attention_layers(model: torch.nn.Module, layer_names: Sequence[str]) -> dict[str, Any]:
    """The target's vLLM `Attention` modules by layer name, in `layer_names`
    order. Raises when a name is missing or the model has other attention
    layers (MLA, ...) that a verification forward would also run."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    found: dict[str, Any] = {}
    others: list[str] = []
    for m in model.modules():
        if isinstance(m, Attention):
            found[m.layer_name] = m
        elif isinstance(m, AttentionLayerBase):
            others.append(f"{getattr(m, 'layer_name', '?')} ({type(m).__name__})")
    if others:
        raise NotImplementedError(
            f"PARSE's kernel verification path handles vLLM `Attention` layers only; this model also has {others[:4]}"
        )
    missing = [n for n in layer_names if n not in found]
    if missing:
        raise RuntimeError(f"attention layers {missing[:4]} are not in the target model")
    return {n: found[n] for n in layer_names}


def kernel_verify_unsupported(layer) -> str | None:
    """Why the prefix_verify_attention kernel cannot stand in for this layer's
    attention (None when it can): the kernel computes plain causal softmax
    attention (GQA, scale, soft-cap, sliding window) over an unquantized cache."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionType

    try:  # 0.32: vllm.utils.torch_utils.is_quantized_kv_cache
        from vllm.utils.torch_utils import is_quantized_kv_cache
    except ImportError:  # 0.33: only vllm.v1.kv_cache_interface.is_quantized_kv_cache (any non-NONE KVQuantMode)
        from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    name = attention_backend_name(layer)
    impl = layer.impl
    if type(layer) is not Attention:
        return f"{type(layer).__name__} layers (not plain causal attention)"
    if layer.attn_type != AttentionType.DECODER:
        return f"attention type {layer.attn_type}"
    if name not in KERNEL_VERIFY_BACKENDS and not getattr(layer.attn_backend, "parse_standard_kv_layout", False):
        return (
            f"attention backend {name}, whose KV cache layout the kernel path does not know "
            f"(known: {sorted(KERNEL_VERIFY_BACKENDS)})"
        )
    if is_quantized_kv_cache(str(layer.kv_cache_dtype)):
        return f"quantized KV cache (kv_cache_dtype={layer.kv_cache_dtype})"
    if getattr(layer, "query_quant", None) is not None:
        return "quantized queries"
    if getattr(layer, "kv_cache_update_bypass", False):
        # 0.33 Attention.kv_cache_update_bypass: the model writes this layer's KV in a fused op
        # (through the slot mapping) and passes key=value=None to attention.
        return "KV written by a fused model op (kv_cache_update_bypass)"
    if getattr(impl, "alibi_slopes", None) is not None or getattr(layer, "use_alibi_sqrt", False):
        return "ALiBi"
    if getattr(layer, "has_sink", False) or getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if layer.head_size_v != layer.head_size:
        return f"value head size {layer.head_size_v} != key head size {layer.head_size}"
    if layer.kv_sharing_target_layer_name is not None:
        # Such a layer reads another layer's KV, including that layer's suffix
        # KV, which the kernel path never writes to the cache.
        return f"cross-layer KV sharing (with {layer.kv_sharing_target_layer_name})"
    if getattr(layer, "use_mm_prefix", False):
        return "prefix-LM (bidirectional multimodal) attention"
    if getattr(impl, "dcp_world_size", 1) > 1 or getattr(impl, "pcp_world_size", 1) > 1:
        return "context parallelism (the KV cache is sharded across ranks)"
    return None


def attention_layer_params(layer) -> tuple[float, float, int | None]:
    """(scale, soft-cap (0 = off), sliding window (None = off)) of a layer, as
    its backend applies them: FlashAttention's window (w - 1, 0) lets a query at
    p see keys > p - w, the kernel's `sliding_window` semantics."""
    impl = layer.impl
    softcap = getattr(impl, "logits_soft_cap", None) or 0.0
    window = layer.sliding_window
    return float(impl.scale), float(softcap), (int(window) if window else None)


def bound_kv_cache(layer) -> torch.Tensor:
    """The KV cache bound to a layer (`bind_kv_cache`); the first virtual
    engine's when a vLLM binds a list."""
    kv = layer.kv_cache
    if isinstance(kv, (list, tuple)):
        kv = kv[0]
    return kv


def standard_kv_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's bound KV cache as (key_cache, value_cache), each a strided
    [num_blocks, block_size, Hkv, D] view of the same memory (no copy).

    Accepts vLLM 0.32's logical [num_blocks, Hkv, block_size, 2*D] view (any
    physical KVCacheLayout; exactly what FlashAttention/Triton/FlashInfer
    do: `kv_cache.transpose(1, 2).split(D, dim=-1)`) and the older
    [2, num_blocks, block_size, Hkv, D] (`kv_cache[0]`, `kv_cache[1]`)."""
    if kv_cache.dim() == 4 and kv_cache.shape[-1] == 2 * head_size:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
        return key_cache, value_cache
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[-1] == head_size:
        return kv_cache[0], kv_cache[1]
    raise ValueError(
        f"unknown KV cache layout: shape {tuple(kv_cache.shape)}, strides {kv_cache.stride()} "
        f"for head size {head_size}; expected [num_blocks, Hkv, block_size, {2 * head_size}] "
        f"or [2, num_blocks, block_size, Hkv, {head_size}]"
    )


def layer_block_tables(runner, kv_cache_group_id: int, table) -> dict[str, Any]:
    """`table` (numpy [R, W], manager block ids) as each layer's attention
    backend addresses its bound cache: the same array, or, for attention
    groups split into kernel blocks, [R, W * blocks_per_block] kernel block
    ids (vllm.v1.worker.utils.AttentionGroup.map_to_kernel_block_table). Layers of one
    attention group share one array."""
    import numpy as np

    out: dict[str, Any] = {}
    for group in runner.attn_groups[kv_cache_group_id]:
        t = table
        if group.kernel_block_size is not None:
            per = group.kv_cache_spec.block_size // group.kernel_block_size
            stride = group.kernel_block_stride or per
            t = (table.astype(np.int64)[:, :, None] * stride + np.arange(per)).reshape(table.shape[0], -1)
            t = t.astype(np.int32)
        for name in group.layer_names:
            out[name] = t
    return out


def current_layer_attn_metadata(layer_name: str):
    """The attention metadata the current forward context holds for a layer
    (None outside a forward), as `get_attention_context` resolves it."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if isinstance(md, dict):
        return md.get(layer_name)
    if isinstance(md, list):
        return md[0].get(layer_name) if md else None
    return md


@contextlib.contextmanager
def replaced_attention_impls(layers: dict[str, Any], make_impl):
    """Within the block, each layer's `impl` is `make_impl(layer.impl)`; the
    originals are restored on exit (also on error)."""
    saved: dict[str, Any] = {}
    try:
        for name, layer in layers.items():
            saved[name] = layer.impl
            layer.impl = make_impl(layer.impl)
        yield
    finally:
        for name, impl in saved.items():
            layers[name].impl = impl


def kv_transfer_configured(vllm_config) -> bool:
    """A KV connector saves each layer's KV after its attention
    (vllm.model_executor.layers.attention.kv_transfer_utils.maybe_transfer_kv_layer,
    which decorates unified_attention_with_output), which a verification forward
    must not do."""
    return getattr(vllm_config, "kv_transfer_config", None) is not None


def kernel_verify_config_unsupported(vllm_config) -> str | None:
    """Why the engine's configuration alone rules the prefix_verify_attention
    kernel out (None: only the loaded layers can still, `kernel_verify_unsupported`):
    a KV connector (`kv_transfer_configured`); attention fused with output
    quantization by the compiler (vllm.config.compilation.PassConfig.fuse_attn_quant:
    the fused op passes `output_scale` to the attention impl, which the kernel
    does not produce); a quantized KV cache (vllm.config.cache.CacheConfig.cache_dtype);
    decode context parallelism (the KV cache is sharded over ranks)."""
    if kv_transfer_configured(vllm_config):
        return "a KV connector (kv_transfer_config) would save the verification forward's KV"
    cc = vllm_config.compilation_config
    compiled = getattr(cc, "mode", None) not in (None, 0) and not vllm_config.model_config.enforce_eager
    if compiled and getattr(cc.pass_config, "fuse_attn_quant", False):
        return "attention fused with output quantization (compilation_config.pass_config.fuse_attn_quant)"
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype not in ("auto", "bfloat16", "float16", "float32", "half", "float"):
        return f"a quantized KV cache (kv_cache_dtype={dtype})"
    if getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) > 1:
        return "decode context parallelism (the KV cache is sharded across ranks)"
    return None


def target_head_size(vllm_config) -> int:
    """vllm.config.model.ModelConfig.get_head_size."""
    return vllm_config.model_config.get_head_size()


def target_dtype(vllm_config):
    """vllm.config.model.ModelConfig.dtype: the torch dtype the target runs in (resolved from
    "auto" by the time the platform arranges the engine)."""
    return vllm_config.model_config.dtype


def attention_rows_limit(runner, kv_cache_group_id: int) -> int | None:
    """Rows (requests) one attention forward may have where the backend keeps
    per-request buffers sized max_num_seqs (GPU backends, kernel block tables
    vllm.v1.worker.utils.AttentionGroup.kernel_block_size); None: no limit
    (vLLM's CPU backend)."""
    limited = runner.device.type != "cpu" or any(
        g.kernel_block_size is not None for g in runner.attn_groups[kv_cache_group_id]
    )
    return runner.scheduler_config.max_num_seqs if limited else None


def max_batched_tokens(runner) -> int:
    """vllm.config.scheduler.SchedulerConfig.max_num_batched_tokens of the runner's engine."""
    return runner.scheduler_config.max_num_batched_tokens


def cuda_device_capability() -> tuple[int, int] | None:
    """(major, minor) compute capability of this process's GPU, as vLLM's platform reads it
    (vllm.platforms.interface.Platform.get_device_capability; None off CUDA)."""
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    return None if cap is None else (int(cap.major), int(cap.minor))


def cuda_device_name() -> str | None:
    """Name of this process's GPU ("NVIDIA H200") as vLLM's platform reads it
    (vllm.platforms.interface.Platform.get_device_name: NVML where vLLM uses it, so
    CUDA is not initialised); None off CUDA or where it cannot be read."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    try:
        return str(current_platform.get_device_name())
    except Exception:  # noqa: BLE001 - NVML errors are not RuntimeErrors; the name is optional
        return None
