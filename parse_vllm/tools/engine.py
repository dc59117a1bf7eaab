"""Running a vLLM ``LLM`` from the lab tools: requests kept in flight, the spec-decode
counters, shutdown. Shared by train_draft (draft acceptance), the benchmarks, eval and the
demo; none of it imports vLLM (each function takes the engine).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["close", "run_batch", "spec_counters"]


def run_batch(llm, prompts: list[list[int]], params_list: list, batch: int) -> dict[str, Any]:
    """Keep ``batch`` requests in flight; per-request latency and tokens."""
    engine = llm.llm_engine
    pending = list(range(len(prompts)))
    started: dict[str, float] = {}
    outputs: dict[int, list[int]] = {}
    latency: dict[int, float] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(started) - len(latency) < batch:
            i = pending.pop(0)
            rid = f"r{i}-{time.monotonic_ns()}"
            engine.add_request(rid, {"prompt_token_ids": prompts[i]}, params_list[i])
            started[rid] = time.perf_counter()
        for out in engine.step():
            if out.finished:
                i = int(out.request_id.split("-")[0][1:])
                outputs[i] = list(out.outputs[0].token_ids)
                latency[i] = time.perf_counter() - started[out.request_id]
    wall = time.perf_counter() - t0
    tokens = sum(len(o) for o in outputs.values())
    lat = sorted(latency.values())
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "outputs": [outputs[i] for i in range(len(prompts))],
        "latency_p50_s": statistics.median(lat),
        "latency_p90_s": lat[min(len(lat) - 1, int(0.9 * len(lat)))],
    }


def spec_counters(llm) -> dict[str, float]:
    """vLLM's spec-decode counters of ``llm`` so far (its Prometheus metrics, summed over
    engines): ``drafts``, ``draft_tokens`` (proposed) and ``accepted``. Needs
    ``disable_log_stats=False``; take the difference of two readings for one run."""
    want = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    got = {v: 0.0 for v in want.values()}
    for m in llm.get_metrics():
        if m.name in want and hasattr(m, "value"):
            got[want[m.name]] += float(m.value)
    return got


def close(llm) -> None:
    """Shut the engine's core down and drop it (best effort), so the next engine gets the memory."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
    del llm
    gc.collect()
