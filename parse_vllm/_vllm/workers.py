"""vLLM's model runner and worker classes that PARSE subclasses, and how the
CPU worker is made to build PARSE's runner."""

from __future__ import annotations

import contextlib


def cpu_model_runner_cls():
    """vllm.v1.worker.cpu_model_runner.CPUModelRunner (a GPUModelRunner)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return CPUModelRunner


def gpu_model_runner_cls():
    """vllm.v1.worker.gpu_model_runner.GPUModelRunner (model runner V1; 0.33:
    still there, built by vllm.v1.worker.gpu_worker.Worker._make_model_runner
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
    """vllm.v1.worker.cpu_worker.CPUWorker.init_device builds its runner
    through the module global `vllm.v1.worker.cpu_worker.CPUModelRunner` (same
    in 0.33) and has no factory hook, unlike the GPU Worker's
    `_make_model_runner`. Swap the global for the duration of `init_device`
    only."""
    import vllm.v1.worker.cpu_worker as cpu_worker_mod

    saved = cpu_worker_mod.CPUModelRunner
    cpu_worker_mod.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker_mod.CPUModelRunner = saved
