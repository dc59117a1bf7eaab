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
    """As on a GPU build for Ampere to Hopper, on an H100: the compiled op has a CUDA kernel."""
    monkeypatch.setattr(factory._ops, "has_cuda_op", lambda: True)
    monkeypatch.setattr(factory._ops, "SUPPORTED_HEAD_SIZES", (32, 64, 80, 96, 128, 256))
    monkeypatch.setattr(factory._ops, "cuda_archs", lambda: ("8.0", "8.6", "8.9", "9.0"))
    monkeypatch.setattr(factory._vllm, "cuda_device_capability", lambda: (9, 0))


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


def test_a_gpu_the_kernel_was_not_built_for_gets_the_forked_verifier(cuda_op, monkeypatch):
    """A Blackwell GPU (sm_100) and a kernel built for sm_80..sm_90 without PTX: its first
    launch would fail with "no kernel image", and no scratch would be held back to fall back
    on. auto chooses forked; kernel is refused, naming the archs."""
    monkeypatch.setattr(factory._vllm, "cuda_device_capability", lambda: (10, 0))
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    with pytest.raises(ParseConfigError, match=r"built for 8.0, 8.6, 8.9, 9.0, not for this GPU \(sm_100\)"):
        factory.resolve("kernel", _config(), on_cuda=True)
    # PTX of the highest arch is compiled by the driver for later GPUs.
    monkeypatch.setattr(factory._ops, "cuda_archs", lambda: ("8.0", "8.6", "8.9", "9.0+PTX"))
    assert factory.resolve("auto", _config(), on_cuda=True) == "kernel"


@pytest.mark.parametrize(
    "capability, archs, runs",
    [
        ((8, 6), ("8.0",), True),  # sm_80 machine code runs on later minors of Ampere
        ((8, 0), ("8.6",), False),
        ((9, 0), ("8.0", "8.9"), False),  # no PTX: Hopper is out
        ((9, 0), ("8.0", "8.9+PTX"), True),
        ((12, 0), ("8.0", "9.0+PTX"), True),
        ((7, 5), ("8.0+PTX",), False),  # PTX runs forward, never back
    ],
)
def test_which_gpus_a_build_covers(capability, archs, runs):
    assert (factory._ops.cuda_arch_unsupported(capability, archs) is None) == runs


def test_an_op_built_against_another_torch_stops_the_start(cuda_op, monkeypatch):
    """pip replaced torch after the op was built (vLLM brings its own): `auto` must not fall
    back quietly to the forked verifier; the message says how to reinstall. A user who asks
    for the forked verifier, and CPU engines (which never use the op), are not stopped."""
    why = "parse_vllm._C was built against torch 2.13.0, this is torch 2.14.0: install vLLM first, ..."
    monkeypatch.setattr(factory._ops, "compiled_op_unusable", lambda: why)
    for requested in ("auto", "kernel"):
        with pytest.raises(ParseConfigError, match="built against torch 2.13.0.*parse.verifier='forked'"):
            factory.resolve(requested, _config(), on_cuda=True)
    assert factory.resolve("forked", _config(), on_cuda=True) == "forked"
    assert factory.resolve("auto", _config(), on_cuda=False) == "forked"


def test_the_installed_op_reports_what_it_was_built_for():
    """The extension built here says which torch it was compiled against (the one loaded)
    and, without CUDA, no archs."""
    ops = factory._ops
    if not ops.has_compiled_op():
        pytest.skip(f"no compiled op here ({ops.compiled_op_error()})")
    import torch

    assert ops.built_for_torch() == torch.__version__.split("+")[0]
    assert ops.compiled_op_unusable() is None
    if ops.has_cuda_op():
        assert ops.cuda_archs() and all(a[0].isdigit() for a in ops.cuda_archs())
    else:
        assert ops.cuda_archs() == ()


def test_the_draft_models_copy_of_the_config_is_not_arranged_again(cuda_op):
    """vLLM's draft proposer rebuilds the engine config with the draft as its model, which
    runs the platform hook (and PARSE's arrangement) again. Judged as an engine, the draft's
    head size (72 here, which the kernel lacks) would stop a start the target allows."""
    from parse_vllm import plugin

    draft = SimpleNamespace(get_head_size=lambda: 72, enforce_eager=False, model="draft")
    spec = SimpleNamespace(method="draft_model", draft_model_config=draft)
    copy = SimpleNamespace(
        additional_config={"parse": {"verifier": "kernel"}}, speculative_config=spec, model_config=draft
    )
    assert plugin.is_draft_config(copy)
    plugin.arrange_engine(copy, plugin.GPU_WORKER_CLS)  # a no-op: nothing read, nothing changed
    assert copy.additional_config == {"parse": {"verifier": "kernel"}}
    with pytest.raises(ParseConfigError, match="head size 72"):  # what arranging it again would have judged
        factory.resolve("kernel", _config(head_size=72), on_cuda=True)
    engine = SimpleNamespace(speculative_config=spec, model_config=SimpleNamespace(model="target"))
    assert not plugin.is_draft_config(engine)


def test_a_second_engine_in_the_process_sees_the_v1_runner_setting(monkeypatch):
    """The first in-process engine core caches vLLM's environment; PARSE's choice of the V1
    model runner, set for the next engine, must still reach vLLM."""
    import vllm.envs as envs

    from parse_vllm import _vllm

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    envs.enable_envs_cache()
    try:
        assert envs.VLLM_USE_V2_MODEL_RUNNER is True
        _vllm.set_vllm_env("VLLM_USE_V2_MODEL_RUNNER", "0")
        assert envs.VLLM_USE_V2_MODEL_RUNNER is False
    finally:
        envs.disable_envs_cache()
