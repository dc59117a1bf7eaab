"""Which verifier an engine judges with: chosen once, from the configuration,
then built by the runner.

`resolve` runs in process 0 (plugin.arrange_engine) and writes its answer
back into the `parse` section, so the two processes that must agree on it
read one value: the scheduler (engine-core process) holds scratch KV blocks
back only for the forked verifier (scheduler.py, `scratch_block_count`), and
the runner (worker) builds the same verifier (`build`).

"auto" becomes "kernel" where the configuration allows the fused kernel (a
CUDA device, the compiled CUDA op built for that GPU's architecture, a head
size the kernel has, and nothing `_vllm.kernel_verify_config_unsupported`
names), else "forked". An op that is installed but was built against another
torch stops the start (auto included): falling back without it would hide a
broken install. What only
the loaded model shows (a layer kind the kernel cannot stand in for) stops
the start with a message naming parse.verifier='forked': no blocks were held
back for the fallback.
"""

from __future__ import annotations

import numpy as np

from parse_vllm import _vllm
from parse_vllm import ops as _ops
from parse_vllm.config import ParseConfigError
from parse_vllm.verify.base import Verifier
from parse_vllm.verify.forked import ForkedBlockTableVerifier, scratch_block_count

logger = _vllm.init_logger("parse_vllm.verify")


def kernel_unavailable(vllm_config, on_cuda: bool) -> str | None:
    """Why the kernel verifier cannot serve this engine, from its configuration."""
    if not on_cuda:
        return "the kernel reads the GPU backends' paged KV layout (vLLM's CPU KV cache is packed per instruction set)"
    if not _ops.has_cuda_op():
        return f"this build of parse-vllm has no CUDA kernel ({_ops.compiled_op_error() or 'built without nvcc'})"
    capability = _vllm.cuda_device_capability()
    if capability is not None:
        why = _ops.cuda_arch_unsupported(capability)
        if why is not None:
            return why
    head_size = _vllm.target_head_size(vllm_config)
    if head_size not in _ops.SUPPORTED_HEAD_SIZES:
        return f"head size {head_size} (the kernel has {_ops.SUPPORTED_HEAD_SIZES})"
    return _vllm.kernel_verify_config_unsupported(vllm_config)


def resolve(requested: str, vllm_config, on_cuda: bool) -> str:
    """ "kernel" or "forked" for parse.verifier `requested`; refuses "kernel"
    where it cannot run."""
    if requested == "forked":
        return "forked"
    broken = _ops.compiled_op_unusable() if on_cuda else None
    if broken is not None:
        raise ParseConfigError(f"PARSE: {broken}; or set parse.verifier='forked' to run without the kernel")
    why = kernel_unavailable(vllm_config, on_cuda)
    if why is None:
        return "kernel"
    if requested == "kernel":
        raise ParseConfigError(f"parse.verifier='kernel' cannot run here: {why}; use 'auto' or 'forked'")
    logger.info("PARSE: forked-block-table verification (%s)", why)
    return "forked"


def build(target, controller, kv_cache_config, layer_caches_by_name) -> Verifier:
    """The verifier `controller.config.verifier` names, over the target (`_vllm.TargetAccess`)
    and its KV cache (`layer_caches_by_name`: the caches addressed by scheduler block ids)."""
    config = controller.config
    gid = _vllm.kv_cache_group_of_layers(kv_cache_config, controller.layer_names)
    num_blocks = kv_cache_config.num_blocks
    common = dict(
        suffix_ids=controller.template.suffix_ids,
        labels=controller.template.labels,
        kv_cache_group_id=gid,
        layer_names=controller.layer_names,
        layer_caches=[layer_caches_by_name[n] for n in controller.layer_names],
        num_blocks=num_blocks,
        block_size=kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size,
        check_isolation=config.record_judgments > 0,
        read_out=controller.read_out,
        max_tokens_per_pass=target.max_batched_tokens(),
        fetch=controller.host.fetch,
        to_device=controller.host.to_device,
    )
    if config.verifier == "kernel":
        from parse_vllm.verify.kernel import KernelVerifier

        try:
            return KernelVerifier(target, **common)
        except (NotImplementedError, ValueError, RuntimeError) as e:
            raise ParseConfigError(
                f"PARSE kernel verification cannot run on this model: {e}. No KV blocks were held back "
                "for the forked verifier; start again with parse.verifier='forked'"
            ) from e
    scratch = scratch_block_count(config.scratch_blocks, num_blocks, config.verifier)
    return ForkedBlockTableVerifier(
        target,
        **common,
        scratch_ids=np.arange(num_blocks - scratch, num_blocks),
        max_rows_per_pass=target.rows_limit(gid),
    )


def describe(verifier, num_blocks: int) -> str:
    """The verifier an engine built, one line for the log."""
    scratch = getattr(verifier, "scratch_ids", None)
    held = 0 if scratch is None else int(np.asarray(scratch).shape[0])
    return f"{type(verifier).__name__}, scratch {held} of {num_blocks} KV blocks"
