"""vLLM platforms with the PARSE hooks, one per device: vLLM's CPU or CUDA
platform plus `check_and_update_config` (arrange the PARSE engine when
additional_config names it) and `validate_request` (per-request PARSE
options). Selected by the `vllm.platform_plugins` entry point
(platform_plugin.py); without a `parse` section they behave exactly as the
built-in platform."""

from __future__ import annotations

from parse_vllm import _vllm
from parse_vllm.plugin import CPU_WORKER_CLS, GPU_WORKER_CLS, arrange_engine, parse_enabled, validate_request_params


class _ParseHooks:
    """Mixed in before vLLM's platform class."""

    parse_worker_cls: str  # the PARSE worker's class path on this device

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        arrange_engine(vllm_config, cls.parse_worker_cls)
        cls.parse_executor(vllm_config)
        super().check_and_update_config(vllm_config)

    @classmethod
    def parse_executor(cls, vllm_config) -> None:
        """Replace the distributed executor where the device needs PARSE's own."""

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        super().validate_request(processed_inputs, params)
        validate_request_params(params)


def _cpu_platform():
    class ParseCpuPlatform(_ParseHooks, _vllm.cpu_platform_cls()):
        """vLLM's CpuPlatform with the PARSE hooks, and vLLM's Ray executor made
        to run on CPU when PARSE is named: vLLM 0.32 has no Ray support for
        CPU (CpuPlatform.ray_device_key is empty, so vLLM's
        `initialize_ray_cluster` refuses it), so `distributed_executor_backend="ray"`
        becomes the PARSE CPU Ray executor (worker.ParseCpuRayExecutor, see
        `_vllm.cpu_ray_executor_cls`). Without a `parse` section nothing changes."""

        parse_worker_cls = CPU_WORKER_CLS

        @classmethod
        def parse_executor(cls, vllm_config) -> None:
            pc = vllm_config.parallel_config
            if parse_enabled(vllm_config) and pc.distributed_executor_backend == "ray":
                # A module-level class: the config is pickled to the engine
                # core process, which imports the class by its name.
                from parse_vllm.worker import ParseCpuRayExecutor

                pc.distributed_executor_backend = ParseCpuRayExecutor

    return ParseCpuPlatform


def _cuda_platform():
    class ParseCudaPlatform(_ParseHooks, _vllm.cuda_platform_cls()):
        """vLLM's CudaPlatform with the PARSE hooks (vLLM's own Ray executor
        runs unchanged on GPUs)."""

        parse_worker_cls = GPU_WORKER_CLS

    return ParseCudaPlatform


def __getattr__(name):  # each device's platform imports its vLLM base on demand
    builders = {"ParseCpuPlatform": _cpu_platform, "ParseCudaPlatform": _cuda_platform}
    if name not in builders:
        raise AttributeError(name)
    cls = builders[name]()
    cls.__qualname__ = name
    cls.__module__ = __name__
    globals()[name] = cls
    return cls
