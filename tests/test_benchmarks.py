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
