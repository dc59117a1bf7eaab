"""Ray: vLLM's Ray executor on CPU when PARSE is named (the config, then
`parse-vllm serve --distributed-executor-backend ray` under a small load on a
local single-node Ray), and scripts/ray_batch.py — offline PARSE generation
with Ray Data, one engine actor on a local Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BLOCK, WINDOW

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ray_batch.py"
LOAD_SCRIPT = SCRIPT.with_name("load_test.py")


def _config(tiny_models, **extra):
    from vllm.engine.arg_utils import EngineArgs

    kw = dict(
        model=str(tiny_models["target"]),
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=1024,
        distributed_executor_backend="ray",
    )
    kw.update(extra)
    return EngineArgs(**kw).create_engine_config()


def test_ray_backend_becomes_the_parse_cpu_ray_executor(tiny_models):
    from vllm.v1.executor import Executor

    from parse_vllm.worker import ParseCpuRayExecutor

    named = _config(
        tiny_models,
        speculative_config={
            "method": "draft_model",
            "model": str(tiny_models["draft"]),
            "num_speculative_tokens": WINDOW,
        },
        additional_config={"parse": {}},
    )
    assert named.parallel_config.distributed_executor_backend is ParseCpuRayExecutor
    assert named.parallel_config.use_ray
    assert Executor.get_class(named) is ParseCpuRayExecutor
    assert named.parallel_config.worker_cls == "parse_vllm.worker.ParseCPUWorker"
    # Without a parse section vLLM is left as it is (its CPU platform has no Ray).
    plain = _config(tiny_models)
    assert plain.parallel_config.distributed_executor_backend == "ray"


@pytest.mark.slow
def test_serve_on_the_ray_executor(tiny_models, tmp_path):
    """A few concurrent streaming requests to `parse-vllm serve` on Ray: the
    worker in the Ray actor is the PARSE one (scratch blocks held back,
    drafts judged), its RPCs answer through Ray, nothing leaks."""
    out = tmp_path / "load.json"
    cmd = [
        sys.executable,
        str(LOAD_SCRIPT),
        "--clients",
        "4",
        "--requests",
        "8",
        "--warmup",
        "4",
        "--target",
        str(tiny_models["target"]),
        "--draft",
        str(tiny_models["draft"]),
        "--executor",
        "ray",
        "--no-reference",
        "--max-seconds",
        "600",
        "--keep-logs",
        str(tmp_path),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    log = (tmp_path / "parse-server.log").read_text() if (tmp_path / "parse-server.log").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + log[-5000:]
    f = json.loads(out.read_text())
    assert "ParseCpuRayWorkerProc" in log  # the workers are Ray actors
    assert f["errors"] == 0 and f["incomplete"] == 0, (f["error_examples"], f["incomplete_examples"])
    assert f["kv_blocks"]["scratch_blocks"] > 0  # the PARSE runner's verifier, in the actor
    assert f["parse_stats"]["drafts"] > 0 and f["parse_stats"]["copies"] > 0
    assert f["leaked_blocks"] == 0 and f["scratch_blocks_in_request_tables_max"] == 0
    assert f["runner_requests_left"] == 0 and f["parse_request_states_left"] == 0


REQUESTS = [
    {"id": "a", "prompt": "The capital of France is", "max_tokens": 24, "parse_threshold": 1.5},
    {"id": "b", "prompt": "The capital of France is", "max_tokens": 24, "parse": False},
    {
        "id": "c",
        "messages": [{"role": "user", "content": "Write a poem about the sea."}],
        "max_tokens": 32,
        "parse_threshold": 1.5,
    },
    {
        "id": "d",
        "messages": [{"role": "user", "content": "Write a poem about the sea."}],
        "max_tokens": 32,
        "parse": False,
    },
    {"id": "e", "prompt": "Tell me a story about a dragon.", "max_tokens": 40, "parse_threshold": 0.0},
    {"id": "f", "messages": [{"role": "user", "content": "What is 2+2?"}], "parse_threshold": 0.0},
    {"id": "g", "prompt": "a " * 60},
    {"id": "h", "prompt": "x", "max_tokens": 1},
    {"id": "i", "messages": [{"role": "user", "content": "Explain photosynthesis."}], "max_tokens": 16},
]


@pytest.mark.slow
def test_ray_batch_over_jsonl(tiny_models, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    engine = {
        "dtype": "float32",
        "enforce_eager": True,
        "block_size": BLOCK,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 96 << 20,
        "seed": 0,
    }
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--model",
        str(tiny_models["target"]),
        "--draft",
        str(tiny_models["draft"]),
        "--window",
        str(WINDOW),
        "--parse",
        json.dumps({"threshold": 0.5}),
        "--engine",
        json.dumps(engine),
        "--max-tokens",
        "20",
        "--actors",
        "1",
        "--batch-size",
        "4",
        "--num-cpus",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in REQUESTS]  # all, in input order
    by_id = {r["id"]: r for r in rows}
    for req in REQUESTS:
        row = by_id[req["id"]]
        assert 1 <= row["num_tokens"] == len(row["token_ids"]) <= req.get("max_tokens", 20)
        assert row["finish_reason"] in ("stop", "length")
    # Lossless options agree: τ > 1 and PARSE off are both the target's own output.
    assert by_id["a"]["token_ids"] == by_id["b"]["token_ids"]
    assert by_id["c"]["token_ids"] == by_id["d"]["token_ids"]
    summary = json.loads(Path(str(out) + ".stats.json").read_text())
    assert summary["requests"] == len(REQUESTS)
    assert summary["batches"] == 3 and summary["actors"] == 1  # 9 requests, batches of 4
    stats = summary["parse_stats"]
    assert stats["drafts"] > 0 and stats["copies"] > 0
    assert stats["tokens_accepted_semantic"] > 0  # the τ = 0 requests took drafts whole
    assert sum(b["drafts"] for b in summary["per_batch"].values()) == stats["drafts"]


def test_ray_batch_refuses_bad_input_naming_the_line(tmp_path, tiny_models):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "x", "parse_threshold": "high"}) + "\n")
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--input",
        str(inp),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--model",
        str(tiny_models["target"]),
        "--draft",
        str(tiny_models["draft"]),
        "--window",
        "8",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"{inp}:2" in proc.stderr and "parse_threshold" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()  # refused before Ray or any engine started


def test_cpu_ray_worker_threads():
    """The OpenMP threads a CPU worker in a Ray actor sets before it starts
    (vLLM sets them only for the processes of its own executor): a core list
    per local rank pins the worker; "nobind" takes OMP_NUM_THREADS; "auto"
    one thread per CPU of the worker's placement-group bundle (1 without one)."""
    import os
    from types import SimpleNamespace

    import torch

    from parse_vllm._vllm.executor import cpu_worker_threads

    saved_threads, saved_cores = torch.get_num_threads(), os.sched_getaffinity(0)
    core = sorted(saved_cores)[-1]
    no_pg = SimpleNamespace(placement_group=None)
    try:
        assert cpu_worker_threads(1, {"VLLM_CPU_OMP_THREADS_BIND": f"0|{core}"}, no_pg) == (1, [core])
        assert os.sched_getaffinity(0) == {core}
        os.sched_setaffinity(0, saved_cores)
        with pytest.raises(RuntimeError, match="local rank 2"):
            cpu_worker_threads(2, {"VLLM_CPU_OMP_THREADS_BIND": f"0|{core}"}, no_pg)
        assert cpu_worker_threads(0, {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}, no_pg)[0] == 1
        assert cpu_worker_threads(0, {}, no_pg) == (1, None)
    finally:
        os.sched_setaffinity(0, saved_cores)
        torch.set_num_threads(saved_threads)
