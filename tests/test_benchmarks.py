"""BENCHMARKS.md is what the scripts made: regenerated from the committed raw results
(bench/full/*.json) it comes out byte for byte the same, so no figure in it was typed by hand;
and the report refuses inputs that would make it lie (missing files, quick runs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parse_vllm.benchmarks import common, report

ROOT = Path(__file__).resolve().parents[1]
FULL = ROOT / "bench" / "full"


def test_benchmarks_md_is_rendered_from_the_committed_results():
    assert (ROOT / "BENCHMARKS.md").read_text() == report.render(FULL, "bench/full")


def test_committed_summary_has_every_required_key():
    summary = json.loads((FULL / "summary.json").read_text())
    missing = [k for k in common.SUMMARY_KEYS if k not in summary]
    assert not missing
    for k in ("verify_over_floor_N256_K8", "verify_token_bound_N256_K8", "sequential_over_parallel_N256_K8",
              "e2e_speedup_bs1", "e2e_speedup_bs16", "draft_token_acceptance_rate"):
        assert isinstance(summary[k], (int, float)), k
    e2e = json.loads((FULL / "e2e.json").read_text())
    # the e2e table covers every configuration the issue names, at both batch sizes
    configs = {(r["config"], r["batch"]) for r in e2e["rows"]}
    for name in ("target", "token-k4", "parse-continue", "parse-redraft"):
        assert {(name, 1), (name, 16)} <= configs, name
    assert {r["tau"] for r in e2e["rows"] if r["config"] == "parse-continue"} >= {0.0, 1.5}


def test_report_refuses_quick_or_missing_results(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    for f in ("verify.json", "e2e.json", "summary.json"):
        shutil.copy2(FULL / f, results / f)
    out = tmp_path / "BENCH.md"
    quick = json.loads((results / "e2e.json").read_text())
    quick["mode"] = "quick"
    (results / "e2e.json").write_text(json.dumps(quick))
    with pytest.raises(SystemExit):
        report.main(["--results", str(results), "--full-dir", str(tmp_path / "full"), "--out", str(out)])
    assert "quick run" in capsys.readouterr().err and not out.exists()
    (results / "verify.json").unlink()
    with pytest.raises(SystemExit):
        report.main(["--results", str(results), "--full-dir", str(tmp_path / "full"), "--out", str(out)])
    assert "missing" in capsys.readouterr().err and not out.exists()


def _row(config, batch, tok_s, outputs, tau=None, forward_s=1.0, draft_s=0.0, verify_s=0.0):
    tokens = sum(len(o) for o in outputs)
    return {"config": config, "batch": batch, "tau": tau, "tok_s": tok_s, "wall_s": tokens / tok_s,
            "outputs": outputs, "forward_s": forward_s, "draft_s": draft_s, "verify_s": verify_s}


def test_e2e_scores_against_the_mean_of_both_baselines_and_flags_drift():
    from parse_vllm.benchmarks import e2e

    ref = [[1, 2, 3, 4]] * 5  # 20 tokens
    rows = [_row("target", 1, 10.0, ref, forward_s=2.0), _row("target-again", 1, 12.0, ref, forward_s=1.6),
            _row("parse-continue", 1, 22.0, [[1, 2, 3, 4]] * 4 + [[9, 9, 9, 9]], tau=0.0,
                 forward_s=0.5, draft_s=0.3, verify_s=0.1),
            _row("parse-continue", 1, 9.0, ref, tau=1.5, forward_s=1.9, draft_s=0.2, verify_s=0.1),
            _row("target", 16, 100.0, ref), _row("target-again", 16, 105.0, ref)]
    bases = {b["batch"]: b for b in e2e.score(rows)}
    assert bases[1]["tok_s"] == pytest.approx(11.0) and bases[1]["drift"] == pytest.approx(0.2)
    assert bases[1]["drift_flagged"] and not bases[16]["drift_flagged"]
    assert rows[0]["speedup"] == pytest.approx(10 / 11) and rows[1]["speedup"] == pytest.approx(12 / 11)
    assert rows[2]["speedup"] == pytest.approx(2.0)
    assert rows[1]["exact"] == 1.0 and rows[2]["exact"] == pytest.approx(0.8)
    assert rows[2]["rouge_l"] == pytest.approx(0.8)
    br = {b["batch"]: b for b in e2e.bracket(rows, list(bases.values()))}
    wall = (2.0 + 20 / 12) / 2  # mean of the two baselines' wall time
    assert br[1]["accept_all_speedup"] == pytest.approx(wall / (20 / 22))
    assert br[1]["accept_all_ideal_speedup"] == pytest.approx(wall / 0.9)
    assert br[1]["reject_all_overhead_s"] == pytest.approx(20 / 9 - wall)
    assert br[1]["reject_all_ideal_overhead_s"] == pytest.approx(0.3 + (1.9 - 1.8))
    assert "accept_all_speedup" not in br[16]
    # the report says so, loudly, when the baseline drifted
    text = "\n".join(report._baselines(list(bases.values())))
    assert "drift +20.0%" in text and "Warning" in text and "batch size 1:" in text
    assert "Warning" not in "\n".join(report._baselines([bases[16]]))


def test_e2e_scores_a_run_that_timed_the_baseline_once():
    from parse_vllm.benchmarks import e2e

    ref = [[1, 2, 3]]
    rows = [_row("target", 1, 10.0, ref), _row("token-k4", 1, 15.0, ref)]
    (base,) = e2e.score(rows)
    assert base["drift"] is None and not base["drift_flagged"] and rows[1]["speedup"] == pytest.approx(1.5)
    assert "timed once" in report._baselines(None)[0]
