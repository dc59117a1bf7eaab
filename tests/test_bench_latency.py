"""The latency benchmark (scripts/bench_latency.py) on the tiny models, batch 2: both
servers, every request's timings, and the summary it compares."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_latency.py"


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_latency", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_schedule_is_seeded_and_mixed():
    mod = _module()
    a, b = mod.schedule(32, 0.5, seed=0), mod.schedule(32, 0.5, seed=0)
    assert a == b
    assert a != mod.schedule(32, 0.5, seed=1)
    assert [j["at"] for j in a] == sorted(j["at"] for j in a) and a[0]["at"] == 0
    assert 0 < sum(j["parse"] for j in a) < 32


def test_figures_count_gaps_between_chunks():
    mod = _module()
    results = [
        {"parse": False, "ttft": 0.5, "itl": [0.1, 0.1, 0.3], "e2e": 1.0, "tokens": 4, "sent": 0.0},
        {"parse": True, "ttft": 1.0, "itl": [2.0], "e2e": 3.0, "tokens": 9, "sent": 1.0},
    ]
    s = mod.summarize(results)
    assert s["parse_off"]["itl_p50"] == 0.1 and s["parse_off"]["itl_max"] == 0.3
    assert s["parse_on"]["itl_p99"] == 2.0
    assert s["all"]["tokens"] == 13 and s["throughput_tok_s"] == pytest.approx(13 / 4.0)


def test_a_preset_with_the_heads_tau_serves_it_and_requests_name_none(tmp_path):
    """The Coder preset's τ is `head` (its judge head's τ_head): the server gets it as the
    preset says, and a PARSE-on request names no τ of its own; PARSE-off ones turn PARSE off."""
    mod = _module()
    pair = {**mod.PAIRS["coder"], "models": (tmp_path / "target", tmp_path / "draft")}
    cmd, model = mod.server_argv(pair, 8, 8000, True)
    assert json.loads(cmd[cmd.index("--additional-config") + 1])["parse"]["threshold"] == "head"
    assert model == str(tmp_path / "target") and cmd[cmd.index("--max-num-seqs") + 1] == "8"
    assert mod.request_xargs("parse", {"parse": True}) is None
    assert mod.request_xargs("parse", {"parse": False}) == {"parse": False}
    assert mod.request_xargs("target", {"parse": False}) is None
    plain, _ = mod.server_argv(pair, 8, 8000, False)
    assert "--speculative-config" not in plain and "--additional-config" not in plain


@pytest.mark.slow
def test_the_benchmark_runs_both_servers_and_compares(tiny_models, tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--pairs", "smollm2", "--batches", "2", "--out", str(tmp_path)]
    cmd += ["--models", str(tiny_models["target"]), str(tiny_models["draft"])]
    proc = subprocess.run([*cmd, "--label", "before"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the comparison reads two labelled runs; a second run would only time the same servers again
    shutil.copytree(tmp_path / "before", tmp_path / "after")
    data = json.loads((tmp_path / "before" / "smollm2.json").read_text())
    row = data["batches"]["2"]
    assert [j["idx"] for j in row["schedule"]] == [0, 1, 2, 3]
    for engine in ("parse", "target"):
        for r in row[engine]["requests"]:
            # Equal work: every request streams all its tokens, the count usage reports.
            assert r["tokens"] == r["usage_tokens"] == data["max_tokens"]
            assert r["ttft"] > 0 and len(r["itl"]) >= 1
    assert len(data["parse_bs1"]["requests"]) == min(4, sum(j["parse"] for j in row["schedule"]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--compare", "before", "after"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())["smollm2"]
    assert summary["measured"] == "after"
    assert summary["itl_p99_ratio_parse_off_bs2"] > 0 and summary["parse_e2e_ratio_bs1"] > 0
    assert (tmp_path / "itl.png").stat().st_size > 0
    # BENCHMARKS.md's latency section renders from the same files
    from parse_vllm.tools.benchmarks.report import latency_section

    text = "\n".join(latency_section(tmp_path))
    assert "| smollm2 | 2 |" in text and '"itl_p99_ratio_parse_off_bs2"' in text and "`before`, `after`" in text
