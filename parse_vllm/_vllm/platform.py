"""vLLM's platform classes, and the platform vLLM would pick itself."""

from __future__ import annotations


def cpu_platform_cls():
    from vllm.platforms.cpu import CpuPlatform

    return CpuPlatform


def cuda_platform_cls():
    from vllm.platforms.cuda import CudaPlatform

    return CudaPlatform


def builtin_platform_qualname() -> str | None:
    """The class qualname of the platform vLLM itself would pick among its
    built-in CUDA and CPU ones (vllm.platforms.cuda_platform_plugin,
    vllm.platforms.cpu_platform_plugin), or None for other devices."""
    from vllm.platforms import cpu_platform_plugin, cuda_platform_plugin

    for detect in (cuda_platform_plugin, cpu_platform_plugin):
        try:
            qualname = detect()
        except Exception:  # the builtin detectors may raise without a device
            qualname = None
        if qualname is not None:
            return qualname
    return None
