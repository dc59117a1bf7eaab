"""verify.factory: the verifier chosen once from the configuration (process 0),
so that the scheduler holds scratch blocks back only for the forked one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from parse_vllm.config import ParseConfigError
from parse_vllm.verify import factory, scratch_block_count


def _config(*, head_size=64, cache_dtype="auto", fuse_attn_quant=False, kv_transfer=None, eager=False, dcp=1):
    return SimpleNamespace(
        model_config=SimpleNamespace(get_head_size=lambda: head_size, enforce_eager=eager),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        compilation_config=SimpleNamespace(mode=3, pass_config=SimpleNamespace(fuse_attn_quant=fuse_attn_quant)),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
        kv_transfer_config=kv_transfer,
    )


@pytest.fixture
def cuda_op(monkeypatch):
    """As on a GPU build: the compiled op has a CUDA kernel."""
    monkeypatch.setattr(factory._ops, "has_cuda_op", lambda: True)
    monkeypatch.setattr(factory._ops, "SUPPORTED_HEAD_SIZES", (32, 64, 80, 96, 128, 256))


def test_auto_is_the_kernel_where_the_configuration_allows_it_and_holds_no_scratch(cuda_op):
    assert factory.resolve("auto", _config(), on_cuda=True) == "kernel"
    assert scratch_block_count(0, 1000, "kernel") == 0
    assert scratch_block_count(0, 1000, "forked") > 0
    assert factory.resolve("forked", _config(), on_cuda=True) == "forked"


@pytest.mark.parametrize(
    "config, why",
    [
        (_config(fuse_attn_quant=True), "fuse_attn_quant"),
        (_config(cache_dtype="fp8_e4m3"), "quantized KV cache"),
        (_config(kv_transfer=object()), "KV connector"),
        (_config(head_size=48), "head size 48"),
        (_config(dcp=2), "decode context parallelism"),
    ],
)
def test_what_rules_the_kernel_out(cuda_op, config, why):
    """auto falls back to the forked verifier (and keeps scratch blocks);
    kernel is refused before any engine process starts, saying why."""
    assert factory.resolve("auto", config, on_cuda=True) == "forked"
    with pytest.raises(ParseConfigError, match=f"parse.verifier='kernel' cannot run here: .*{why}"):
        factory.resolve("kernel", config, on_cuda=True)


def test_attention_quant_fusion_needs_compilation(cuda_op):
    """Without torch.compile (enforce_eager) nothing fuses attention with quantization."""
    assert factory.resolve("auto", _config(fuse_attn_quant=True, eager=True), on_cuda=True) == "kernel"


def test_cpu_and_builds_without_the_cuda_kernel_use_forked(monkeypatch):
    assert factory.resolve("auto", _config(), on_cuda=False) == "forked"
    monkeypatch.setattr(factory._ops, "has_cuda_op", lambda: False)
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    with pytest.raises(ParseConfigError, match="no CUDA kernel"):
        factory.resolve("kernel", _config(), on_cuda=True)
