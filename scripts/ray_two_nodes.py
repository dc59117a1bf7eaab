"""The multi-node shape on one machine: a local Ray cluster of two nodes (a
head and a second node, one CPU each: ray.cluster_utils.Cluster starts the
nodes `ray start` would, as processes of this script), PARSE with tensor
parallelism 2 on vLLM's Ray executor placed across them (one placement-group
bundle of one CPU per node, so one rank per node; the rank on the second
node talks to the engine over TCP as on a real second machine), then
scripts/ray_batch.py (Ray Data) over a small JSONL through the same cluster.
Shuts the cluster down whatever happens (its own processes only: `ray stop`
would end every Ray process on the machine).

    python scripts/ray_two_nodes.py --target TARGET --draft DRAFT --window 16 [--out result.json]

Checks: the engine's two placement-group bundles (a worker each) are on two
Ray nodes; greedy requests at τ = 0.5 with the strictest token guard
(parse_guard 1) give exactly the tokens of PARSE-off requests (the target's
greedy output, token-level speculation only); τ = 0 drafts are taken whole; no KV block is held
afterwards on either rank; ray_batch.py writes every request's row.
On real machines the same runs with `ray start --head` on one and
`ray start --address HEAD:PORT` on the others, then RAY_ADDRESS=HEAD:PORT."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Hello there, how are you?",
    "Write a poem about the sea.",
    "What is 2+2?",
    "Tell me a story about a dragon who learns to fly over the mountains at night.",
    "The capital of France is",
]


def engine_run(args, address: str) -> dict:
    """In this process: the PARSE TP 2 engine on the cluster."""
    import ray
    from vllm import LLM, SamplingParams

    import parse_vllm

    llm = LLM(
        model=args.target,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=1024,
        kv_cache_memory_bytes=96 << 20,
        seed=0,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        disable_log_stats=False,
        speculative_config={"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.window},
        additional_config={"parse": {"audit_kv_blocks": True}},
    )
    greedy = dict(max_tokens=48, temperature=0.0)
    t = time.time()
    guarded = llm.generate(PROMPTS, SamplingParams(**greedy, extra_args={"parse_threshold": 0.5, "parse_guard": 1}))
    seconds = time.time() - t
    off = llm.generate(PROMPTS, SamplingParams(**greedy, extra_args={"parse": False}))
    parse_vllm.reset_stats(llm)
    llm.generate(PROMPTS, SamplingParams(**greedy, extra_args={"parse_threshold": 0.0}))
    stats = parse_vllm.get_stats(llm)
    blocks = llm.collective_rpc("parse_kv_blocks")
    ray.init(address=address, ignore_reinit_error=True)
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    # Each worker runs in its bundle of the engine's placement group.
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    worker_nodes = [n for g in groups for _, n in sorted(g["bundles_to_node_id"].items())]
    tokens = [list(o.outputs[0].token_ids) for o in guarded]
    result = {
        "nodes": len(nodes),
        "worker_nodes": [sorted(k for k in nodes[n] if k.startswith("parse_node_")) for n in worker_nodes],
        "guard1_equals_parse_off": tokens == [list(o.outputs[0].token_ids) for o in off],
        "guard1_tokens": tokens,
        "guard1_tokens_per_s": round(sum(map(len, tokens)) / seconds, 1),
        "tau0_stats": stats,
        "ranks_request_blocks_held": [b["request_blocks_held"] for b in blocks],
        "ranks_scratch_in_request_tables_max": [b["audit"]["scratch_blocks_in_request_tables_max"] for b in blocks],
    }
    llm.llm_engine.engine_core.shutdown()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_only:
        print("ENGINE " + json.dumps(engine_run(args, os.environ["RAY_ADDRESS"])), flush=True)
        return 0

    from ray.cluster_utils import Cluster

    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env = {**os.environ}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    result: dict = {}
    t0 = time.time()
    # Two Ray nodes (a head and a second node, as `ray start --head` and
    # `ray start --address` make them); shutdown() ends exactly their processes.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"parse_node_head": 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=1, resources={"parse_node_second": 1})
        cluster.wait_for_nodes()
        address = env["RAY_ADDRESS"] = cluster.address
        proc = subprocess.run(
            [sys.executable, __file__, "--engine-only", "--target", args.target, "--draft", args.draft]
            + ["--window", str(args.window)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("ENGINE ")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-3000:] + proc.stderr[-6000:], file=sys.stderr)
            return 1
        result["engine"] = json.loads(lines[-1][len("ENGINE ") :])
        with tempfile.TemporaryDirectory() as tmp:
            inp, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
            reqs = [
                {"id": str(i), "prompt": p, "parse_threshold": [0.0, 0.5, 1.5][i % 3]} for i, p in enumerate(PROMPTS)
            ]
            inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
            engine = {
                "dtype": "float32",
                "enforce_eager": True,
                "block_size": 32,
                "max_model_len": 1024,
                "kv_cache_memory_bytes": 96 << 20,
                "seed": 0,
                "tensor_parallel_size": 2,
                "distributed_executor_backend": "ray",
            }
            cmd = [sys.executable, str(ROOT / "scripts" / "ray_batch.py"), "--input", str(inp), "--output", str(out)]
            cmd += ["--model", args.target, "--draft", args.draft, "--window", str(args.window)]
            cmd += ["--engine", json.dumps(engine), "--max-tokens", "24", "--batch-size", "8"]
            cmd += ["--ray-address", address, "--cpus-per-actor", "0"]
            t = time.time()
            batch = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if batch.returncode != 0:
                print(batch.stdout[-3000:] + batch.stderr[-6000:], file=sys.stderr)
                return 1
            rows = [json.loads(line) for line in out.read_text().splitlines()]
            result["ray_batch"] = {
                "rows": len(rows),
                "ids_in_order": [r["id"] for r in rows] == [r["id"] for r in reqs],
                "seconds": round(time.time() - t, 1),
                "stats": json.loads(Path(str(out) + ".stats.json").read_text())["parse_stats"],
            }
    finally:
        cluster.shutdown()
    result["seconds"] = round(time.time() - t0, 1)
    e = result["engine"]
    ok = (
        e["nodes"] == 2
        and len({tuple(n) for n in e["worker_nodes"]}) == 2
        and e["guard1_equals_parse_off"]
        and e["tau0_stats"]["tokens_accepted_semantic"] > 0
        and e["ranks_request_blocks_held"] == [0, 0]
        and e["ranks_scratch_in_request_tables_max"] == [0, 0]
        and result["ray_batch"]["rows"] == len(PROMPTS)
        and result["ray_batch"]["ids_in_order"]
    )
    result["ok"] = ok
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
