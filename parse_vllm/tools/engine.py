"""Running a vLLM ``LLM`` from the lab tools: requests kept in flight, the spec-decode
counters, shutdown. Shared by train_draft (draft acceptance), the benchmarks, eval and the
demo; none of it imports vLLM (each function takes the engine).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["SpeedProbe", "close", "prefix_cache_counters", "reset_prefix_cache", "run_batch", "spec_counters"]


class SpeedProbe:
    """How fast the machine is right now: a fixed piece of work shaped like a decode step's
    (5 rows through a 1536 x 8960 float32 weight, twice: 110 MB read, as a forward's layers
    read theirs, and a 512 x 512 product), timed. On a shared 2-core VM the same engine step
    takes 170 ms in one minute and 235 ms in the next (other tenants); this probe's time
    follows a forward-like workload's with correlation 0.93, so a step's seconds over the
    probe's (its "probe units") compare jobs that ran minutes apart (docs/benchmarks.md).

    A call returns the reading: the median of the last `keep` probes, probing again only
    when `interval_s` has passed since the last (about 17 ms a probe here; a probe every
    step would add that to every step the adaptive policy times, and one preempted probe
    would skew its step's units). A CPU's speed: on a GPU the probe says nothing of it."""

    ROWS, DIM, HIDDEN = 5, 1536, 8960

    def __init__(self, interval_s: float = 1.0, keep: int = 3, clock=time.perf_counter):
        import torch

        gen = torch.Generator().manual_seed(0)
        self._x = torch.randn(self.ROWS, self.DIM, generator=gen)
        self._w = torch.randn(self.DIM, self.HIDDEN, generator=gen)
        self._c = torch.randn(512, 512, generator=gen)
        self.interval_s, self.keep, self.clock = interval_s, keep, clock
        self.probe()  # first touch of the weight, outside any reading
        self._last: list[float] = []
        self._at = None  # when the last probe ran

    def probe(self) -> float:
        """One probe's seconds."""
        t = self.clock()
        self._x @ self._w
        self._x @ self._w
        self._c @ self._c
        return self.clock() - t

    def __call__(self) -> float:
        now = self.clock()
        if self._at is None or now - self._at >= self.interval_s:
            self._last = (self._last + [self.probe()])[-self.keep :]
            self._at = now
        return statistics.median(self._last)


def run_batch(
    llm, prompts: list[list[int]], params_list: list, batch: int, clock=time.perf_counter, probe=None
) -> dict[str, Any]:
    """Keep ``batch`` requests in flight; per-request latency and tokens, and each request's
    share of the wall time (``task_s``).

    ``task_s[i]``: the wall time is cut at every engine step, and each stretch (the step and
    the requests added before it) is divided evenly among the requests in flight during it --
    those added and not finished before the step. So the shares add up to ``wall_s``, a task
    that stays in flight longer (more tokens, slower acceptance) gets more of it, and at
    batch 1 a task's share is its whole request (adding it, then its steps). ``latency_s[i]``:
    from the request's arrival to its last token (at batch > 1 these overlap and add up to
    more than the wall).

    ``probe`` (a :class:`SpeedProbe`, or any callable returning the machine's current
    reading in seconds): called before every step, the time it takes taken out of the
    stretches (and of the latencies); each stretch is also counted in probe units (its
    seconds over the reading), shared out as ``task_s`` is: ``task_probe``, which a slower
    spell of the machine does not inflate. ``probe_s``: the readings' median."""
    engine = llm.llm_engine
    pending = list(range(len(prompts)))
    started: dict[str, float] = {}
    outputs: dict[int, list[int]] = {}
    latency: dict[int, float] = {}
    share = [0.0] * len(prompts)
    units = [0.0] * len(prompts)  # the shares in probe units
    probes: list[float] = []
    probed = 0.0  # seconds spent probing so far (no task's, no request's)
    live: dict[str, int] = {}  # request id -> task, added and not finished
    ids: dict[int, str] = {}  # task -> its request id
    t0 = last = clock()
    while pending or engine.has_unfinished_requests():
        while pending and len(live) < batch:
            i = pending.pop(0)
            rid = f"r{i}-{time.monotonic_ns()}"
            engine.add_request(rid, {"prompt_token_ids": prompts[i]}, params_list[i])
            started[rid] = clock() - probed
            live[rid], ids[i] = i, rid
        if probe is not None:
            t = clock()
            probes.append(probe())
            d = clock() - t  # the probe is no task's time
            last, probed = last + d, probed + d
        outs = engine.step()
        now = clock()
        if live:
            part = (now - last) / len(live)
            for i in live.values():
                share[i] += part
                if probe is not None:
                    units[i] += part / max(probes[-1], 1e-9)
        last = now
        for out in outs:
            if out.finished:
                i = live.pop(out.request_id, None)
                if i is None:
                    i = int(out.request_id.split("-")[0][1:])
                outputs[i] = list(out.outputs[0].token_ids)
                latency[i] = now - probed - started[out.request_id]
    wall = last - t0 - probed
    tokens = sum(len(o) for o in outputs.values())
    lat = sorted(latency.values())
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "outputs": [outputs[i] for i in range(len(prompts))],
        "request_ids": [ids[i] for i in range(len(prompts))],
        "task_s": share,
        "latency_s": [latency[i] for i in range(len(prompts))],
        "latency_p50_s": statistics.median(lat),
        "latency_p90_s": lat[min(len(lat) - 1, int(0.9 * len(lat)))],
        "task_probe": units if probe is not None else None,
        "probe_s": statistics.median(probes) if probes else None,
    }


def prefix_cache_counters(llm) -> dict[str, float]:
    """vLLM's prefix-cache counters so far (its Prometheus metrics): ``queries`` and ``hits``,
    in tokens. Needs ``disable_log_stats=False``; take the difference of two readings."""
    want = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}
    got = {v: 0.0 for v in want.values()}
    for m in llm.get_metrics():
        if m.name in want and hasattr(m, "value"):
            got[want[m.name]] += float(m.value)
    return got


def reset_prefix_cache(llm, tries: int = 3) -> None:
    """Empty vLLM's prefix cache (``LLM.reset_prefix_cache``), so the next requests find none
    of the earlier ones' KV. Refused while blocks are held: a request's last engine step may
    still have to run (an idle step frees them), hence a few tries; raises if it never works."""
    for _ in range(tries):
        if llm.reset_prefix_cache():
            return
        llm.llm_engine.step()
    raise RuntimeError("the engine's prefix cache could not be reset: KV blocks are still held by requests")


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
    """Shut the engine's core down and drop it (best effort), so the next engine gets the memory.
    What survives is frozen (gc.freeze): the next engine's start runs five full collections
    (vLLM's, around each model's loading and before its own freeze), each about 0.4 s over an
    unfrozen heap of torch, vLLM and transformers; frozen, they skip it. EngineCore.shutdown
    unfreezes before it collects, so no engine's memory is kept."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
    del llm
    gc.collect()
    gc.freeze()
