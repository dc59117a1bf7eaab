"""vLLM platforms with the PARSE hooks: the built-in CPU or CUDA platform,
plus `check_and_update_config` (arrange the PARSE engine when
additional_config names it) and `validate_request` (per-request PARSE
options). Selected by the `vllm.platform_plugins` entry point
(platform_plugin.py); without a `parse` section they behave exactly as the
built-in platform."""

from __future__ import annotations

from parse_vllm import _vllm
from parse_vllm.plugin import CPU_WORKER_CLS, GPU_WORKER_CLS, arrange_engine, validate_request_params


def _with_parse_hooks(base, worker_cls: str):
    class ParsePlatform(base):
        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            arrange_engine(vllm_config, worker_cls)
            super().check_and_update_config(vllm_config)

        @classmethod
        def validate_request(cls, processed_inputs, params) -> None:
            super().validate_request(processed_inputs, params)
            validate_request_params(params)

    ParsePlatform.__name__ = ParsePlatform.__qualname__ = f"Parse{base.__name__}"
    ParsePlatform.__module__ = __name__
    return ParsePlatform


def __getattr__(name):
    if name == "ParseCpuPlatform":
        cls = _with_parse_hooks(_vllm.cpu_platform_cls(), CPU_WORKER_CLS)
    elif name == "ParseCudaPlatform":
        cls = _with_parse_hooks(_vllm.cuda_platform_cls(), GPU_WORKER_CLS)
    else:
        raise AttributeError(name)
    globals()[name] = cls
    return cls
