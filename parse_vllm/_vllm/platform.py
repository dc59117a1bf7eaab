"""vLLM's platform classes, and the platform vLLM would pick itself."""

from __future__ import annotations


def cpu_platform_cls():
    from vllm.platforms.cpu import CpuPlatform

    return CpuPlatform


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
