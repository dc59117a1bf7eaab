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
import re
import subprocess
import sys
import types
from argparse import Namespace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["env", "imports", "build", "goals", "link", "cuda_tests", "sanitizer", "bench", "costs", "cpu_tests"]
# tests/test_build_link.py (the op's link check, step 4) may not be in the checkout yet: then the step skips
HAS_LINK_TEST = (ROOT / "tests" / "test_build_link.py").is_file()


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
        "link": "ok" if HAS_LINK_TEST else "skipped",
        "cuda_tests": "skipped",
        "sanitizer": "skipped",
        "goals": "skipped",
        "bench": "skipped",
        "costs": "skipped",
        "cpu_tests": "ok",
    }, rep["steps"]
    detail = {s["name"]: s["detail"] for s in rep["steps"]}
    assert detail["build"].startswith("no GPU: CUDA build skipped")
    if not HAS_LINK_TEST:
        assert detail["link"] == "tests/test_build_link.py is not in this checkout: the link check is skipped"
    assert "skipped: no CUDA GPU" in detail["cuda_tests"]
    assert detail["sanitizer"] == "no GPU: nothing to sanitize"
    assert detail["goals"].startswith("no GPU: goal table not measured; CPU smoke pass of bench_kernel.py --goals")
    assert detail["bench"].startswith("no GPU: CUDA benchmark skipped")
    assert detail["costs"].startswith("no GPU: step costs not measured; CPU smoke pass of scripts/gpu_costs.py")
    # correctness + issue 35's five goals, all skipped without a GPU
    assert [g["status"] for g in rep["goals"]] == ["skipped"] * 6
    assert [g.get("key") for g in rep["goals"][1:]] == ["i_speedup", "ii_floor", "iii_abs", "iv_error", "v_wide_table"]
    # the goal table's smoke row ran every method the CPU has, against float64, and was judged
    gt = rep["goal_table"]
    assert gt["complete"] and gt["block_table_width"] == 2048
    (grow,) = gt["rows"]
    assert grow["shape"] == "256/4/4:2" and grow["op_ok"]
    assert {"op", "op_wide", "sdpa"} <= set(grow["us"]) and grow["max_abs_err"]["op"] < 1e-2
    assert "flex" in grow["us"] or "flex" in grow["skipped"]  # compiled Flex on this CPU, or why not
    assert set(grow["goals"]) == {"i_speedup", "ii_floor", "iii_abs", "iv_error", "v_wide_table"}
    assert sum(gt["summary"]["total"].values()) == 5
    assert "## Goal table (issue 35" in md and "| 256/4/4:2 |" in md and "CPU smoke pass of the goal table" in md
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
    # pytest refuses an unknown option: the first pytest step fails (the link check when its test
    # file is in the checkout, else the CUDA kernel tests); GPU_CHECK_KEEP_GOING=0 stops there
    # (by default every later step runs)
    r = run_check(tmp_path, PYTEST_ADDOPTS="--no-such-option-for-gpu-check", GPU_CHECK_KEEP_GOING="0")
    assert r.returncode == 1, r.stdout + r.stderr
    step, n, title = (
        ("link", 5, "the op's link (tests/test_build_link.py)")
        if HAS_LINK_TEST
        else ("cuda_tests", 6, "CUDA kernel tests (tests/test_kernel_cuda.py)")
    )
    assert f'FAILED at step {n}/{len(STEPS)} "{title}"' in r.stderr
    assert "pytest exited" in r.stderr and "last lines of" in r.stderr
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["result"] == "failed" and rep["failed_step"] == step
    status = {s["name"]: s["status"] for s in rep["steps"]}
    assert status["env"] == "ok" and status[step] == "failed"
    assert status["cpu_tests"] == "not run" and status["bench"] == "not run" and status["costs"] == "not run"
    assert status["goals"] == "skipped"  # right after the build: it ran (a CPU smoke pass here)
    assert not (tmp_path / "logs" / "bench.log").exists() and (tmp_path / "logs" / "goals.log").exists()
    assert f'FAILED at step "{title}' in (tmp_path / "gpu_check.md").read_text()


def test_a_python_that_does_not_run_fails_the_first_step(tmp_path):
    r = run_check(tmp_path, PYTHON="/bin/false")
    assert r.returncode == 1
    assert f'FAILED at step 1/{len(STEPS)} "environment": PYTHON=/bin/false does not run' in r.stderr
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


def _goal_rows(bk):
    """A made-up GPU goal table: the anchor's H200 times for the baselines, a fast op at 2k and a slow one
    at 8k/32:8, Flex missing at 32k/K4 (its default kernel found no config there)."""
    rows = []
    for shape, op, flex, sdpa, floor, wide in (
        ((2048, 8, 8, 2), 10.0, 87.8, 211.4, 1.6, 10.5),
        ((32768, 4, 8, 2), 30.0, None, 336.0, 12.9, 30.0),
        ((8192, 8, 32, 8), 80.0, 281.0, 615.0, 24.9, 200.0),
    ):
        us = {"op": op, "op_wide": wide, "sdpa": sdpa}
        err = {"op": 1e-3}
        if flex:
            us["flex"], err["flex"] = flex, 1e-3 if op < 50 else 3e-4
        r = {
            "shape": bk.shape_name(*shape),
            "ctx": shape[0],
            "K": shape[1],
            "Hq": shape[2],
            "Hkv": shape[3],
            "us": us,
            "max_abs_err": err,
            "rel_err": {"op": 3e-3},
            "floor_us": floor,
            "op_over_floor": op / floor,
            "speedup": {k: v / op for k, v in us.items() if k in ("flex", "sdpa")},
            "op_ok": True,
            "notes": [],
            "skipped": {} if flex else {"flex": "InductorError: NoValidChoicesError"},
            "wide_tokens": 131072,
            "table_tokens": shape[0],
        }
        r["goals"] = bk.judge_goals(r)
        rows.append(r)
    return rows


def test_report_judges_the_goals_in_gpu_mode(cpu_run, tmp_path):
    """The script's report helper, fed the data of a made-up GPU run."""
    bk = _bench_module()
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
    (data / "bench.json").write_text(json.dumps({"meta": {"device": "cuda"}, "rows": rows}))
    grows = _goal_rows(bk)
    meta = {
        "device": "cuda",
        "device_name": "NVIDIA H100 80GB HBM3",
        "goals": bk.GOALS,
        "block_table_width": 131072,
        "rates": {"copy_GBps": 3000.0, "gemm_TFLOPs": 700.0, "how": "measured"},
        "max_prefix_len": "the longest prefix",
    }
    (data / "goals.json").write_text(
        json.dumps({"meta": meta, "rows": grows, "summary": bk.goal_summary(grows), "complete": True})
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
    g = {x.get("key", "correct"): x for x in rep["goals"]}
    assert g["correct"]["status"] == "pass" and "98 tests passed" in g["correct"]["figure"]
    assert "goal table (bf16 vs float64): 0.003" in g["correct"]["figure"]
    # (i): 2k passes (8.8x Flex), 32k/K4 passes against SDPA alone, 8k/32:8 fails (3.5x Flex)
    assert g["i_speedup"]["status"] == "fail" and g["i_speedup"]["counts"] == {"PASS": 2, "FAIL": 1, "N/A": 0}
    assert "32768/4/8:2 PASS (11.20x vs sdpa (flex did not run))" in g["i_speedup"]["figure"]
    assert g["ii_floor"]["counts"] == {"PASS": 1, "FAIL": 1, "N/A": 1}  # 30/12.9 = 2.3x; 80/24.9 = 3.2x
    assert g["iii_abs"]["status"] == "pass" and g["iii_abs"]["counts"] == {"PASS": 1, "FAIL": 0, "N/A": 2}
    assert g["iv_error"]["counts"] == {"PASS": 1, "FAIL": 1, "N/A": 1}
    assert g["v_wide_table"]["counts"] == {"PASS": 2, "FAIL": 1, "N/A": 0}
    assert rep["goal_table"]["summary"]["total"] == {"PASS": 7, "FAIL": 4, "N/A": 4}
    assert rep["goal_table"]["rows"][0]["goals"]["i_speedup"] == "PASS"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| **PASS** |" in md and "| **FAIL** |" in md and "H100" in md
    assert "| 2048/8/8:2 | 10.0 | 10.5 | 87.8 | n/a | 211.4 | n/a | n/a | 1.6 | 6.2 | 8.78 | 21.14 |" in md
    assert "Goal table: 7 PASS, 4 FAIL, 4 N/A over 3 shapes" in md
    assert "goal table: 7 PASS, 4 FAIL, 4 N/A over 3 shapes" in r.stdout
    # the helper's goals step: counts in the step's detail; a wrong op fails the step
    (data / "mode").write_text("cuda")

    def goals_step(rc):
        r = subprocess.run([sys.executable, str(helper), "goals", str(rc)], env=env, capture_output=True, text=True)
        return r.returncode, (data / "goals.why").read_text().strip()

    rc, why = goals_step(0)
    assert rc == 0 and why.startswith("7 PASS, 4 FAIL, 4 N/A over 3 shapes (i 2/3, ii 1/2, iii 1/1")
    assert goals_step(124) == (1, "scripts/bench_kernel.py --goals exited 124 (timed out)")
    grows[1]["op_ok"] = False
    (data / "goals.json").write_text(
        json.dumps({"meta": meta, "rows": grows, "summary": bk.goal_summary(grows), "complete": True})
    )
    assert goals_step(1) == (1, "the op is wrong (or its shape failed) at 32768/4/8:2")
    # ... and the correctness goal
    subprocess.run([sys.executable, str(helper), "report"], env=env, check=True, capture_output=True)
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["goals"][0]["status"] == "fail"
    # an error over the goal in the old benchmark table (even with the tests' own tolerance met) fails it too
    grows[1]["op_ok"] = True
    (data / "goals.json").write_text(
        json.dumps({"meta": meta, "rows": grows, "summary": bk.goal_summary(grows), "complete": True})
    )
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
    want = {str(c["window"]): c["model_ms"] for c in costs["models"]["tiny-target"]["cases"] if "window" in c}
    want.update(
        {
            f"{c['window']} @bs{c['batch']}": c["model_ms"]
            for c in costs["models"]["tiny-target"].get("batch_cases", [])
            if "window" in c
        }
    )
    assert any("@bs" in k for k in want)  # the batch-8 forwards reach the report
    assert summary["models"]["tiny-target"]["window_forward_ms"] == want
    md = (tmp_path / "gpu_check.md").read_text().split("## Step costs of a PARSE window")[1]
    assert "random weights in the geometries' real shapes" in md
    assert "FAILED verify_forward tiny-target 16: OutOfMemoryError: boom" in md
    assert "1 case(s) left out by the time budget" in md

    (tmp_path / "gpu_costs.json").unlink()  # the script died before writing it
    assert costs_step(1)[0] == 1


# --------------------------------------------------------------------------- the goal table's pieces (issue 35)


def _goal_input(bk, ctx, hq, hkv, us, floor=None, err=None):
    return {"ctx": ctx, "Hq": hq, "Hkv": hkv, "us": us, "floor_us": floor, "max_abs_err": err or {}}


def test_goal_rules_hand_computed():
    bk = _bench_module()

    def judge(*a, **kw):
        return bk.judge_goals(_goal_input(bk, *a, **kw))

    def status(g):
        return {k: v["status"] for k, v in g.items()}

    # 2048/8/8:2: 4.5x the closer baseline, 10 us, equal errors, 1.1x with a wide table
    g = judge(2048, 8, 2, {"op": 10.0, "flex": 50.0, "sdpa": 45.0, "op_wide": 11.0}, 2.0, {"op": 1e-3, "flex": 1e-3})
    assert status(g) == {
        "i_speedup": "PASS",
        "ii_floor": "N/A",  # ctx < 8192: shown, not judged
        "iii_abs": "PASS",
        "iv_error": "PASS",
        "v_wide_table": "PASS",
    }
    assert g["i_speedup"]["value"] == pytest.approx(4.5) and g["ii_floor"]["value"] == pytest.approx(5.0)
    assert g["iii_abs"]["limit"] == 15.0 and g["v_wide_table"]["value"] == pytest.approx(1.1)
    assert g["i_speedup"]["why"] == "5.00x vs flex, 4.50x vs sdpa"
    # under 4x against one baseline fails (i); 15.1 us fails (iii)
    g = judge(2048, 8, 2, {"op": 15.1, "flex": 60.0, "sdpa": 100.0})
    assert g["i_speedup"]["status"] == "FAIL" and g["i_speedup"]["value"] == pytest.approx(60 / 15.1)
    assert g["iii_abs"]["status"] == "FAIL"
    assert judge(2048, 8, 2, {"op": 10.0, "flex": 40.0, "sdpa": 40.0})["i_speedup"]["status"] == "PASS"  # 4x exactly
    # 32:8 at 2k: 20 us, inclusive
    assert judge(2048, 32, 8, {"op": 20.0})["iii_abs"]["status"] == "PASS"
    assert judge(2048, 32, 8, {"op": 20.01})["iii_abs"]["status"] == "FAIL"
    # 8192/8/32:8: 3x the floor and 2x Flex's error, both inclusive
    g = judge(8192, 32, 8, {"op": 75.0}, 25.0, {"op": 2e-3, "flex": 1e-3})
    assert g["ii_floor"]["status"] == "PASS" and g["ii_floor"]["value"] == pytest.approx(3.0)
    assert g["iv_error"]["status"] == "PASS" and g["iv_error"]["value"] == pytest.approx(2.0)
    g = judge(8192, 32, 8, {"op": 80.0}, 24.9, {"op": 2.1e-3, "flex": 1e-3})
    assert g["ii_floor"]["status"] == "FAIL" and g["iv_error"]["status"] == "FAIL"
    assert g["iii_abs"]["status"] == "N/A" and g["i_speedup"]["status"] == "N/A"  # no absolute goal; no baseline
    assert g["v_wide_table"]["status"] == "N/A"
    assert judge(8192, 8, 2, {"op": 10.0})["ii_floor"]["status"] == "N/A"  # no floor measured
    # Flex missing (as at 32k/K4 on the H200): (i) on SDPA alone, (iv) not judged
    g = judge(32768, 8, 2, {"op": 30.0, "sdpa": 336.0}, 12.9, {"op": 1e-3})
    assert g["i_speedup"]["status"] == "PASS" and g["i_speedup"]["why"] == "11.20x vs sdpa (flex did not run)"
    assert g["ii_floor"]["status"] == "PASS" and g["iv_error"]["status"] == "N/A"
    assert "Flex did not run" in g["iv_error"]["why"]
    # the H200 run of 2026-11-26 (op 168 us, Flex 88, SDPA 211, floor 1.6): fails (i) and (iii)
    g = judge(2048, 8, 2, {"op": 168.4, "flex": 87.8, "sdpa": 211.4}, 1.6, {"op": 3e-3, "flex": 3e-3})
    assert status(g)["i_speedup"] == "FAIL" and status(g)["iii_abs"] == "FAIL" and status(g)["iv_error"] == "PASS"
    # a wide table 1.2x slower fails (v); no op time: nothing judged
    assert judge(2048, 8, 2, {"op": 10.0, "op_wide": 12.0})["v_wide_table"]["status"] == "FAIL"
    assert set(status(judge(2048, 8, 2, {})).values()) == {"N/A"}
    s = bk.goal_summary([{"goals": g}, {"goals": judge(2048, 8, 2, {})}])
    assert s["total"] == {"PASS": 1, "FAIL": 2, "N/A": 7} and s["by_goal"]["iv_error"] == {
        "PASS": 1,
        "FAIL": 0,
        "N/A": 1,
    }


# the issue's floor column (H200: 4207.5 GB/s copy, 810.7 TFLOP/s bf16 GEMM, measured in anchor.json)
@pytest.mark.parametrize(
    "shape,want",
    [
        ((2048, 8, 8, 2), 1.6),
        ((2048, 16, 8, 2), 3.1),
        ((8192, 8, 8, 2), 6.2),
        ((32768, 4, 8, 2), 12.9),
        ((32768, 8, 8, 2), 24.8),
        ((32768, 16, 8, 2), 48.7),
        ((2048, 8, 32, 8), 6.3),
        ((8192, 8, 32, 8), 24.9),
    ],
)
def test_floor_reproduces_the_issues_column(shape, want):
    bk = _bench_module()
    ctx, K, hq, hkv = shape
    x = bk.make_inputs(ctx, K, 24, hq, hkv, 128, 16, torch.bfloat16)
    _, plens, _ = x["lists"]
    assert plens == [ctx // 2 + k * ctx // (2 * K) for k in range(1, K + 1)]  # P_k = ctx (1/2 + k / 2K)
    flops = bk.verify_flops(plens, 24, hq, 128)
    assert flops == bk.attention_flops(x)
    us, bound = bk.floor_us(bk.bytes_moved(x)[0], flops, 4207.5, 810.7)
    assert round(us, 1) == want and bound == "compute"


def test_floor_by_hand():
    bk = _bench_module()
    # 2048/8/8:2: FLOPs 4*128*8*(24*12800 + 8*300) = 1,268,121,600; bytes 2 MiB of K+V + q/out/k_new/v_new + index
    assert bk.verify_flops([1024 + 128 * k for k in range(1, 9)], 24, 8, 128) == 1_268_121_600
    x = bk.make_inputs(2048, 8, 24, 8, 2, 128, 16, torch.bfloat16)
    T = 192
    assert bk.bytes_moved(x)[0] == 2 * 2048 * 2 * 128 * 2 + 2 * T * 8 * 128 * 2 + 2 * T * 2 * 128 * 2 + 4 * (
        128 + 8 + 8 + 9
    )
    us, bound = bk.floor_us(bk.bytes_moved(x)[0], 1_268_121_600, 4200, 810)
    assert us == pytest.approx(1.5656, abs=1e-4) and bound == "compute"  # 3.08 MB / 4200 GB/s = 0.73 us
    # memory-bound: 4.2 MB at 4200 GB/s = 1 us > 0.5 us of FLOPs
    us, bound = bk.floor_us(4.2e6, 4.05e8, 4200, 810)
    assert us == pytest.approx(1.0) and bound == "memory"
    assert bk.floor_us(4.2e6, 4.05e8, None, 810) == (None, None)


def test_parse_shape():
    bk = _bench_module()
    assert bk.parse_shape("2048/8/32:8") == (2048, 8, 32, 8)
    assert bk.shape_name(*bk.parse_shape(" 32768/16/8:2 ")) == "32768/16/8:2"
    for bad in ("2048/8/8", "2048/8/6:4", "0/8/8:2", "2k/8/8:2"):
        with pytest.raises(Exception, match="want ctx/K/Hq:Hkv|positive numbers"):
            bk.parse_shape(bad)


def test_flex_mask_is_parses_mask_and_eager_flex_matches_float64():
    from torch.nn.attention.flex_attention import create_mask

    bk = _bench_module()
    x = bk.make_inputs(200, 3, 5, 4, 2, 32, 16, torch.float32)  # prefixes 133, 166, 200: off the block edges
    mask_mod, N, T = bk.flex_mask(x)
    assert (N, T) == (200, 15)
    got = create_mask(mask_mod, 1, 1, T, N + T, device="cpu")[0, 0]
    want = torch.zeros(T, N + T, dtype=torch.bool)
    _, plens, cu = x["lists"]
    for c, p in enumerate(plens):
        for t in range(cu[c], cu[c + 1]):
            want[t, :p] = True
            want[t, N + cu[c] : N + t + 1] = True
    assert torch.equal(got, want)
    ref = bk.reference_f64(x)
    assert bk.rel_err(bk.prefix_verify_attention_ref(*bk.op_inputs(x)), ref) < 1e-5
    flex, flex_gather, info = bk.make_flex(x, "eager")
    assert info["kernel_options"] is None and "gathered" in info["kv"]
    for fn in (flex, flex_gather):
        assert bk.abs_err(fn()[0].transpose(0, 1), ref) < 1e-5


class _FakeFlashInfer(types.SimpleNamespace):
    """BatchPrefillWithPagedKVCacheWrapper's contract (NHD pages, CSR page lists, last page length,
    bottom-right causal or a flattened per-request custom mask, GQA) over SDPA."""

    __version__ = "fake"

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, workspace, layout, use_cuda_graph=False, **bufs):
            assert layout == "NHD"
            self.graph, self.bufs = use_cuda_graph, bufs

        def plan(self, qo, kv_indptr, kv_indices, last, hq, hkv, d, page, causal=False, custom_mask=None, **kw):
            assert all(not t.is_cuda for t in (qo, kv_indptr, kv_indices, last))  # host copies, as plan wants
            if self.graph:
                assert torch.equal(self.bufs["paged_kv_indices_buf"].cpu(), kv_indices)
            self.qo, self.indptr, self.indices, self.last = qo.tolist(), kv_indptr.tolist(), kv_indices, last.tolist()
            self.page, self.causal, self.mask, self.scale = page, causal, custom_mask, kw["sm_scale"]
            assert causal != (custom_mask is not None)

        def run(self, q, kv):
            k_cache, v_cache = kv
            out, moff = torch.empty_like(q), 0
            for i in range(len(self.qo) - 1):
                pages = self.indices[self.indptr[i] : self.indptr[i + 1]].long()
                n = (len(pages) - 1) * self.page + self.last[i]
                k, v = k_cache[pages].flatten(0, 1)[:n], v_cache[pages].flatten(0, 1)[:n]
                qi = q[self.qo[i] : self.qo[i + 1]]
                lq = qi.shape[0]
                if self.causal:
                    m = torch.arange(n)[None] <= torch.arange(lq)[:, None] + (n - lq)
                else:
                    m = self.mask[moff : moff + lq * n].view(lq, n)
                    moff += lq * n
                o = torch.nn.functional.scaled_dot_product_attention(
                    qi.transpose(0, 1)[None],
                    k.transpose(0, 1)[None],
                    v.transpose(0, 1)[None],
                    attn_mask=m,
                    scale=self.scale,
                    enable_gqa=True,
                )
                out[self.qo[i] : self.qo[i + 1]] = o[0].transpose(0, 1)
            return out


def _fake_varlen(
    q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, softmax_scale, causal, block_table, out
):
    """vllm_flash_attn.flash_attn_varlen_func over SDPA: sequence i's keys are the first
    seqused_k[i] slots of its block table's pages; causal is bottom-right."""
    assert causal and int(seqused_k.max()) == max_seqlen_k
    bs, Hkv, D = k.shape[1:]
    for i in range(block_table.shape[0]):
        q0, q1, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
        assert q1 - q0 <= max_seqlen_q
        pages = block_table[i, : -(-n // bs)].long()
        ki, vi = k[pages].reshape(-1, Hkv, D)[:n], v[pages].reshape(-1, Hkv, D)[:n]
        lq = q1 - q0
        m = torch.arange(n)[None] <= torch.arange(lq)[:, None] + (n - lq)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
            attn_mask=m, scale=softmax_scale, enable_gqa=True,
        )  # fmt: skip
        out[q0:q1] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("shape", [(256, 4, 4, 2), (200, 3, 4, 2)], ids=["aligned", "prefix-inside-a-page"])
def test_goal_row_gpu_path_on_cpu(monkeypatch, capsys, shape):
    """Every method of the goal table on the CPU: the CUDA graph capture and the CUDA timer replaced,
    flash-attn and FlashInfer faked over SDPA (so their inputs -- gathers, page lists, masks -- are checked)."""
    bk = _bench_module()
    captured = []

    def capture(fn):
        captured.append(fn)
        return fn

    def timer(fns, x, out, flush, stat="median", **kw):
        assert kw["min_reps"] == kw["max_reps"] == 1
        return bk.time_interleaved(fns, x, out, stat, min_time=0.0, min_reps=1, max_reps=1)

    monkeypatch.setattr(bk, "capture", capture)
    monkeypatch.setattr(bk, "time_interleaved_cuda", timer)
    args = Namespace(suffix=5, head_size=32, block_size=16, reps=1, flex="eager", block_table_width=1024)
    rates = {"copy_GBps": 100.0, "gemm_TFLOPs": 1.0}
    row = bk.goal_row(
        shape,
        args,
        torch.device("cpu"),
        rates=rates,
        flash_attn=_FakeFlash(),
        flashinfer=_FakeFlashInfer(),
        gpu_path=True,
        forked_attn=_fake_varlen,
    )
    assert row["op_ok"] and not row["notes"], row["notes"]
    methods = {
        "op",
        "op_wide",
        "op_cuda_core",
        "flex",
        "flex_gather",
        "sdpa_lower_right_gqa",
        "sdpa_mask_gqa",
        "flash",
        "flashinfer",
        "forked",
    }
    assert set(row["us"]) == methods | {"op_eager", "sdpa"}
    # the table as an entry of the verifier factory's record: accepted by its check, keyed by
    # the version the op reports for bf16, one row per shape with the op, the forked path's
    # attention (the factory's alternative) and the per-copy times (for information)
    from parse_vllm.verify import factory

    meta = {"dtype": "bfloat16", "device_name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "timing": "t"}
    entry = factory._check_entry(bk.kernel_measurement(meta, [row]))
    version = torch.ops.parse_vllm.cuda_kernel_version(torch.bfloat16)
    assert entry["kernel_version"] == version and version.startswith("tc-") and len(version) == 19
    assert entry["capability"] == "9.0" and entry["device"] == meta["device_name"] and entry["complete"] is True
    (r,) = entry["rows"]
    assert r["op_us"] == round(row["us"]["op"], 1) and r["per_copy_us"] == {
        "sdpa": round(row["us"]["sdpa"], 1),
        "flash": round(row["us"]["flash"], 1),
    }
    assert r["forked_us"] == {"forked": round(row["us"]["forked"], 1), "flashinfer": round(row["us"]["flashinfer"], 1)}
    assert "forked_attention" not in row["skipped"] and "flash_attn_varlen_func" in row["forked"]["form"]
    partial = bk.kernel_measurement(meta, [row], complete=False, failed=["sanitizer"])
    assert partial["complete"] is False and partial["failed"] == ["sanitizer"]
    assert bk.kernel_measurement(meta, [dict(row, op_ok=False)]) is None  # a wrong op measures nothing
    assert row["sdpa_form"] in bk.GOAL_SDPA_FORMS and row["us"]["sdpa"] == row["us"]["sdpa_" + row["sdpa_form"]]
    aligned = shape[0] == 256
    assert row["flashinfer"]["graphable"] is aligned and ("causal" in row["flashinfer"]["form"]) is aligned
    want_graphed = {m: True for m in methods}  # the forked pass is graph-safe in both forms
    if not aligned:
        want_graphed["flashinfer"] = "no: not graph-safe in this form"
    assert row["graphed"] == want_graphed and len(captured) == len(methods) - (not aligned)
    # every method agrees with float64 (bf16 inputs and outputs); the op's error is Flex's, to rounding
    assert all(e < 2e-2 for e in row["max_abs_err"].values()), row["max_abs_err"]
    assert row["max_abs_err"]["op"] <= 2 * row["max_abs_err"]["flex"]
    assert row["wide_tokens"] == 1024 and row["table_tokens"] == -(-shape[0] // 16) * 16
    assert row["max_prefix_len"] == row["prefix_lens"][-1] == shape[0]
    x = bk.make_inputs(shape[0], shape[1], 5, shape[2], shape[3], 32, 16, torch.bfloat16)
    assert row["flops"] == bk.attention_flops(x) and row["bytes_min"] == bk.bytes_moved(x)[0]
    assert row["floor_us"] == pytest.approx(max(row["bytes_min"] / 100e9, row["flops"] / 1e12) * 1e6)
    assert row["op_over_floor"] == pytest.approx(row["us"]["op"] / row["floor_us"])
    assert set(row["goals"]) == set(bk.GOALS) and row["goals"]["iv_error"]["status"] == "PASS"
    bk.print_goal_row(row)
    assert f"{bk.shape_name(*shape)} |" in capsys.readouterr().out
    # a wrong op is flagged, not hidden; a table already as wide as asked gives no op_wide
    monkeypatch.setattr(bk.ops, "prefix_verify_attention", lambda *a, out=None: out.fill_(0.5))
    args.block_table_width, args.flex = 64, "off"
    row = bk.goal_row(shape, args, torch.device("cpu"), rates=rates, gpu_path=True)
    assert not row["op_ok"] and any(n.startswith("op disagrees with float64") for n in row["notes"])
    assert "op_wide" not in row["us"] and "already" in row["goals"]["v_wide_table"]["why"]
    assert row["skipped"] == {
        "flex": "--flex off",
        "flash": "flash-attn not installed",
        "flashinfer": "flashinfer not installed (or --no-flashinfer)",
        "forked": "vLLM's paged FlashAttention (vllm.vllm_flash_attn) does not import here",
    }
    assert row["goals"]["iv_error"]["status"] == "N/A"


def test_a_wide_block_table_changes_nothing_but_its_width():
    bk = _bench_module()
    x = bk.make_inputs(300, 4, 6, 4, 2, 32, 16, torch.float32)
    y = bk.make_inputs(300, 4, 6, 4, 2, 32, 16, torch.float32, bt_width=32768)
    assert x["md"].block_table.shape[1] == 19 and y["md"].block_table.shape[1] == 2048
    assert torch.equal(y["md"].block_table[:, :19], x["md"].block_table)
    assert bk.bytes_moved(x) == bk.bytes_moved(y)  # only the read entries count
    assert x["md"].max_prefix_len == y["md"].max_prefix_len == 300
    assert bk.widen_block_table(x["md"], 300, 16) is None
    out_x = bk.run_op(x, torch.full_like(x["q"], float("nan")))
    out_y = bk.run_op(y, torch.full_like(y["q"], float("nan")))
    assert torch.equal(out_x, out_y)


def test_the_run_writes_its_measurement_into_the_record(tmp_path):
    """Issue 49 F5: gpu_check.sh's write_record (run after the goal table and at the end of the
    run) puts OUTDIR/kernel_measurement.json into the record with the failed steps listed,
    replacing the same run's entry; a quick run and GPU_CHECK_RECORD="" write nothing."""
    from parse_vllm.verify import factory

    fn = re.search(r"^write_record\(\) \{.*?^\}$", SCRIPT.read_text(), re.S | re.M).group(0)
    record = tmp_path / "record.json"
    committed = json.loads((ROOT / "parse_vllm" / "verify" / "kernel_measurements.json").read_text())
    record.write_text(json.dumps(committed))
    rows = [
        dict(ctx=c, K=k, Hq=hq, Hkv=hkv, D=128, L=24, op_us=10.0, forked_us={"forked": 40.0})
        for c, k, hq, hkv in factory.GOAL_SHAPES
    ]
    entry = dict(kernel_version="tc-0011223344556677", device="NVIDIA H100 80GB HBM3", capability="9.0",
                 date="2026-12-01", dtype="bfloat16", source="t", complete=True, rows=rows)  # fmt: skip
    (tmp_path / "kernel_measurement.json").write_text(json.dumps(entry))

    def run(failed, **env):
        script = f'{fn}\nwrite_record "{failed}"\n'
        e = dict(os.environ, PY=sys.executable, ROOT=str(ROOT), OUT=str(tmp_path), GC_QUICK="0", **env)
        return subprocess.run(["bash", "-c", script], env=e, capture_output=True, text=True, timeout=60)

    r = run("goals", GPU_CHECK_RECORD=str(record))
    assert r.returncode == 0 and "added an entry for kernel tc-0011223344556677" in r.stdout, r.stderr
    r = run("sanitizer cuda_tests", GPU_CHECK_RECORD=str(record))
    assert "replaced the entry" in r.stdout and "failed: sanitizer, cuda_tests" in r.stdout, r.stdout + r.stderr
    entries = factory.load_measurements(record)
    assert len(entries) == len(committed["measurements"]) + 1 and entries[-1]["failed"] == ["sanitizer", "cuda_tests"]
    assert factory.measured_verdict("tc-0011223344556677", "bfloat16", "NVIDIA H100 80GB HBM3", 128, entries)[0]
    before = record.read_text()
    assert run("", GPU_CHECK_RECORD="").stdout == "" and record.read_text() == before
    r = subprocess.run(
        ["bash", "-c", f'{fn}\nwrite_record ""\n'],
        env=dict(os.environ, PY=sys.executable, ROOT=str(tmp_path), OUT=str(tmp_path), GC_QUICK="1"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout == ""
