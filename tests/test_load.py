"""The load test (scripts/load_test.py), small: 16 concurrent streaming
clients, 48 mixed requests against `parse-vllm serve` with PARSE on the tiny
models, then the target alone (a stock vLLM server) for the lossless ones.
The full 32 x 500 run is in docs/load-test.md; the same script on the
Ray executor is in test_ray.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "load_test.py"


@pytest.fixture(scope="module")
def figures(tiny_models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("load") / "load.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--clients",
        "16",
        "--requests",
        "48",
        "--target",
        str(tiny_models["target"]),
        "--draft",
        str(tiny_models["draft"]),
        "--max-seconds",
        "600",
        "--request-timeout",
        "300",
        "--keep-logs",
        str(out.parent),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(out.parent.glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    return json.loads(out.read_text())


def test_every_request_completes_without_errors(figures):
    assert figures["requests"] == 48
    assert figures["errors"] == 0, figures["error_examples"]
    assert figures["incomplete"] == 0, figures["incomplete_examples"]
    assert figures["completion_tokens"] > 48


def test_lossless_requests_equal_the_target_alone(figures):
    assert figures["reference"].startswith("target-alone")
    assert figures["reference_failures"] == 0
    assert figures["lossless_requests_compared"] >= 20  # 20 of the 48 (make_jobs, seed 0)
    assert figures["mismatches_vs_target"] == 0, figures["mismatch_examples"]


def test_no_kv_or_scratch_block_leaked(figures):
    # The worker scanned its block tables after every step of the load, and
    # the load did hold blocks; the scheduler's usage figure, read while one
    # request ran alone, does see them (so the checks are not vacuous) ...
    watch = {
        k: figures[k]
        for k in (
            "wall_s",
            "audited_steps",
            "audit_batch_requests_max",
            "kv_cache_usage_busy_reads",
            "rpc_polls",
            "rpc_polls_with_requests",
            "poll_seconds_max",
            "poll_error_count",
            "poll_errors",
        )
    }
    assert figures["audited_steps"] > 0, watch
    assert figures["audit_batch_requests_max"] > 1, watch  # requests ran concurrently
    assert figures["request_blocks_held_max_during"] > 0, watch
    assert figures["kv_cache_usage_busy"] > 0, watch
    # ... and the idle server holds none, on either side.
    assert figures["leaked_blocks"] == 0
    assert figures["leaked_blocks_scheduler"] == 0 and figures["leaked_blocks_worker"] == 0
    assert figures["scratch_blocks_in_request_tables_max"] == 0
    assert figures["runner_requests_left"] == 0 and figures["parse_request_states_left"] == 0


def test_parse_worker_and_its_rpcs(figures):
    blocks = figures["kv_blocks"]
    assert blocks["scratch_blocks"] > 0  # the PARSE runner set up its verifier
    assert blocks["scheduler_blocks"] == blocks["num_blocks"] - blocks["scratch_blocks"]
    stats = figures["parse_stats"]  # the parse_stats RPC
    assert stats["drafts"] > 0 and stats["copies"] > 0
    assert figures["parse_drafts_total_metric"] == stats["drafts"]


def test_memory_flat(figures):
    # Measured after a warm-up at the largest shapes; a per-request leak
    # would grow with the 48 requests served (docs/load-test.md has the numbers).
    assert figures["rss_growth_mb"] is not None
    assert figures["rss_growth_second_half_mb"] < 64, figures["rss_samples_mb"]
