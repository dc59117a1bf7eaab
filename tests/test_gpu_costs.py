"""scripts/gpu_costs.py (the step costs of a PARSE window on a GPU) run on the CPU in tiny
shapes, and the projection that combines its JSON with this CPU's PARSE counters
(parse_vllm/tools/benchmarks/projection.py, `scripts/bench_report.py --gpu-costs`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parse_vllm.tools.benchmarks import projection as pj
from parse_vllm.tools.benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_costs.py"
TINY = ["--device", "cpu", "--tiny", "--batches", "1", "8", "--windows", "8", "16", "--copies", "2", "4"]
TINY += ["--context", "64", "--repeats", "2"]


def run_costs(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "gpu_costs.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r, out


@pytest.fixture(scope="module")
def tiny_costs(tmp_path_factory):
    r, out = run_costs(tmp_path_factory.mktemp("costs"), *TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    return r, json.loads(out.read_text())


def _times(obj):
    """Every *_ms value in a nested JSON object."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k.endswith("_ms") and isinstance(v, (int, float)):
                yield k, v
            else:
                yield from _times(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _times(v)


def test_tiny_cpu_run_measures_every_planned_case(tiny_costs):
    r, c = tiny_costs
    assert c["schema"] == "parse-vllm/gpu-costs/1" and c["device"]["type"] == "cpu" and c["tiny"]
    assert c["measurement"].startswith("a smoke run") and c["dtype"] == "float32"
    assert c["errors"] == [] and c["not_measured"] == []
    assert c["pairs"] == [{"draft": "tiny-draft", "target": "tiny-target"}]
    times = list(_times(c))
    assert len(times) > 20 and all(math.isfinite(v) and v > 0 for _, v in times), times
    target, draft = c["models"]["tiny-target"], c["models"]["tiny-draft"]
    got = {(x["case"], x["batch"], x["new_tokens"], x["logit_positions"]) for x in target["cases"]}
    assert got == {
        ("decode", 1, 1, 1),
        ("decode", 8, 1, 8),
        ("window_forward", 1, 8, 8),
        ("window_forward", 1, 16, 16),
        ("verify_forward", 1, 2 * 24, 2),  # K copies of the 24-token suffix, one logit per copy
        ("verify_forward", 1, 4 * 24, 4),
    }
    # the forwards at the larger batch: 8 sequences of W tokens (logits at each), of K x 24 tokens (K logits each)
    got = {(x["case"], x["batch"], x["new_tokens"], x["logit_positions"]) for x in target["batch_cases"]}
    assert got == {
        ("window_forward", 8, 8, 8 * 8),
        ("window_forward", 8, 16, 8 * 16),
        ("verify_forward", 8, 2 * 24, 8 * 2),
        ("verify_forward", 8, 4 * 24, 8 * 4),
    }
    assert {x["window"] for x in target["batch_cases"] if x["case"] == "window_forward"} == {8, 16}
    assert {x["copies"] for x in target["batch_cases"] if x["case"] == "verify_forward"} == {2, 4}
    assert {(x["case"], x["batch"]) for x in draft["cases"]} == {("decode", 1), ("decode", 8)}  # a draft only decodes
    assert draft["batch_cases"] == []
    for m in (target, draft):
        depth = m["geometry"]["num_hidden_layers"]
        for x in m["cases"] + m["batch_cases"]:  # the stated extrapolation is what the numbers are
            assert x["layer_ms"] == pytest.approx(x["stack_ms"] / x["layers_built"])
            assert x["model_ms"] == pytest.approx(x["layer_ms"] * depth + x["head_ms"])
            assert x["context"] == 64 and x["timing"] == "eager"
    decode = next(x for x in target["cases"] if x["case"] == "decode" and x["batch"] == 8)
    assert decode["tokens_per_s"] == pytest.approx(8 / decode["model_ms"] * 1e3)
    assert [a["copies"] for a in c["verify_attention"]] == [2, 4]
    for a in c["verify_attention"]:
        assert a["model"] == "tiny-target" and a["sdpa_per_copy_ms"] > 0
        if "op_ms" in a:  # the CPU twin of the op, when it is built: right, and its time given
            assert a["op_rel_err"] < 1e-4
            assert a["op_speedup_vs_sdpa_per_copy"] == pytest.approx(a["sdpa_per_copy_ms"] / a["op_ms"])
        else:
            assert a["op"].startswith("not measured")
    assert (
        "tiny-target" in r.stdout
        and "verify attention" in r.stdout
        and "at batch 8: window_forward (W) 8: " in r.stdout
    )


def test_time_budget_leaves_cases_out_and_says_so(tmp_path):
    r, out = run_costs(tmp_path, *TINY, "--budget-s", "0")
    assert r.returncode == 1, r.stdout + r.stderr  # nothing measured
    c = json.loads(out.read_text())
    assert c["models"] == {} and c["verify_attention"] == []
    # decodes of both at batch 1 and 8; the target's windows, verify forwards and attention at batch 1;
    # its windows and verify forwards at batch 8
    assert len(c["not_measured"]) == 2 * 2 + 2 + 2 + 2 + 2 + 2
    assert {x["why"] for x in c["not_measured"]} == {"time budget 0 s"}
    # the order they would have run in: every batch-1 cost first, then batch 8 model by model
    assert [(x["case"], x["model"], x["size"], x["batch"]) for x in c["not_measured"]] == [
        ("decode", "tiny-target", 1, 1),
        ("window_forward", "tiny-target", 8, 1),
        ("window_forward", "tiny-target", 16, 1),
        ("verify_forward", "tiny-target", 2, 1),
        ("verify_forward", "tiny-target", 4, 1),
        ("verify_attention", "tiny-target", 2, 1),
        ("verify_attention", "tiny-target", 4, 1),
        ("decode", "tiny-draft", 1, 1),
        ("decode", "tiny-target", 8, 8),
        ("window_forward", "tiny-target", 8, 8),
        ("window_forward", "tiny-target", 16, 8),
        ("verify_forward", "tiny-target", 2, 8),
        ("verify_forward", "tiny-target", 4, 8),
        ("decode", "tiny-draft", 8, 8),
    ]


def test_bad_usage_and_a_missing_gpu_exit_2(tmp_path):
    r, _ = run_costs(tmp_path, "--device", "cpu", "--models", "qwen3-70b")
    assert r.returncode == 2 and "unknown geometries" in r.stderr
    r, out = run_costs(tmp_path, "--device", "cuda")  # CUDA_VISIBLE_DEVICES="" hides any GPU
    assert r.returncode == 2 and "no CUDA device" in r.stderr and not out.exists()


# --------------------------------------------------------------------------- the projection


def _costs() -> dict:
    """A gpu_costs.json by hand: a 2-layer target whose batch-1 layers cost 8 ms over 1 new
    token, 12 over 16, 16 over 32 (full depth), its head 2 ms at 1 position, 2.5 at 2, 4 at
    16 (decode 10 ms); a 1-layer draft decoding in 1.5 ms."""

    def case(kind, new, positions, layer_ms, head_ms, depth, batch=1):
        return {
            "case": kind,
            "batch": batch,
            "new_tokens": new,
            "logit_positions": positions,
            "layer_ms": layer_ms,
            "head_ms": head_ms,
            "model_ms": layer_ms * depth + head_ms,
        }

    return {
        "device": {"name": "Test GPU"},
        "dtype": "bfloat16",
        "measurement": "by hand",
        "settings": {"context": 1024},
        "pairs": [{"draft": "d", "target": "t"}],
        "models": {
            "t": {
                "geometry": {"num_hidden_layers": 2},
                "cases": [
                    case("decode", 1, 1, 4.0, 2.0, 2),
                    case("decode", 1, 8, 5.0, 3.0, 2, batch=8),  # not batch 1: not in the curves
                    case("window_forward", 16, 16, 6.0, 4.0, 2),
                    case("verify_forward", 32, 2, 8.0, 2.5, 2),
                ],
            },
            "d": {"geometry": {"num_hidden_layers": 1}, "cases": [case("decode", 1, 1, 1.0, 0.5, 1)]},
        },
        "verify_attention": [],
    }


def test_interpolation_is_piecewise_linear_and_extends_the_end_segments():
    pts = [(1.0, 8.0), (16.0, 12.0), (32.0, 16.0)]
    assert pj._interp(pts, 16) == 12.0 and pj._interp(pts, 24) == 14.0
    assert pj._interp(pts, 48) == 20.0  # past the last point, along the last segment
    assert pj._interp(pts, 0) == pytest.approx(8 - 4 / 15)  # before the first, along the first
    assert pj._interp([(4.0, 3.0)], 100) == 3.0


def test_model_costs_are_the_batch_1_curves():
    t = pj.model_costs(_costs(), "t")
    assert t.layers == [(1.0, 8.0), (16.0, 12.0), (32.0, 16.0)]
    assert t.head == [(1.0, 2.0), (2.0, 2.5), (8.0, 3.0), (16.0, 4.0)]  # the head depends on positions only
    assert (t.decode_ms, t.layer_decode_ms) == (10.0, 4.0)
    assert t.forward_ms(16, 16) == 16.0
    with pytest.raises(KeyError, match="no measured cases"):
        pj.model_costs(_costs(), "nobody")


def test_projection_by_hand():
    c = pj.Counters(
        tokens=100,
        accepted=60,
        windows=4,
        window_tokens=60,  # W = 15: a forward over 16 tokens, 16 logits: 12 + 4 ms
        accepted_in_windows=50,
        passes=2,
        copies=4,  # C = 2 copies of L = 16 tokens: a forward over 32 tokens, 2 logits: 16 + 2.5 ms
        suffix_tokens=64,
        token_level_drafts={"draft_model": 2},
        token_level_draft_tokens={"draft_model": 30},  # k = 15: 16 tokens again
    )
    p = pj.project(c, pj.model_costs(_costs(), "t"), pj.model_costs(_costs(), "d"))
    assert p["steps"] == {
        "target_steps": 40,
        "plain_decode_steps": 34,
        "windows": 4,
        "verification_passes": 2,
        "token_level_steps": 2,
        "draft_model_tokens": 90,
        "eagle3_tokens": 0,
    }
    assert p["time_ms"] == {
        "plain_decode": 340.0,
        "window_forwards": 64.0,
        "verification": 37.0,
        "token_level_forwards": 32.0,
        "draft_model": 135.0,
        "eagle3": 0.0,
        "total": 608.0,
    }
    assert p["target_alone_ms"] == 1000.0 and p["speedup"] == pytest.approx(1000 / 608)
    w = p["per_window"]  # 15 draft steps + the window's forward + half a pass, for 50/4 + 1 tokens
    assert w["ms"] == pytest.approx(22.5 + 16 + 9.25) and w["tokens"] == 13.5
    assert w["pays"] and w["ms_per_token"] == pytest.approx(47.75 / 13.5)


def test_eagle3_tokens_cost_a_target_layer_and_the_head_and_nothing_accepted_is_the_target():
    t, d = pj.model_costs(_costs(), "t"), pj.model_costs(_costs(), "d")
    p = pj.project(pj.Counters(tokens=50, accepted=0), t, d)
    assert p["speedup"] == 1.0 and "per_window" not in p
    c = pj.Counters(tokens=50, accepted=20, token_level_drafts={"eagle3": 10}, token_level_draft_tokens={"eagle3": 30})
    p = pj.project(c, t, d)
    assert p["time_ms"]["eagle3"] == 30 * (4.0 + 2.0) and p["time_ms"]["draft_model"] == 0
    assert p["steps"]["plain_decode_steps"] == 50 - 20 - 10
    odd = pj.project(pj.Counters(tokens=10, accepted=9, windows=3, window_tokens=30), t, d)
    assert odd["steps"]["plain_decode_steps"] == 0 and "counted as 0" in odd["notes"][0]


def test_counters_from_eval_rows_old_and_new():
    new = {
        "config": "parse W=48 e3",
        "tokens": 1024,
        "acceptance": {
            "vllm_drafts": 695,
            "vllm_draft_tokens": 2490,
            "vllm_accepted": 326,
            "drafts": 8,
            "draft_tokens": 384,
            "tokens_accepted_semantic": 0,
            "tokens_accepted_token_level": 14,
            "verification_passes": 8,
            "copies": 30,
            "suffix_tokens": 930,
            "token_level_drafts": {"eagle3": 686},
            "token_level_draft_tokens": {"eagle3": 2058},
            "token_level_accepted_tokens": {"eagle3": 312},
        },
    }
    c = pj.counters_from_row(new)
    assert (c.tokens, c.accepted, c.windows, c.window_tokens, c.accepted_in_windows) == (1024, 326, 8, 384, 14)
    assert c.token_level_drafts == {"eagle3": 686} and c.token_level_draft_tokens == {"eagle3": 2058}
    old = {  # before the per-proposer counters: the drafts that were not windows are the draft model's
        "config": "parse W=128 k4",
        "tokens": 643,
        "acceptance": {"vllm_drafts": 114, "vllm_draft_tokens": 930, "vllm_accepted": 528, "drafts": 4}
        | {"draft_tokens": 495, "tokens_accepted_semantic": 0, "tokens_accepted_token_level": 108},
    }
    c = pj.counters_from_row(old)
    assert c.token_level_drafts == {"draft_model": 110} and c.token_level_draft_tokens == {"draft_model": 435}
    assert c.accepted_in_windows == 108
    eagle_alone = {"config": "eagle3-k3", "tokens": 300, "acceptance": {"vllm_drafts": 100, "vllm_draft_tokens": 300}}
    c = pj.counters_from_row(eagle_alone | {"acceptance": eagle_alone["acceptance"] | {"vllm_accepted": 45}})
    assert c.windows == 0 and c.token_level_drafts == {"eagle3": 100} and c.accepted == 45
    assert pj.counters_from_row({"config": "target", "tokens": 10, "acceptance": None}) is None


def test_projection_of_eval_summaries_sums_sets_and_leaves_out_batches_the_costs_miss():
    row = {"config": "parse W=16", "tau": 0.5, "guard": 0, "tokens": 100}
    acc = {"vllm_drafts": 4, "vllm_draft_tokens": 60, "vllm_accepted": 60, "drafts": 4, "draft_tokens": 60}
    summary = {
        "rows": [
            {**row, "set": "a", "batch": 1, "acceptance": acc},
            {**row, "set": "b", "batch": 1, "acceptance": acc},
            {**row, "set": "a", "batch": 8, "acceptance": acc},
            {"config": "target", "set": "a", "batch": 1, "tokens": 100, "acceptance": None},
        ]
    }
    proj = pj.projection(_costs(), {"run": summary})
    (r,) = proj["rows"]
    assert r["sets"] == ["a", "b"] and r["counters"]["tokens"] == 200 and r["counters"]["windows"] == 8
    (p,) = r["projections"]
    assert (p["target"], p["draft"]) == ("t", "d") and p["speedup"] > 1
    # _costs() has a decode step at batch 8 but no forward there: the batch-8 row is left out, saying why
    assert proj["rows_not_projected"] == [
        "run: parse W=16 τ 0.5 guard 0 at batch 8 "
        "(t: no window or verification forwards measured at batch 8 (measured at batch 1))"
    ]
    md = "\n".join(pj.section(proj, _costs()))
    assert "## Projection on Test GPU" in md and f"| 1 | 200 | 8 | 0.0 | {p['speedup']:.2f} |" in md
    assert "Not projected: run: parse W=16 τ 0.5 guard 0 at batch 8" in md
    assert all(f"- {a}" in md for a in pj.ASSUMPTIONS)


def test_tiny_costs_project_the_committed_eval_runs(tiny_costs):
    summaries = pj.load_summaries(ROOT / p for p in pj.DEFAULT_COUNTERS)
    assert summaries, "the committed eval summaries are missing"
    proj = pj.projection(tiny_costs[1], summaries)
    assert proj["pairs"] == ["tiny-draft → tiny-target"] and proj["rows"]
    for r in proj["rows"]:
        (p,) = r["projections"]
        assert math.isfinite(p["speedup"]) and p["speedup"] > 0, r["config"]
        assert p["batch"] == r["effective_batch"] == min(r["batch"], 41 if r["batch"] > 1 else 1)
    # eval-coder's batch-8 rows (41 prompts) projected at batch 8 on the tiny run's batch-8 forwards
    at8 = [r for r in proj["rows"] if r["batch"] == 8]
    assert {r["config"] for r in at8} == {"token-k4", "token-k8", "parse W=128 k4"}
    assert proj["rows_not_projected"] == []


def test_bench_report_renders_the_projection_section(tiny_costs, tmp_path):
    costs = tmp_path / "gpu_costs.json"
    costs.write_text(json.dumps(tiny_costs[1]))
    out = tmp_path / "BENCHMARKS.md"
    common = ["--results", str(ROOT / "bench" / "full"), "--full-dir", str(tmp_path / "full"), "--out", str(out)]
    common += ["--latency", str(ROOT / "bench" / "latency"), "--eagle3", str(ROOT / "bench" / "eagle3")]
    counters = ["--counters", str(ROOT / "bench" / "eagle3" / "summary.json")]
    counters += [str(ROOT / "bench" / "eval-coder" / "summary.json")]
    assert report.main([*common, "--gpu-costs", str(costs), *counters]) == 0
    text = out.read_text()
    section = text.split("## Projection on")[1]
    assert "| eagle3 | parse W=48 e3 | 1.5 | 0 | 1 |" in section and "Assumptions:" in section
    assert "| eval-coder | parse W=128 k4 | 0.8 | 0 | 8 |" in section  # a batch row, projected at its batch
    assert "| tiny-target | 8 |" in section and "- Batch B > 1 (the row's batch" in section
    assert report.main(common) == 0 and "## Projection on" not in out.read_text()  # only when asked
    with pytest.raises(SystemExit):
        report.main([*common, "--gpu-costs", str(tmp_path / "missing.json")])
