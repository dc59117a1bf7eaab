"""Which verifier an engine judges with: chosen once, from the configuration and a
recorded measurement, then built by the runner.

`resolve` runs in process 0 (plugin.arrange_engine) and writes its answer
back into the `parse` section, so the two processes that must agree on it
read one value: the scheduler (engine-core process) holds scratch KV blocks
back only for the forked verifier (scheduler.py, `scratch_block_count`), and
the runner (worker) builds the same verifier (`build`).

"auto" becomes "kernel" only where the kernel can run and is known to be faster:

1. the configuration allows the fused kernel (a CUDA device, the compiled CUDA
   op built for that GPU's architecture, a head size the kernel has, and
   nothing `_vllm.kernel_verify_config_unsupported` names), and
2. the record of GPU measurements shipped beside this file
   (kernel_measurements.json) holds a measurement of THIS kernel (the version the
   op reports for the target's dtype under this process's PARSE_VLLM_CUDA_KERNEL,
   `kernel_version`: a hash of the kernel's sources, so a changed kernel has no
   measurement), in that dtype, at the target's head size, on a GPU of this
   GPU's name (another GPU of the same architecture does not count: an H200's
   figures say little of an H20), in which the op is faster than the forked
   verifier's own attention (`forked_us`: the attention call the forked path
   makes over all copies, or one FlashInfer paged batch call; the fastest
   recorded) at every shape of GOAL_SHAPES (`measured_verdict`).

Else "forked", with one log line saying why (the configuration's reason, or the
measurement's verdict, or its absence): a kernel nobody has timed is not
trusted. parse.verifier='kernel' still forces the kernel wherever it can run
(1.), whatever the record says. An op that is installed but was built against
another torch stops the start (auto included): falling back without it would
hide a broken install. What only the loaded model shows (a layer kind the
kernel cannot stand in for) stops the start with a message naming
parse.verifier='forked': no blocks were held back for the fallback.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from parse_vllm import _vllm
from parse_vllm import ops as _ops
from parse_vllm.config import ParseConfigError
from parse_vllm.verify.base import Verifier
from parse_vllm.verify.forked import ForkedBlockTableVerifier, scratch_block_count
from parse_vllm.verify.record import MEASUREMENTS_SCHEMA
from parse_vllm.verify.record import check_entry as _check_entry

logger = _vllm.init_logger("parse_vllm.verify")

# The record "auto" trusts: GPU measurements of the op against the forked path's attention,
# one entry per (kernel_version, GPU) run; format in docs/compiled-op.md.
MEASUREMENTS_PATH = Path(__file__).with_name("kernel_measurements.json")
# The shapes that matter (ops.GOAL_SHAPES, the benchmark's goal table): the op must be
# faster than the fastest recorded forked-path attention at every one of them, in rows of
# the target's head size (a D = 128 measurement says nothing of D = 256, which runs a
# one-stage variant of the kernel).
GOAL_SHAPES = _ops.GOAL_SHAPES
GOAL_HEAD_SIZE, GOAL_SUFFIX = 128, 24


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


def kernel_version(dtype: torch.dtype) -> str | None:
    """The version of the CUDA kernel that serves calls in `dtype` (rows 16-byte aligned, as
    the KV caches and the verifier's buffers are) under this process's PARSE_VLLM_CUDA_KERNEL,
    `torch.ops.parse_vllm.cuda_kernel_version(dtype)`: "tc-<hash>" or "cc-<hash>", the hash of
    csrc/ built into the op, the key of its measurements in the record. None where the op
    exports none (builds before it existed): such a kernel is unmeasured by construction."""
    try:
        version = torch.ops.parse_vllm.cuda_kernel_version(dtype)
    except Exception:  # noqa: BLE001 - no such op (older build, no build): unmeasured
        return None
    return str(version) if version else None


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_measurements(path: Path | None = None) -> list[dict]:
    """The record's measurements, checked; OSError or ValueError where it is missing or malformed."""
    path = MEASUREMENTS_PATH if path is None else Path(path)
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or doc.get("schema") != MEASUREMENTS_SCHEMA:
        raise ValueError(f"{path.name}: schema is not {MEASUREMENTS_SCHEMA!r}")
    entries = doc.get("measurements")
    if not isinstance(entries, list):
        raise ValueError(f"{path.name}: 'measurements' must be a list")
    return [_check_entry(e) for e in entries]


def _shape(s) -> str:
    ctx, k, hq, hkv = s
    return f"ctx {ctx} K {k} {hq}:{hkv}"


def entry_verdict(entry: dict, head_size: int = GOAL_HEAD_SIZE) -> tuple[bool, str]:
    """Whether one measurement shows the op faster than the forked path's attention at every
    goal shape, in rows of head size `head_size` (the alternative's time at a shape: the
    fastest `forked_us` baseline recorded there; `per_copy_us`, K per-copy calls, is not what
    a user otherwise gets and does not count), and why, in one clause."""
    rows = {
        (r["ctx"], r["K"], r["Hq"], r["Hkv"]): r
        for r in entry["rows"]
        if r.get("D") == head_size and r.get("L", GOAL_SUFFIX) == GOAL_SUFFIX
    }
    missing = [s for s in GOAL_SHAPES if s not in rows]
    if missing:
        return (
            False,
            f"it does not cover {len(missing)} of the {len(GOAL_SHAPES)} goal shapes at head size {head_size} "
            f"({_shape(missing[0])}, ...)",
        )
    untimed = [s for s in GOAL_SHAPES if not rows[s].get("forked_us")]
    if untimed:
        return False, (
            f"it holds no time of the forked path's attention (forked_us) at {len(untimed)} of the "
            f"{len(GOAL_SHAPES)} goal shapes ({_shape(untimed[0])}, ...), only what the forked verifier does not run"
        )
    timed = []
    for s in GOAL_SHAPES:
        name, alt = min(rows[s]["forked_us"].items(), key=lambda kv: kv[1])
        timed.append((rows[s]["op_us"] / alt, s, rows[s]["op_us"], alt, name))
    slower = [t for t in timed if t[0] >= 1.0]
    if slower:
        ratio, s, op, alt, name = max(slower)
        return False, (
            f"the op is slower than the forked path's attention at {len(slower)} of {len(GOAL_SHAPES)} goal shapes "
            f"(worst {_shape(s)}: {op:g} us against {alt:g} us for {name}, {ratio:.2f}x)"
        )
    ratio, s, op, alt, name = max(timed)
    return True, (
        f"the op is faster than the forked path's attention at all {len(GOAL_SHAPES)} goal shapes "
        f"(least at {_shape(s)}: {op:g} us against {alt:g} us for {name}, {1 / ratio:.2f}x)"
    )


def measured_verdict(
    version: str | None,
    dtype: str,
    device_name: str | None,
    head_size: int,
    entries: list[dict],
) -> tuple[bool, str]:
    """Whether the record shows kernel `version` faster in `dtype` ("bfloat16") at head size
    `head_size` on this GPU, and why (one clause, naming the measurement or its absence). A
    measurement counts on a GPU of the same name (compared without case) only; every
    counting measurement must show the op faster."""
    if version is None:
        return False, "this build of the op reports no cuda_kernel_version(), so no recorded measurement is of it"
    mine = [e for e in entries if e["kernel_version"] == version and e["dtype"] == dtype]
    if not mine:
        return False, f"kernel {version} has no recorded {dtype} measurement in {MEASUREMENTS_PATH.name}"
    counting = [e for e in mine if device_name and e["device"].strip().lower() == device_name.strip().lower()]
    if not counting:
        measured = ", ".join(sorted({e["device"] for e in mine}))
        return False, f"kernel {version} was measured on {measured}, not on this GPU ({device_name or 'unnamed'})"
    verdicts = [(e, *entry_verdict(e, head_size)) for e in counting]
    e, faster, why = next((v for v in verdicts if not v[1]), verdicts[0])
    return faster, (
        f"kernel {version} measured on {e['device']} (sm_{e['capability'].replace('.', '')}) "
        f"on {e['date']}, {MEASUREMENTS_PATH.name}: {why}"
    )


def kernel_speed(vllm_config) -> tuple[bool, str]:
    """`measured_verdict` for the installed op, in the target's dtype, on this process's
    GPU, from the shipped record; a missing or malformed record is no measurement (never an
    error here: tests/test_verifier_factory.py checks the committed one)."""
    try:
        entries = load_measurements()
    except (OSError, ValueError) as e:
        return False, f"the record of kernel measurements cannot be read ({type(e).__name__}: {e})"
    dtype = _vllm.target_dtype(vllm_config)
    return measured_verdict(
        kernel_version(dtype),
        _dtype_name(dtype),
        _vllm.cuda_device_name(),
        _vllm.target_head_size(vllm_config),
        entries,
    )


def resolve(requested: str, vllm_config, on_cuda: bool) -> str:
    """ "kernel" or "forked" for parse.verifier `requested`; refuses "kernel"
    where it cannot run. "auto" takes the kernel only where it can run and a recorded
    measurement shows this kernel faster on this GPU (module docstring)."""
    if requested == "forked":
        return "forked"
    broken = _ops.compiled_op_unusable() if on_cuda else None
    if broken is not None:
        raise ParseConfigError(f"PARSE: {broken}; or set parse.verifier='forked' to run without the kernel")
    why = kernel_unavailable(vllm_config, on_cuda)
    if why is not None:
        if requested == "kernel":
            raise ParseConfigError(f"parse.verifier='kernel' cannot run here: {why}; use 'auto' or 'forked'")
        logger.info("PARSE: forked-block-table verification (%s)", why)
        return "forked"
    faster, why = kernel_speed(vllm_config)
    if requested == "kernel":
        if not faster:
            logger.info("PARSE: kernel verification, as parse.verifier='kernel' asks (%s)", why)
        return "kernel"
    if faster:
        logger.info("PARSE: kernel verification (%s)", why)
        return "kernel"
    logger.info("PARSE: forked-block-table verification; the kernel could run but is not chosen: %s", why)
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
