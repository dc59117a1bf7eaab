"""scripts/gpu_check.sh, the one-command GPU validation of the CUDA kernel, in its
CPU-only mode (so that it cannot rot unseen between GPU windows), and the GPU
code paths of scripts/bench_kernel.py and of the script's report run on the CPU
with the CUDA timers / graphs / device queries replaced.

No vLLM engine starts here; the script itself blocks vLLM for what it runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from argparse import Namespace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["env", "imports", "build", "cuda_tests", "bench", "costs", "cpu_tests"]


def run_check(out: Path, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_CPU_ONLY="1", GPU_CHECK_QUICK="1")
    for k in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "GPU_CHECK_KEEP_GOING", "GPU_CHECK_CUDA_ARCH"):
        e.pop(k, None)
    e.update(env)
    return subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    r = run_check(out)
    return out, r


def test_cpu_mode_runs_every_step_and_skips_the_cuda_parts(cpu_run):
    out, r = cpu_run
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((out / "gpu_check.json").read_text())
    md = (out / "gpu_check.md").read_text()
    assert rep["mode"] == "cpu" and rep["result"] == "passed" and rep["failed_step"] is None
    status = {s["name"]: s["status"] for s in rep["steps"]}
    assert list(status) == STEPS
    assert status == {
        "env": "ok",
        "imports": "ok",
        "build": "skipped",
        "cuda_tests": "skipped",
        "bench": "skipped",
        "costs": "skipped",
        "cpu_tests": "ok",
    }, rep["steps"]
    detail = {s["name"]: s["detail"] for s in rep["steps"]}
    assert detail["build"].startswith("no GPU: CUDA build skipped")
    assert "skipped: no CUDA GPU" in detail["cuda_tests"]
    assert detail["bench"].startswith("no GPU: CUDA benchmark skipped")
    assert detail["costs"].startswith("no GPU: step costs not measured; CPU smoke pass of scripts/gpu_costs.py")
    assert [g["status"] for g in rep["goals"]] == ["skipped"] * 3
    # the CPU parts really ran: CPU twin cases passed, the benchmark's smoke row agrees with the reference
    assert rep["tests"]["cpu"]["passed"] > 0 and rep["tests"]["cpu"]["failed"] == 0
    assert rep["tests"]["cuda"]["skipped"] > 0 and rep["tests"]["cuda"]["passed"] == 0
    (row,) = rep["bench"]["rows"]
    assert row["op_ok"] and row["max_rel_err"]["op"] < 1e-4
    assert row["sdpa_form"] in ("mask_gqa", "lower_right_gqa", "lower_right_expand")
    assert "Result: **passed**" in md and "| **SKIPPED** |" in md and "CPU only" in md
    # gpu_costs.py's smoke pass left its JSON in OUTDIR, summarized in both reports
    costs = json.loads((out / "gpu_costs.json").read_text())
    assert costs["schema"] == "parse-vllm/gpu-costs/1" and costs["tiny"] and not costs["errors"]
    decode = rep["costs"]["models"]["tiny-target"]["decode_ms"]
    assert set(decode) == {"1", "8"} and all(v > 0 for v in decode.values())  # GPU_CHECK_QUICK's batches
    assert "## Step costs of a PARSE window" in md and "| tiny-target | 1: " in md
    for s in STEPS:
        assert (out / "logs" / f"{s}.log").is_file()
    # the build step planned the build (setup.py's extension, in-place output path) without compiling
    assert "output: " in (out / "logs" / "build.log").read_text()
    assert not (rep["build"] or {}).get("rebuilt")


def test_a_failing_step_stops_the_script_with_a_clear_message(tmp_path):
    # pytest refuses an unknown option: the first test step (the CUDA kernel tests) fails
    r = run_check(tmp_path, PYTEST_ADDOPTS="--no-such-option-for-gpu-check")
    assert r.returncode == 1, r.stdout + r.stderr
    assert 'FAILED at step 4/7 "CUDA kernel tests (tests/test_kernel_cuda.py)"' in r.stderr
    assert "pytest exited" in r.stderr and "last lines of" in r.stderr
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["result"] == "failed" and rep["failed_step"] == "cuda_tests"
    status = {s["name"]: s["status"] for s in rep["steps"]}
    assert status["env"] == "ok" and status["cuda_tests"] == "failed"
    assert status["cpu_tests"] == "not run" and status["bench"] == "not run" and status["costs"] == "not run"
    assert not (tmp_path / "logs" / "bench.log").exists()
    assert 'FAILED at step "CUDA kernel tests' in (tmp_path / "gpu_check.md").read_text()


def test_a_python_that_does_not_run_fails_the_first_step(tmp_path):
    r = run_check(tmp_path, PYTHON="/bin/false")
    assert r.returncode == 1
    assert 'FAILED at step 1/7 "environment": PYTHON=/bin/false does not run' in r.stderr
    rep = json.loads((tmp_path / "gpu_check.json").read_text())  # written by the script's bash fallback
    assert rep["result"] == "failed" and rep["failed_step"] == "env"
    assert "FAILED" in (tmp_path / "gpu_check.md").read_text()


def test_usage_errors():
    r = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown option" in r.stderr
    r = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "gpu_check.sh [OUTDIR]" in r.stdout


# --------------------------------------------------------------------------- the GPU paths, run on the CPU


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_kernel_under_test", ROOT / "scripts" / "bench_kernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _FakeFlash(types.SimpleNamespace):
    """flash_attn_func's contract ([B, S, H, D], GQA, causal = bottom-right) over SDPA."""

    __version__ = "fake"

    @staticmethod
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        from torch.nn.attention.bias import causal_lower_right

        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            scale=softmax_scale,
            attn_mask=causal_lower_right(q.shape[1], k.shape[1]) if causal else None,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return o.transpose(1, 2)


def test_bench_gpu_path_on_cpu(monkeypatch, capsys):
    bk = _bench_module()
    calls = {"timer": 0, "graph": 0, "mem": 0}

    def timer(fns, x, out, flush, stat="median", **kw):
        calls["timer"] += 1
        return bk.time_interleaved(fns, x, out, stat, min_time=0.0, min_reps=1, max_reps=1)

    def graphed(fn, x, out):
        calls["graph"] += 1
        return lambda x_, out_: fn(x, out)

    def mem(fn, *a):
        calls["mem"] += 1
        fn(*a)
        return 123

    monkeypatch.setattr(bk, "time_interleaved_cuda", timer)
    monkeypatch.setattr(bk, "graphed", graphed)
    monkeypatch.setattr(bk, "cuda_peak_extra_bytes", mem)
    args = Namespace(
        suffix=8,
        hq=4,
        hkv=2,
        head_size=64,
        block_size=16,
        no_check=False,
        stat="median",
        no_mem=False,
        all_forms=False,
        quick=True,
        _forms=None,
    )
    row = bk.bench_one(256, 4, torch.bfloat16, args, torch.device("cpu"), flash_attn=_FakeFlash(), gpu_path=True)
    assert row["op_ok"] and not row["notes"], row["notes"]
    assert set(row["ms"]) == {"op", "op_graph", "dense", "sdpa_per_copy", "sdpa_per_copy_graph", "flash_per_copy"}
    assert set(row["speedup"]) == {"vs_sdpa_per_copy", "vs_dense", "vs_flash_per_copy", "graph_vs_sdpa_per_copy_graph"}
    assert row["sdpa_form"] in bk.SDPA_FORMS and set(row["sdpa_form_ms"]) == set(bk.SDPA_FORMS)
    assert row["flash"] == "flash-attn fake"
    assert all(e <= 2e-2 for e in row["max_rel_err"].values()), row["max_rel_err"]
    assert row["bw_time_basis"] == "op_graph" and row["op_GBps"] > 0
    assert set(row["peak_mem_bytes"]) == {"op", "dense", "sdpa_per_copy", "flash_per_copy"}
    assert calls["graph"] == 2 and calls["timer"] == 2 and calls["mem"] == 4
    # bytes: one request, nested prefixes 128 + k*32: the longest prefix once vs every copy's prefix
    e, Hkv, D, T, Hq = 2, 2, 64, 32, 4
    rest = 2 * T * Hq * D * e + 2 * T * Hkv * D * e
    assert row["bytes_per_copy_min"] == 2 * (160 + 192 + 224 + 256) * Hkv * D * e + rest
    assert row["bytes_min"] - rest - 2 * 256 * Hkv * D * e == 4 * (16 + 4 + 4 + 5)
    row["op_bw_share"] = 0.5
    bk.print_cuda_row(row)
    assert "256   4 |" in capsys.readouterr().out
    # fp32: flash-attn has none; a wrong op is flagged, not hidden
    monkeypatch.setattr(bk, "run_op", lambda x, out: out.fill_(0.5))
    row = bk.bench_one(256, 4, torch.float32, args, torch.device("cpu"), flash_attn=_FakeFlash(), gpu_path=True)
    assert row["flash"] == "flash-attn has no float32" and "flash_per_copy" not in row["ms"]
    assert not row["op_ok"] and any("disagrees" in n for n in row["notes"])


@pytest.mark.parametrize("form", ["mask_gqa", "lower_right_gqa", "lower_right_expand"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_copy_sdpa_forms_match_the_reference(form, dtype):
    bk = _bench_module()
    x = bk.make_inputs(200, 3, 5, 4, 2, 32, 16, dtype)
    ref = bk.prefix_verify_attention_ref(*bk.op_inputs(x)).float()
    got = bk.make_per_copy_sdpa(x, form)(x, torch.full_like(x["q"], float("nan")))
    assert bk.rel_err(got, ref) <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize(
    "name,gbps",
    [
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA H100 NVL", 3900),
        ("NVIDIA H200", 4800),
        ("NVIDIA H200 NVL", 4800),
        ("NVIDIA GH200 480GB", 4000),
        ("NVIDIA H20", 4000),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100-SXM4-40GB", 1555),
        ("NVIDIA A100 80GB PCIe", 1935),
        ("NVIDIA A10G", 600),
        ("NVIDIA L4", 300),
        ("NVIDIA L40S", 864),
    ],
)
def test_peak_bandwidth_by_name(monkeypatch, name, gbps):
    bk = _bench_module()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace())
    pk = bk.peak_bandwidth(0)
    assert pk["GBps"] == gbps and "spec sheet" in pk["source"]


def test_peak_bandwidth_from_properties_and_override(monkeypatch):
    bk = _bench_module()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA Future GPU")
    props = types.SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)  # kHz, bits (H100 SXM)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    pk = bk.peak_bandwidth(0)
    assert abs(pk["GBps"] - 3352.3) < 1 and "memory clock" in pk["source"]
    assert bk.peak_bandwidth(0, 1234.0)["GBps"] == 1234.0
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace())
    assert bk.peak_bandwidth(0)["GBps"] is None


def _gpu_row(ctx, K, dtype, ms_op, ms_sdpa, gbps, err=1e-3):
    return {
        "ctx": ctx,
        "K": K,
        "dtype": dtype,
        "ms": {"op": ms_op, "op_graph": ms_op * 0.8, "sdpa_per_copy": ms_sdpa},
        "speedup": {"vs_sdpa_per_copy": ms_sdpa / ms_op},
        "op_GBps": gbps,
        "bw_time_basis": "op_graph",
        "bytes_min": 1 << 20,
        "max_rel_err": {"op": err},
        "op_ok": True,
        "peak_mem_bytes": {},
        "notes": [],
        "sdpa_form": "lower_right_gqa",
    }


def test_report_judges_the_goals_in_gpu_mode(cpu_run, tmp_path):
    """The script's report helper, fed the data of a made-up GPU run."""
    helper = cpu_run[0] / "data" / "gpu_check_helper.py"
    data = tmp_path / "data"
    data.mkdir()
    (data / "env.json").write_text(
        json.dumps(
            {
                "mode": "cuda",
                "gpu": {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0"},
                "peak_bw": {"GBps": 3350.0, "source": "spec sheet"},
            }
        )
    )
    (data / "steps.tsv").write_text("".join(f"{s}\tok\t1.0\t\n" for s in STEPS))
    (data / "cuda_tests.json").write_text(
        json.dumps(
            {
                "tests": 100,
                "passed": 98,
                "failed": 0,
                "errors": 0,
                "skipped": 2,
                "failures": [],
                "skip_reasons": {"could not import 'flash_attn'": 2},
                "errors_by_dtype": {
                    "float32": {"cases": 40, "max_err": 3e-6, "worst": "t", "over_goal": 0},
                    "bfloat16": {"cases": 40, "max_err": 8e-3, "worst": "t", "over_goal": 0},
                },
            }
        )
    )
    rows = [_gpu_row(2048, 8, "bfloat16", 0.05, 0.25, 900), _gpu_row(2048, 8, "float32", 0.1, 0.2, 900, err=1e-6)]
    rows += [_gpu_row(32768, k, "bfloat16", 0.1, 1.0, gb) for k, gb in ((4, 2500), (8, 2100), (16, 1500))]
    (data / "bench.json").write_text(
        json.dumps({"meta": {"device": "cuda", "peak_bw": {"GBps": 3350.0, "source": "spec sheet"}}, "rows": rows})
    )
    env = dict(
        os.environ,
        GC_ROOT=str(ROOT),
        GC_OUT=str(tmp_path),
        GC_DATA=str(data),
        GC_STEPS=" ".join(STEPS),
        GC_TITLES="cuda_tests=CUDA kernel tests|",
    )
    r = subprocess.run([sys.executable, str(helper), "report", "final"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["result"] == "passed" and rep["mode"] == "cuda"
    g = {i: x for i, x in enumerate(rep["goals"])}
    assert g[0]["status"] == "pass" and "98 tests passed" in g[0]["figure"]
    assert g[1]["status"] == "pass" and g[1]["value"] == pytest.approx(5.0)
    assert g[2]["status"] == "fail" and g[2]["value"] == pytest.approx(1500 / 3350)  # K = 16 is under 60 %
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| **PASS** |" in md and "| **FAIL** |" in md and "H100" in md
    # an error over the goal (even with the tests' own tolerance met) fails the correctness goal
    rows[0]["max_rel_err"]["op"] = 0.05
    (data / "bench.json").write_text(json.dumps({"meta": {"device": "cuda"}, "rows": rows}))
    subprocess.run([sys.executable, str(helper), "report"], env=env, check=True, capture_output=True)
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["goals"][0]["status"] == "fail"


def test_costs_step_on_a_gpu_reports_what_gpu_costs_measured_left_out_and_failed(cpu_run, tmp_path):
    """The helper's `costs` command and report, fed the CPU run's gpu_costs.json made into a GPU run's."""
    helper = cpu_run[0] / "data" / "gpu_check_helper.py"
    data = tmp_path / "data"
    data.mkdir()
    (data / "mode").write_text("cuda")
    (data / "env.json").write_text(json.dumps({"mode": "cuda", "gpu": {"name": "NVIDIA H100 80GB HBM3"}}))
    costs = json.loads((cpu_run[0] / "gpu_costs.json").read_text())
    costs.update(
        device={"type": "cuda", "name": "NVIDIA H100 80GB HBM3"},
        measurement="random weights in the geometries' real shapes",
        not_measured=[{"case": "decode", "model": "tiny-draft", "size": 32, "why": "time budget 100 s"}],
        errors=[{"case": "verify_forward", "model": "tiny-target", "size": 16, "error": "OutOfMemoryError: boom"}],
    )
    (tmp_path / "gpu_costs.json").write_text(json.dumps(costs))
    env = dict(os.environ, GC_ROOT=str(ROOT), GC_OUT=str(tmp_path), GC_DATA=str(data), GC_STEPS=" ".join(STEPS))

    def costs_step(rc):
        r = subprocess.run([sys.executable, str(helper), "costs", str(rc)], env=env, capture_output=True, text=True)
        return r.returncode, (data / "costs.why").read_text().strip()

    rc, why = costs_step(0)
    assert rc == 0 and "cases on NVIDIA H100 80GB HBM3" in why
    assert "1 left out by the time budget" in why and "1 failed: OutOfMemoryError: boom" in why
    assert costs_step(1) == (1, "scripts/gpu_costs.py exited 1: OutOfMemoryError: boom")
    assert costs_step(124)[1].startswith("scripts/gpu_costs.py exited 124 (timed out)")

    (data / "steps.tsv").write_text("".join(f"{s}\tok\t1.0\t\n" for s in STEPS))
    subprocess.run([sys.executable, str(helper), "report"], env=env, check=True, capture_output=True)
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    summary = rep["costs"]
    assert summary["device"]["name"] == "NVIDIA H100 80GB HBM3" and summary["not_measured"] == 1
    want = {c["window"]: c["model_ms"] for c in costs["models"]["tiny-target"]["cases"] if "window" in c}
    assert summary["models"]["tiny-target"]["window_forward_ms"] == {str(w): ms for w, ms in want.items()}
    md = (tmp_path / "gpu_check.md").read_text().split("## Step costs of a PARSE window")[1]
    assert "random weights in the geometries' real shapes" in md
    assert "FAILED verify_forward tiny-target 16: OutOfMemoryError: boom" in md
    assert "1 case(s) left out by the time budget" in md

    (tmp_path / "gpu_costs.json").unlink()  # the script died before writing it
    assert costs_step(1)[0] == 1
