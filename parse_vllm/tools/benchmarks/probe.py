"""Timers inside a running engine, for the benchmarks (scripts/bench_*.py).

Installed into every worker with ``llm.collective_rpc(install, ...)`` (a callable RPC:
needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); they wrap, on the worker's model-runner
*instance* only, three calls and time them:

* ``_model_forward``          -- the target's own forward (prefill, decode, and the scoring
  of draft tokens: "a plain target prefill of the draft");
* the target's ``compute_logits`` outside verification -- its head over the rows the step
  samples from (one per decoding request; one per draft token too when scoring a draft,
  which token-level acceptance needs);
* ``propose_draft_token_ids`` -- the drafter;
* the PARSE verifier's ``judge`` -- the one-pass verification of all copies.

With ``verify_study`` on, each ``judge`` call also measures, on the same copies and the same
KV cache, the K-subsets the verification benchmark compares (parallel: one pass over K
copies; sequential: K passes of one copy each) and the ``_model_forward`` of that step is
repeated to get a stable floor.  Both are safe to repeat: the verifier writes only scratch
blocks, and a repeated forward rewrites the same KV values into the same slots.

Nothing here is used by the engine itself; it exists so the benchmarks time the engine's
own code paths rather than a re-implementation.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np


def _sync(runner) -> None:
    dev = getattr(runner, "device", None)
    if dev is not None and getattr(dev, "type", "cpu") == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def _timed(runner, fn, *args, **kwargs):
    _sync(runner)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(runner)
    return out, time.perf_counter() - t0


def _median_time(runner, reps: int, fn, *args) -> float:
    return statistics.median(_timed(runner, fn, *args)[1] for _ in range(reps))


def _fresh_totals() -> dict[str, Any]:
    return {
        "forward_s": 0.0,
        "forward_calls": 0,
        "forward_tokens": 0,
        "logits_s": 0.0,
        "logits_rows": 0,
        "draft_s": 0.0,
        "draft_calls": 0,
        "verify_s": 0.0,
        "verify_calls": 0,
        "verify_copies": 0,
        "verify_logit_rows": 0,
        "verify_max_logit_rows": 0,
        "studies": [],
    }


def install(worker, verify_study: dict | None = None) -> bool:
    """Wrap the runner's calls with timers (idempotent). ``verify_study``:
    ``{"ks": [1, 4, 8, 16], "reps": 3}`` -- see the module docstring."""
    runner = worker.model_runner
    worker._parse_bench = _fresh_totals()
    worker._parse_bench_study = verify_study
    if getattr(runner, "_parse_bench_installed", False):
        return True
    runner._parse_bench_installed = True
    totals = lambda: worker._parse_bench  # noqa: E731 - reset replaces the dict
    study_cfg = lambda: worker._parse_bench_study  # noqa: E731
    last_forward: dict[str, Any] = {}

    orig_forward = runner._model_forward

    def model_forward(*args, **kwargs):
        from parse_vllm._vllm import get_forward_context

        ctx = get_forward_context()
        out, dt = _timed(runner, orig_forward, *args, **kwargs)
        t = totals()
        t["forward_s"] += dt
        t["forward_calls"] += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[0]) if ids is not None else 0
        t["forward_tokens"] += n
        last_forward.update(args=args, kwargs=kwargs, seconds=dt, tokens=n, context=ctx)
        return out

    runner._model_forward = model_forward

    orig_propose = runner.propose_draft_token_ids

    def propose(*args, **kwargs):
        out, dt = _timed(runner, orig_propose, *args, **kwargs)
        totals()["draft_s"] += dt
        totals()["draft_calls"] += 1
        return out

    runner.propose_draft_token_ids = propose

    model = runner.model
    orig_logits = model.compute_logits  # the verifier's label rows call this one, untimed here

    def timed_logits(hidden, *a, **k):
        out, dt = _timed(runner, orig_logits, hidden, *a, **k)
        totals()["logits_s"] += dt
        totals()["logits_rows"] += int(hidden.shape[0])
        return out

    model.compute_logits = timed_logits

    parse = getattr(runner, "parse", None)
    verifier = getattr(parse, "verifier", None)
    if verifier is None:
        return True
    orig_judge = verifier.judge
    rows_seen: list[int] = []

    def compute_logits(hidden, *a, **k):
        rows_seen.append(int(hidden.shape[0]))
        return orig_logits(hidden, *a, **k)

    def judge(copies):
        cfg = study_cfg()
        if cfg:
            model.compute_logits = orig_logits  # the study's passes are not the step's logits
            try:
                _study(runner, orig_judge, copies, cfg, last_forward, totals())
            finally:
                model.compute_logits = timed_logits
        rows_seen.clear()
        model.compute_logits = compute_logits
        try:
            out, dt = _timed(runner, orig_judge, copies)
        finally:
            model.compute_logits = timed_logits
        t = totals()
        t["verify_s"] += dt
        t["verify_calls"] += 1
        t["verify_copies"] += int(copies.req_row.shape[0])
        t["verify_logit_rows"] += sum(rows_seen)
        t["verify_max_logit_rows"] = max(t["verify_max_logit_rows"], max(rows_seen, default=0))
        return out

    verifier.judge = judge
    return True


def _study(runner, judge, copies, cfg: dict, last_forward: dict, totals: dict) -> None:
    """One request's copies (the first request in the pass): time K-subsets both ways."""
    from parse_vllm.verify import CopyBatch

    reps = int(cfg.get("reps", 3))
    row = copies.req_row[0]
    mine = np.flatnonzero(copies.req_row == row)
    total = len(mine)
    floor = None
    if last_forward:
        from parse_vllm._vllm import override_forward_context

        def again():  # the step's own target forward, in its own attention context
            with override_forward_context(last_forward["context"]):
                return runner.__class__._model_forward(runner, *last_forward["args"], **last_forward["kwargs"])

        floor = _median_time(runner, reps, again)
    seq_len = int(copies.prefix_len[mine].max())
    tokens = runner.input_batch.token_ids_cpu[row, :seq_len].tolist()  # prompt + output + draft
    result = {
        "copies": total,
        "prefix_len": [int(x) for x in copies.prefix_len[mine]],
        "tokens": tokens,
        "suffix_ids": [int(x) for x in runner.parse.template.suffix_ids],
        "picks": {},
        "floor_s": floor,
        "floor_tokens": last_forward.get("tokens"),
        "parallel_s": {},
        "sequential_s": {},
    }
    for k in cfg.get("ks", (1, 4, 8, 16)):
        if k > total:
            continue
        # K evenly spaced boundaries ending at the last (holistic) one
        pick = mine[np.linspace(total - 1, 0, k, endpoint=False).round().astype(int)[::-1]] if k < total else mine
        result["picks"][k] = [int(np.flatnonzero(mine == c)[0]) for c in pick]
        sub = CopyBatch(req_row=copies.req_row[pick], prefix_len=copies.prefix_len[pick])
        result["parallel_s"][k] = _median_time(runner, reps, judge, sub)
        singles = [CopyBatch(req_row=copies.req_row[[c]], prefix_len=copies.prefix_len[[c]]) for c in pick]
        result["sequential_s"][k] = _median_time(runner, reps, lambda: [judge(s) for s in singles])  # noqa: B023 (called in this iteration)
    totals["studies"].append(result)


def read(worker) -> dict:
    return dict(getattr(worker, "_parse_bench", None) or _fresh_totals())


def reset(worker) -> bool:
    worker._parse_bench = _fresh_totals()
    return True


def stop_study(worker) -> bool:
    worker._parse_bench_study = None
    return True


__all__ = ["install", "read", "reset", "stop_study"]
