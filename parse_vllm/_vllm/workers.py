"""vLLM's model runner and worker classes that PARSE subclasses, how the CPU worker is made
to build PARSE's runner, and a fix for vLLM's CPU runner that PARSE's CPU runner carries."""

from __future__ import annotations

import contextlib

from .batch import discarded_rows_cpu_generators, generators_hidden


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


class CpuSeededChunkedPrefill:
    """Seeded requests whose prompt is prefilled in chunks, on the CPU.

    A row still in prefill samples a token that is thrown away; vLLM then
    rewinds that request's generator with `set_offset`, which only CUDA
    generators have: on the CPU it raises and the engine dies, losing every
    request in flight (vLLM 0.32, with or without PARSE). Here the rewind is
    done the CPU way, by the generator's state: saved before sampling,
    restored after, and the generator kept out of vLLM's rewind. A seeded
    request's tokens then do not depend on how its prompt was chunked, as on
    a GPU."""

    # Overrides vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample and _bookkeeping_sync
    # (0.33: the same), around the rewind vLLM does there.
    def _sample(self, logits, spec_decode_metadata):
        gens = discarded_rows_cpu_generators(self)
        states = {i: g.get_state() for i, g in gens.items()}
        try:
            return super()._sample(logits, spec_decode_metadata)
        finally:
            for i, g in gens.items():
                g.set_state(states[i])

    def _bookkeeping_sync(self, *args, **kwargs):
        with generators_hidden(self, discarded_rows_cpu_generators(self)):
            return super()._bookkeeping_sync(*args, **kwargs)
