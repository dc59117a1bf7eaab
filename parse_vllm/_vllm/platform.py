"""vLLM's platform classes, and the platform vLLM would pick itself."""

from __future__ import annotations


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
