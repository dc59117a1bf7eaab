"""verify.factory: the verifier chosen once from the configuration and the recorded
kernel measurements (process 0), so that the scheduler holds scratch blocks back only
for the forked one."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parse_vllm.config import ParseConfigError
from parse_vllm.verify import factory, scratch_block_count

ROOT = Path(__file__).resolve().parents[1]
H100 = "NVIDIA H100 80GB HBM3"


def _config(
    *,
    head_size=128,
    cache_dtype="auto",
    fuse_attn_quant=False,
    kv_transfer=None,
    eager=False,
    dcp=1,
    dtype=torch.bfloat16,
):
    return SimpleNamespace(
        model_config=SimpleNamespace(get_head_size=lambda: head_size, enforce_eager=eager, dtype=dtype),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        compilation_config=SimpleNamespace(mode=3, pass_config=SimpleNamespace(fuse_attn_quant=fuse_attn_quant)),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
        kv_transfer_config=kv_transfer,
    )


def _entry(version="v-test", device=H100, capability="9.0", speedup=2.0, slower_at=(), shapes=None, D=128, **forked):
    """A measurement of kernel `version` on `device` at head size D: the op `speedup` times faster
    than the forked verifier's attention at every goal shape, 2x slower at those in `slower_at`;
    `forked` adds other forked-path baselines (name=us) to every row. K per-copy SDPA calls,
    recorded too, are always 10x slower than the op (they never count)."""
    rows = [
        dict(
            ctx=c, K=k, Hq=hq, Hkv=hkv, D=D, L=24, op_us=100.0,
            forked_us={"forked": 50.0 if (c, k, hq, hkv) in slower_at else 100.0 * speedup, **forked},
            per_copy_us={"sdpa": 1000.0},
        )
        for c, k, hq, hkv in (factory.GOAL_SHAPES if shapes is None else shapes)
    ]  # fmt: skip
    return dict(
        kernel_version=version, device=device, capability=capability, date="2026-12-01", dtype="bfloat16",
        source="a test", rows=rows,
    )  # fmt: skip


@pytest.fixture
def record(tmp_path, monkeypatch):
    """record(*entries): those measurements become the shipped record."""

    def write(*entries):
        path = tmp_path / "kernel_measurements.json"
        path.write_text(json.dumps({"schema": factory.MEASUREMENTS_SCHEMA, "measurements": list(entries)}))
        monkeypatch.setattr(factory, "MEASUREMENTS_PATH", path)
        return path

    return write


@pytest.fixture
def log(monkeypatch):
    """The factory's log lines."""
    lines: list[str] = []
    monkeypatch.setattr(factory, "logger", SimpleNamespace(info=lambda msg, *args: lines.append(msg % args)))
    return lines


@pytest.fixture
def cuda_op(monkeypatch, record):
    """As on a GPU build for Ampere to Hopper, on an H100: the compiled op has a CUDA kernel
    (version "v-test" in every dtype), and the record shows that version faster there, in
    bf16 (the engines' dtype here), at every goal shape."""
    monkeypatch.setattr(factory._ops, "has_cuda_op", lambda: True)
    monkeypatch.setattr(factory._ops, "SUPPORTED_HEAD_SIZES", (32, 64, 80, 96, 128, 256))
    monkeypatch.setattr(factory._ops, "cuda_archs", lambda: ("8.0", "8.6", "8.9", "9.0"))
    monkeypatch.setattr(factory._vllm, "cuda_device_capability", lambda: (9, 0))
    monkeypatch.setattr(factory._vllm, "cuda_device_name", lambda: H100)
    monkeypatch.setattr(factory, "kernel_version", lambda dtype: "v-test")
    record(_entry())


def test_auto_is_the_kernel_where_the_configuration_allows_it_and_holds_no_scratch(cuda_op):
    """(The fixture's record shows this kernel faster on this GPU; the tests below vary that.)"""
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


def test_auto_takes_the_kernel_measured_faster_on_this_gpu(cuda_op, log):
    """One log line names the measurement behind the choice."""
    assert factory.resolve("auto", _config(), on_cuda=True) == "kernel"
    (line,) = log
    assert line.startswith(
        "PARSE: kernel verification (kernel v-test measured on NVIDIA H100 80GB HBM3 (sm_90) on 2026-12-01"
    )
    assert "faster than the forked path's attention at all 8 goal shapes" in line
    assert "2.00x" in line


def test_auto_takes_forked_where_this_kernel_was_measured_slower(cuda_op, record, log):
    """Slower at one goal shape is enough: the line says where, by how much, and from what."""
    record(_entry(slower_at=[(32768, 16, 8, 2)]))
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    (line,) = log
    assert line.startswith("PARSE: forked-block-table verification; the kernel could run but is not chosen: ")
    assert (
        "kernel v-test measured on NVIDIA H100 80GB HBM3 (sm_90) on 2026-12-01, kernel_measurements.json: "
        "the op is slower than the forked path's attention at 1 of 8 goal shapes "
        "(worst ctx 32768 K 16 8:2: 100 us against 50 us for forked, 2.00x)"
    ) in line


def test_the_alternative_is_the_fastest_forked_path_baseline_recorded(cuda_op, record, log):
    """Where the run also timed one FlashInfer paged batch call over all copies (the closest
    library call to the forked path), the op must beat that too."""
    record(_entry(speedup=3.0, flashinfer=90.0))
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    assert "at 8 of 8 goal shapes" in log[-1] and "against 90 us for flashinfer, 1.11x" in log[-1]


def test_per_copy_calls_are_not_the_alternative(cuda_op, record, log):
    """K per-copy calls are not what a user otherwise gets (the forked verifier runs the
    backend's attention over all copies in one forward): a record timing only those, however
    much faster the op is, does not choose the kernel."""
    entry = _entry()
    for r in entry["rows"]:
        del r["forked_us"]
    record(entry)
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    assert "holds no time of the forked path's attention (forked_us) at 8 of the 8 goal shapes" in log[-1]


def test_a_measurement_counts_only_at_its_head_size(cuda_op, record, log):
    """A D = 128 record decides nothing for a D = 256 target (a one-stage variant of the kernel
    serves it), nor one of D = 256 for D = 128."""
    record(_entry())
    assert factory.resolve("auto", _config(head_size=128), on_cuda=True) == "kernel"
    assert factory.resolve("auto", _config(head_size=256), on_cuda=True) == "forked"
    assert "does not cover 8 of the 8 goal shapes at head size 256" in log[-1]
    record(_entry(D=256))
    assert factory.resolve("auto", _config(head_size=256), on_cuda=True) == "kernel"
    assert factory.resolve("auto", _config(head_size=128), on_cuda=True) == "forked"


@pytest.mark.parametrize(
    "version, entries, why",
    [
        ("v-new", [_entry()], "kernel v-new has no recorded bfloat16 measurement in kernel_measurements.json"),
        (None, [_entry()], "this build of the op reports no cuda_kernel_version(), so no recorded measurement is of it"),
        ("v-test", [_entry(device="NVIDIA A100-SXM4-80GB", capability="8.0")], "was measured on NVIDIA A100-SXM4-80GB, not on this GPU (NVIDIA H100 80GB HBM3)"),
        ("v-test", [{**_entry(), "dtype": "float32"}], "kernel v-test has no recorded bfloat16 measurement"),
        ("v-test", [_entry(shapes=factory.GOAL_SHAPES[:-1])], "does not cover 1 of the 8 goal shapes at head size 128 (ctx 8192 K 8 32:8, ...)"),
        ("v-test", [_entry(shapes=[(c, k, hq * 2, hkv) for c, k, hq, hkv in factory.GOAL_SHAPES])], "does not cover 8 of the 8"),
    ],
)  # fmt: skip
def test_a_kernel_not_measured_faster_here_is_not_trusted(cuda_op, record, log, monkeypatch, version, entries, why):
    """A new kernel build (another kernel_version), one without a version, one measured only
    on another architecture, in another dtype, or not at every goal shape: forked, saying so."""
    monkeypatch.setattr(factory, "kernel_version", lambda dtype: version)
    record(*entries)
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    assert why in log[-1]


def test_the_measurement_is_of_the_kernel_and_dtype_the_target_runs_in(cuda_op, record, log, monkeypatch):
    """The op reports a version per dtype (one kernel may serve bf16/fp16, another float32):
    the record must hold that version measured in the target's dtype."""
    versions = {torch.bfloat16: "v-test", torch.float16: "v-test", torch.float32: "cc-test"}
    monkeypatch.setattr(factory, "kernel_version", lambda dtype: versions[dtype])
    assert factory.resolve("auto", _config(dtype=torch.bfloat16), on_cuda=True) == "kernel"
    assert factory.resolve("auto", _config(dtype=torch.float32), on_cuda=True) == "forked"
    assert "kernel cc-test has no recorded float32 measurement" in log[-1]
    assert factory.resolve("auto", _config(dtype=torch.float16), on_cuda=True) == "forked"
    assert "kernel v-test has no recorded float16 measurement" in log[-1]
    record(_entry(), {**_entry("cc-test"), "dtype": "float32"})
    assert factory.resolve("auto", _config(dtype=torch.float32), on_cuda=True) == "kernel"


def test_the_installed_op_reports_its_kernel_version_or_none():
    """Read defensively: a build without cuda_kernel_version (every build before it) is None,
    never an error."""
    version = factory.kernel_version(torch.bfloat16)
    assert version is None or (isinstance(version, str) and version)


def test_a_measurement_counts_only_on_a_gpu_of_its_name(cuda_op, record, log):
    """Another GPU of the same architecture (an H200, an H20 for an H100) does not count;
    this GPU's own measurement does; where several of its name count, all must show the op
    faster."""
    record(_entry(device="NVIDIA H200"), _entry(device="NVIDIA H20"))
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    assert "was measured on NVIDIA H20, NVIDIA H200, not on this GPU (NVIDIA H100 80GB HBM3)" in log[-1]
    record(_entry(device="NVIDIA H200"), _entry())
    assert factory.resolve("auto", _config(), on_cuda=True) == "kernel"
    assert "measured on NVIDIA H100 80GB HBM3 (sm_90) on" in log[-1]
    record(_entry(), _entry(slower_at=factory.GOAL_SHAPES[:1]))
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    record(_entry(device=H100.lower()))  # names compare without case
    assert factory.resolve("auto", _config(), on_cuda=True) == "kernel"


@pytest.mark.parametrize("text", [None, "{not json", json.dumps({"schema": "other", "measurements": []}),
                                  json.dumps({"schema": factory.MEASUREMENTS_SCHEMA, "measurements": [{"device": 1}]})])  # fmt: skip
def test_a_missing_or_broken_record_is_no_measurement(cuda_op, tmp_path, monkeypatch, log, text):
    """Never an error at start (a wheel built without the record, a hand-edited file): forked,
    saying why. The committed record is checked below."""
    path = tmp_path / "record.json"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(factory, "MEASUREMENTS_PATH", path)
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    assert "the record of kernel measurements cannot be read (" in log[-1]
    assert factory.resolve("kernel", _config(), on_cuda=True) == "kernel"


def test_kernel_is_forced_where_it_runs_whatever_the_record_says(cuda_op, record, log, monkeypatch):
    """parse.verifier='kernel' keeps its meaning: the kernel wherever it can run, with a line
    saying what the record says when it does not show it faster."""
    record(_entry(slower_at=factory.GOAL_SHAPES))
    assert factory.resolve("kernel", _config(), on_cuda=True) == "kernel"
    assert log[-1].startswith("PARSE: kernel verification, as parse.verifier='kernel' asks (kernel v-test measured")
    assert "slower than the forked path's attention at 8 of 8 goal shapes" in log[-1]
    monkeypatch.setattr(factory, "kernel_version", lambda dtype: None)
    assert factory.resolve("kernel", _config(), on_cuda=True) == "kernel"
    assert "reports no cuda_kernel_version()" in log[-1]
    with pytest.raises(ParseConfigError, match="head size 48"):  # where it cannot run, still refused
        factory.resolve("kernel", _config(head_size=48), on_cuda=True)


def _docs_section() -> str:
    text = (ROOT / "docs" / "compiled-op.md").read_text()
    start = text.index("## Which verifier `auto` chooses")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_committed_record_parses_and_matches_the_docs():
    """The shipped record: every entry well formed; its first entry is the H200 run of the
    first kernel (slower than K per-copy SDPA calls at 6 of the 8 goal shapes, so forked),
    and docs/compiled-op.md states that rule, those numbers and that verdict."""
    entries = factory.load_measurements()
    assert factory.MEASUREMENTS_PATH == ROOT / "parse_vllm" / "verify" / "kernel_measurements.json"
    assert len({(e["kernel_version"], e["device"], e["date"]) for e in entries}) == len(entries)
    h200 = entries[0]
    assert (h200["kernel_version"], h200["device"], h200["capability"], h200["dtype"]) == (
        "fa7a92d8fb544974", "NVIDIA H200", "9.0", "bfloat16",
    )  # fmt: skip
    faster, why = factory.entry_verdict(h200)
    assert not faster and "holds no time of the forked path's attention (forked_us) at 8 of the 8" in why
    assert factory.measured_verdict("fa7a92d8fb544974", "bfloat16", "NVIDIA H200", 128, entries)[0] is False

    docs = _docs_section()
    for needed in ("kernel_measurements.json", "fa7a92d8fb544974", "cuda_kernel_version(dtype)", "6 of the 8 goal shapes",
                   "parse.verifier='kernel'", "anchor.json"):  # fmt: skip
        assert needed in " ".join(docs.split()), needed
    rows = {(r["ctx"], r["K"], r["Hq"], r["Hkv"]): r for r in h200["rows"]}
    table = re.findall(r"^\| (\d+) \| (\d+) \| (\d+):(\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|", docs, re.M)
    assert {tuple(int(x) for x in t[:4]) for t in table} == set(factory.GOAL_SHAPES)
    for *shape, op, per_copy, ratio in table:
        row = rows[tuple(int(x) for x in shape)]
        assert float(op) == row["op_us"] and float(per_copy) == row["per_copy_us"]["sdpa"], shape
        assert ratio == f"{row['op_us'] / row['per_copy_us']['sdpa']:.2f}", shape


def test_the_first_entry_is_the_h200_run_it_names():
    """Its numbers are those of the file it cites (where the shared results are at hand)."""
    h200 = factory.load_measurements()[0]
    source = ROOT / h200["source"].split(" ")[0]
    if not source.exists():
        pytest.skip(f"{source} is not here")
    anchor = json.loads(source.read_text())
    assert anchor["device"] == h200["device"] and anchor["torch"] == h200["torch"]
    assert [(r["ctx"], r["K"], r["Hq"], r["Hkv"], r["op_us"], r["sdpa_us"], r.get("flex_us")) for r in anchor["rows"]] == [
        (r["ctx"], r["K"], r["Hq"], r["Hkv"], r["op_us"], r["per_copy_us"]["sdpa"], r.get("flex_us")) for r in h200["rows"]
    ]  # fmt: skip


def test_cpu_and_builds_without_the_cuda_kernel_use_forked(monkeypatch):
    assert factory.resolve("auto", _config(), on_cuda=False) == "forked"
    monkeypatch.setattr(factory._ops, "has_cuda_op", lambda: False)
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    with pytest.raises(ParseConfigError, match="no CUDA kernel"):
        factory.resolve("kernel", _config(), on_cuda=True)


def test_a_gpu_the_kernel_was_not_built_for_gets_the_forked_verifier(cuda_op, monkeypatch, record, log):
    """A Blackwell GPU (sm_100) and a kernel built for sm_80..sm_90 without PTX: its first
    launch would fail with "no kernel image", and no scratch would be held back to fall back
    on. auto chooses forked; kernel is refused, naming the archs."""
    monkeypatch.setattr(factory._vllm, "cuda_device_capability", lambda: (10, 0))
    monkeypatch.setattr(factory._vllm, "cuda_device_name", lambda: "NVIDIA B200")
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    with pytest.raises(ParseConfigError, match=r"built for 8.0, 8.6, 8.9, 9.0, not for this GPU \(sm_100\)"):
        factory.resolve("kernel", _config(), on_cuda=True)
    # PTX of the highest arch is compiled by the driver for later GPUs: the kernel runs there,
    # but its speed on an H100 says nothing about the driver's code for a B200.
    monkeypatch.setattr(factory._ops, "cuda_archs", lambda: ("8.0", "8.6", "8.9", "9.0+PTX"))
    assert factory.resolve("kernel", _config(), on_cuda=True) == "kernel"
    assert factory.resolve("auto", _config(), on_cuda=True) == "forked"
    assert "was measured on NVIDIA H100 80GB HBM3, not on this GPU (NVIDIA B200)" in log[-1]
    record(_entry(), _entry(device="NVIDIA B200", capability="10.0"))
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


def test_the_kernel_version_is_a_hash_of_the_kernel_sources(tmp_path):
    """Issue 49 F2: the version the op reports is "tc-" / "cc-" and a hash of csrc/ built in by
    setup.py, so a changed kernel never inherits old measurements: the installed op's hash is
    the tree's (else the op is stale: `make setup` rebuilds it), and editing, adding or renaming
    any source changes the hash."""
    from parse_vllm import ops
    from parse_vllm.ops.kernel_sources import kernel_sources_hash

    if not ops.has_compiled_op():
        pytest.skip("compiled op not built")
    tree = kernel_sources_hash(ROOT)
    assert torch.ops.parse_vllm.cuda_kernel_version(torch.bfloat16) == f"tc-{tree}", "stale op: rebuild (make setup)"
    assert torch.ops.parse_vllm.cuda_kernel_version(torch.float32) == f"cc-{tree}"
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    src = tmp_path / "csrc" / "cuda" / "k.cu"
    src.write_text("__global__ void k() {}\n")
    (tmp_path / "csrc" / "README.md").write_text("not compiled")
    base = kernel_sources_hash(tmp_path)
    (tmp_path / "csrc" / "README.md").write_text("still not compiled")
    assert kernel_sources_hash(tmp_path) == base
    src.write_text("__global__ void k() { }\n")
    edited = kernel_sources_hash(tmp_path)
    assert edited != base
    src.rename(tmp_path / "csrc" / "cuda" / "j.cu")
    assert kernel_sources_hash(tmp_path) not in (base, edited)
    (tmp_path / "csrc" / "x.h").write_text("")
    assert len({base, edited, kernel_sources_hash(tmp_path)}) == 3


def test_the_version_names_the_kernel_that_will_serve(monkeypatch):
    """Issue 49 F3: under PARSE_VLLM_CUDA_KERNEL=cuda-core (read by the op at every call) the
    CUDA-core kernel serves bf16 too, and rows that are not 16-byte aligned go to it: the
    version the factory looks up follows, so a tensor-core record is never applied to it."""
    from parse_vllm import ops

    if not ops.has_compiled_op():
        pytest.skip("compiled op not built")
    tc = torch.ops.parse_vllm.cuda_kernel_version(torch.bfloat16)
    cc = torch.ops.parse_vllm.cuda_kernel_version(torch.float32)
    assert tc.startswith("tc-") and cc.startswith("cc-") and tc[3:] == cc[3:]
    assert torch.ops.parse_vllm.cuda_kernel_version(torch.float16) == tc
    assert torch.ops.parse_vllm.cuda_kernel_version(torch.bfloat16, False) == cc
    assert factory.kernel_version(torch.bfloat16) == tc
    monkeypatch.setenv("PARSE_VLLM_CUDA_KERNEL", "cuda-core")
    assert factory.kernel_version(torch.bfloat16) == cc
    monkeypatch.setenv("PARSE_VLLM_CUDA_KERNEL", "auto")
    assert factory.kernel_version(torch.bfloat16) == tc
    # no CUDA call in this process (a CPU test run): the op reports none served
    if not torch.cuda.is_available():
        assert torch.ops.parse_vllm.last_cuda_kernel() == ""


def test_a_gpu_run_writes_its_entry_into_the_record(tmp_path):
    """Issue 49 F5: scripts/gpu_check.sh writes the goal table's entry into the repository's
    record itself (parse_vllm/verify/record.py, loaded by path while vLLM is blocked), right
    after the goal table and again at the end with the steps that failed: a rerun of the same
    kernel on the same GPU, dtype and head size replaces its entry, another is added, the
    failed steps and shapes are listed, and the factory does not trust an entry that misses
    goal shapes."""
    import importlib.util
    import subprocess
    import sys

    from parse_vllm.verify import record

    path = tmp_path / "kernel_measurements.json"
    old = factory.load_measurements()[0]
    path.write_text(json.dumps({"schema": factory.MEASUREMENTS_SCHEMA, "about": "x", "measurements": [old]}))
    first = _entry(version="tc-0123456789abcdef")
    line = record.write_measurement(path, first)
    assert "added an entry for kernel tc-0123456789abcdef on NVIDIA H100 80GB HBM3 (8 rows)" in line
    partial = dict(_entry(version="tc-0123456789abcdef", shapes=factory.GOAL_SHAPES[:3]), complete=False)
    partial["failed"] = ["8192/8/8:2"]
    line = record.write_measurement(path, partial, ["sanitizer", "cuda_tests"])
    assert "replaced the entry" in line and "failed: 8192/8/8:2, sanitizer, cuda_tests; incomplete" in line
    doc = json.loads(path.read_text())
    assert doc["about"] == "x" and [e["kernel_version"] for e in doc["measurements"]] == [old["kernel_version"]] + [
        "tc-0123456789abcdef"
    ]
    assert doc["measurements"][1]["failed"] == ["8192/8/8:2", "sanitizer", "cuda_tests"]
    entries = factory.load_measurements(path)
    faster, why = factory.measured_verdict("tc-0123456789abcdef", "bfloat16", H100, 128, entries)
    assert not faster and "does not cover 5 of the 8 goal shapes" in why
    record.write_measurement(path, _entry(version="tc-0123456789abcdef", D=256))  # another head size: added
    record.write_measurement(path, _entry(version="tc-0123456789abcdef", device="NVIDIA H200"))
    assert len(factory.load_measurements(path)) == 4
    with pytest.raises(ValueError, match="'rows' must be a non-empty list"):
        record.write_measurement(path, dict(first, rows=[]))
    # as gpu_check.sh loads it: by path, with vLLM blocked
    shim = tmp_path / "shim" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('blocked')")
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('r', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); print(m.MEASUREMENTS_SCHEMA)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "parse_vllm" / "verify" / "record.py")],
        env={"PYTHONPATH": str(tmp_path / "shim"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and r.stdout.strip() == factory.MEASUREMENTS_SCHEMA, r.stderr
    assert importlib.util.find_spec("parse_vllm.verify.record") is not None
