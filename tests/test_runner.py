"""The PARSE runner's hooks on stand-ins for vLLM's model runner (no model, no engine)."""

from __future__ import annotations

import gc
import weakref

import torch

from parse_vllm.runner import ParseRunnerMixin


class _KvCacheRunner:
    """vLLM's model runner as far as KV-cache set-up goes: GPUModelRunner.initialize_kv_cache
    allocates through initialize_kv_cache_tensors, and _cleanup_profiling_kv_cache drops its
    own references to the profiling cache (CUDA-graph memory profiling, 0.33)."""

    parse = None

    def initialize_kv_cache_tensors(self, num_blocks, *args, **kwargs):
        self.kv_caches = {"model.layers.0.self_attn.attn": torch.zeros(num_blocks, 16)}
        return self.kv_caches

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes, *args, **kwargs):
        pass

    def initialize_kv_cache(self, num_blocks, is_profiling=False, **kwargs):
        self.initialize_metadata_builders(num_blocks, [16])
        self.initialize_kv_cache_tensors(num_blocks)

    def _cleanup_profiling_kv_cache(self):
        self.kv_caches = None


Runner = type("Runner", (ParseRunnerMixin, _KvCacheRunner), {})


def test_the_profiling_kv_cache_is_not_held_once_vllm_drops_it():
    """vLLM computes the KV budget before profiling and allocates the real cache after
    dropping the profiling one: a reference kept by PARSE would hold both at once."""
    runner = Runner()
    runner.initialize_kv_cache(4, is_profiling=True)
    profiling = weakref.ref(runner.kv_caches["model.layers.0.self_attn.attn"])
    runner._cleanup_profiling_kv_cache()
    gc.collect()
    assert profiling() is None
    runner.initialize_kv_cache(64)
    assert runner._parse_caches_by_layer["model.layers.0.self_attn.attn"].shape[0] == 64
