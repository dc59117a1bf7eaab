"""vLLM's engine arguments, before they become its config: where `"method": "parse"` is
turned into vLLM's own spelling, and what decides model runner V1 or V2.

Every way of starting an engine, `LLM(...)`, `vllm serve` and `parse-vllm serve`, builds
its config in vllm.engine.arg_utils.EngineArgs.create_engine_config (AsyncEngineArgs
inherits it; vllm.v1.engine.llm_engine.LLMEngine.from_engine_args and
vllm.v1.engine.async_llm.AsyncLLM.from_engine_args call it, as does
vllm.entrypoints.cli.serve for several API servers; 0.33: the same). It reads the
speculative config dict (vllm.transformers_utils.config.maybe_override_with_speculators,
then EngineArgs.create_speculative_config, which merges the --spec-method/--spec-model/
--spec-tokens aliases and builds vllm.config.SpeculativeConfig, a pydantic dataclass whose
`method` is a closed Literal with extra fields forbidden), and builds
vllm.config.VllmConfig, whose `use_v2_model_runner` property picks the runner from
vllm.envs.VLLM_USE_V2_MODEL_RUNNER. The general plugin is loaded before it
(EngineArgs.__post_init__ and AsyncEngineArgs.add_cli_args call
vllm.plugins.load_general_plugins), once per process: the first EngineArgs of a process
is already being built when the plugin loads, so its hook cannot be __post_init__;
create_engine_config runs after, for every instance.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

# vllm.engine.arg_utils.EngineArgs.create_engine_config(self, usage_context=None,
# headless=False) in 0.32.0 and 0.33.0: the wrapper passes its arguments on unchanged,
# and a vLLM whose method differs is refused rather than wrapped blind.
_CREATE_ENGINE_CONFIG_PARAMS = ("self", "usage_context", "headless")
# EngineArgs fields the hook reads or rewrites (0.32.0 and 0.33.0).
_ENGINE_ARGS_FIELDS = (
    "speculative_config",
    "spec_method",
    "spec_model",
    "spec_tokens",
    "additional_config",
    "attention_config",
    "watermark_config",
    "kv_transfer_config",
)
# The engine's SpeculativeConfig fields vLLM fills itself
# (EngineArgs.create_speculative_config), never given in the dict.
_SET_BY_VLLM = ("target_model_config", "target_parallel_config")

_WRAPPED = "__parse_vllm_hook__"


class VllmChangedError(RuntimeError):
    """vLLM's code that PARSE hooks into is not what it was checked against."""


def _engine_args_cls():
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def check_engine_args_hook() -> None:
    """Fail loudly when the vLLM installed no longer has what `hook_engine_config` relies
    on: create_engine_config's signature, the EngineArgs fields read, and no "parse" among
    vLLM's own speculative methods (which the rewrite would then take over)."""
    import dataclasses

    import vllm

    cls = _engine_args_cls()
    where = f"vLLM {vllm.__version__}: "
    params = tuple(
        inspect.signature(getattr(cls.create_engine_config, "__wrapped__", cls.create_engine_config)).parameters
    )
    if params != _CREATE_ENGINE_CONFIG_PARAMS:
        raise VllmChangedError(
            f"{where}vllm.engine.arg_utils.EngineArgs.create_engine_config takes {params}, not "
            f"{_CREATE_ENGINE_CONFIG_PARAMS}; parse-vllm names PARSE there (parse_vllm/_vllm/engine_args.py)"
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = [f for f in _ENGINE_ARGS_FIELDS if f not in fields]
    if missing:
        raise VllmChangedError(f"{where}vllm.engine.arg_utils.EngineArgs has no field(s) {missing}")
    if "parse" in speculative_methods():
        raise VllmChangedError(
            f'{where}vllm.config.SpeculativeConfig has a method "parse" of its own; '
            "parse-vllm would take it over (parse_vllm/_vllm/engine_args.py)"
        )


def speculative_methods() -> set[str]:
    """The values vllm.config.SpeculativeConfig.method takes (its Literal, flattened)."""
    import typing

    from vllm.config.speculative import SpeculativeConfig

    out: set[str] = set()

    def walk(t) -> None:
        args = typing.get_args(t)
        if typing.get_origin(t) is typing.Literal:
            out.update(a for a in args if isinstance(a, str))
        else:
            for a in args:
                walk(a)

    walk(typing.get_type_hints(SpeculativeConfig)["method"])
    return out


def speculative_config_keys() -> set[str]:
    """The keys a speculative config dict may hold (vllm.config.SpeculativeConfig's
    fields but those vLLM sets itself)."""
    from .serve import speculative_config_fields

    return speculative_config_fields() - set(_SET_BY_VLLM)


def hook_engine_config(hook: Callable) -> None:
    """Make `hook(engine_args)` run at the start of every
    EngineArgs.create_engine_config, before vLLM reads any of its arguments. Once per
    process (the general plugin loads in several places)."""
    cls = _engine_args_cls()
    if getattr(cls.create_engine_config, _WRAPPED, False):
        return
    check_engine_args_hook()
    original = cls.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, usage_context=None, headless=False):
        hook(self)
        return original(self, usage_context, headless)

    setattr(create_engine_config, _WRAPPED, True)
    cls.create_engine_config = create_engine_config


# vllm.envs.VLLM_USE_V2_MODEL_RUNNER, read by vllm.config.vllm.VllmConfig.use_v2_model_runner
# (0.32.0 and 0.33.0) in every process: the engine core's and workers' inherit process 0's
# environment. With it unset, 0.33 picks V2 for a draft-model engine on a GPU.
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def v2_runner_env() -> bool | None:
    """VLLM_USE_V2_MODEL_RUNNER as vLLM reads it (vllm.envs, None when unset)."""
    import vllm.envs as envs

    return envs.VLLM_USE_V2_MODEL_RUNNER


def v2_runner_forced_by(engine_args) -> str | None:
    """What in these arguments makes vLLM use model runner V2 whatever
    VLLM_USE_V2_MODEL_RUNNER says, or None. VllmConfig.use_v2_model_runner (0.32.0 and
    0.33.0) returns True before it reads the variable for HiSparse attention
    (attention_config.hisparse_config, which VllmConfig.__post_init__ also sets for a
    kv_transfer_config naming the HiSparseConnector) and for watermarking
    (watermark_config)."""
    attention = engine_args.attention_config
    if getattr(attention, "hisparse_config", None) is not None:
        return "HiSparse attention (attention_config.hisparse_config)"
    transfer = engine_args.kv_transfer_config
    if hasattr(transfer, "has_connector") and transfer.has_connector("HiSparseConnector"):
        return "the HiSparseConnector (kv_transfer_config), which turns HiSparse attention on"
    if engine_args.watermark_config is not None:
        return "watermarking (watermark_config)"
    return None
