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


# vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING, also read by
# vllm.platforms.cpu.CpuPlatform.check_and_update_config (which turns the "uni"
# executor into "mp" while it is "1").
ENGINE_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def cpu_engine_in_one_process(world_size: int = 1) -> bool:
    """On vLLM's CPU platform, with one worker: run the worker in the engine
    core's process, unless the user set VLLM_ENABLE_V1_MULTIPROCESSING. With
    vLLM's default there, the worker is a process of its own bound to the cores
    vllm.utils.ompmultiprocessing.OMPProcessManager does not reserve for the
    engine core (one of two on a 2-core machine), and the engine core spins on
    the worker's shared-memory queue while it waits
    (vllm.distributed.device_communicators.shm_broadcast.SpinCondition.wait).
    With 0, `LLM(...)` runs engine core and worker in the caller's process
    (vllm.v1.engine.core_client.InprocClient) and `vllm serve` keeps the "uni"
    executor, so the worker runs inside the engine-core process; either way no
    queue is waited on and torch's threads take every core. Returns whether
    the engine runs that way."""
    import os

    value = os.environ.get(ENGINE_MULTIPROCESSING_ENV)
    if value is not None:
        return value == "0"
    if world_size != 1 or builtin_platform_qualname() != "vllm.platforms.cpu.CpuPlatform":
        return False
    os.environ[ENGINE_MULTIPROCESSING_ENV] = "0"
    return True
