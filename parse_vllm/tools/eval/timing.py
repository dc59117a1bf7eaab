"""How `parse-vllm eval` times configurations and compares them (no vLLM here).

* **The schedule.** Every configuration (an engine's settings with one τ and guard) runs
  every task list ``repeats`` times, interleaved: repeat 1 of every configuration, then
  repeat 2 of every configuration in the same order, ... (ABAB). A configuration's repeats
  therefore sit at different times of the run, between the other configurations', and a
  slow spell of the machine spreads over all of them instead of landing on one.
* **The same start.** Every timed job starts from the same state: a process of its own
  (run.py starts one per job: a long-lived process slows down as it ages, see
  docs/benchmarks.md), a fresh engine, the same warm-up request, then an emptied prefix
  cache (``LLM.reset_prefix_cache()``), so no job finds another's prompts cached. With
  ``--same-process`` every configuration gets a fresh engine per repeat instead (an
  ``adaptive`` PARSE engine one per job, since its window policy learns from every request
  it sees and a cache reset does not clear that).
* **Time per task.** The main speed figure is wall time per task over the same task list
  (tok/s is secondary: a configuration that writes longer answers gets more tok/s for the
  same work). ``task_s`` of a job: the wall time cut at every engine step, each stretch
  divided evenly among the requests in flight (:func:`parse_vllm.tools.engine.run_batch`);
  they add up to the job's wall time, and at batch 1 a task's share is its whole request. A
  row's per-task time is the median over its repeats, task by task; ``s_per_task`` is
  their mean.
* **Ratios with an interval.** A speed ratio is the reference's mean time per task over
  the row's (> 1: faster than the reference), on the same tasks; its 95% interval is a
  paired percentile bootstrap over tasks (``scipy.stats.bootstrap``, :data:`RESAMPLES`
  resamples, seed 0). A ratio whose interval holds 1.0 is "no difference".
* **The noise floor.** The target alone measured twice: repeat 2's time per task against
  repeat 1's (the same ratio and interval), and the spread of its repeats. Ratios within it
  are not resolved by the run.
* **One machine, one boot.** Times from two machines (or from before and after a reboot)
  are not side by side: a saved run records the machine
  (:func:`parse_vllm.tools.benchmarks.common.machine_identity`) and resumes only on it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

RESAMPLES = 9999
CONFIDENCE = 0.95
MIN_BS1_TASKS = 12  # batch-1 rows on fewer tasks claim nothing
FASTER, SLOWER, SAME = "faster", "slower", "no difference"
TOO_FEW = "too few tasks"


def schedule(configs: Sequence[str], repeats: int) -> list[tuple[str, int]]:
    """(configuration, repeat) in the order they run: every configuration's repeat r before
    any repeat r + 1, the configurations in the same order each time (ABAB)."""
    return [(c, r) for r in range(repeats) for c in configs]


def per_task(repeats: Sequence[Sequence[float]]) -> list[float]:
    """Per-task times of several repeats of one task list -> the median of each task's."""
    if not repeats:
        raise ValueError("no repeats")
    n = len(repeats[0])
    if any(len(r) != n for r in repeats):
        raise ValueError("repeats of one row ran different numbers of tasks")
    return [statistics.median(r[i] for r in repeats) for i in range(n)]


def spread(values: Sequence[float]) -> float | None:
    """(max - min) / median of a figure's repeats (0: identical; None without two)."""
    if len(values) < 2:
        return None
    m = statistics.median(values)
    return (max(values) - min(values)) / m if m else None


def _bootstrap(data: tuple, statistic) -> list[float] | None:
    from scipy.stats import bootstrap

    n = len(data[0])
    if n < 2:
        return None
    arrays = tuple(np.asarray(d, dtype=np.float64) for d in data)
    if all(np.all(a == a[0]) for a in arrays):  # nothing to resample: the interval is the point
        v = float(statistic(*arrays, axis=-1))
        return [v, v]
    res = bootstrap(
        arrays,
        statistic,
        paired=True,
        vectorized=True,
        n_resamples=RESAMPLES,
        confidence_level=CONFIDENCE,
        method="percentile",
        rng=np.random.default_rng(0),
    )
    return [float(res.confidence_interval.low), float(res.confidence_interval.high)]


def _ratio_of_means(ref, x, axis=-1):
    return np.mean(ref, axis=axis) / np.mean(x, axis=axis)


def speed_ratio(ref_task_s: Sequence[float], task_s: Sequence[float]) -> float | None:
    """The reference's mean time per task over this one's, on the same tasks (> 1: faster)."""
    if len(ref_task_s) != len(task_s) or len(task_s) == 0:
        raise ValueError("a speed ratio compares the same task list")
    den = sum(task_s)
    return sum(ref_task_s) / den if den > 0 else None


def speed_ratio_ci(ref_task_s: Sequence[float], task_s: Sequence[float]) -> list[float] | None:
    """95% interval of :func:`speed_ratio`, resampling tasks (pairs kept together)."""
    if len(ref_task_s) != len(task_s):
        raise ValueError("a speed ratio compares the same task list")
    return _bootstrap((ref_task_s, task_s), _ratio_of_means)


def mean_ci(values: Sequence[float]) -> list[float] | None:
    """95% interval of a mean, resampling tasks."""
    return _bootstrap((values,), lambda v, axis=-1: np.mean(v, axis=axis))


def tok_s_ci(tokens: Sequence[float], task_s: Sequence[float]) -> list[float] | None:
    """95% interval of tokens / seconds over the tasks, resampling tasks."""
    return _bootstrap((tokens, task_s), lambda t, s, axis=-1: np.sum(t, axis=axis) / np.sum(s, axis=axis))


def verdict(ci: Sequence[float] | None, few: bool = False) -> str | None:
    """What a speed ratio's interval supports: faster, slower, or no difference (it holds 1.0)."""
    if few:
        return TOO_FEW
    if ci is None:
        return None
    lo, hi = ci
    return FASTER if lo > 1.0 else SLOWER if hi < 1.0 else SAME


def describe_ratio(ratio: float | None, ci: Sequence[float] | None, few: bool = False) -> str:
    """ "1.23x [1.10, 1.35]", or "no difference (1.02x [0.95, 1.09])"."""
    if ratio is None:
        return "—"
    text = f"{ratio:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
    v = verdict(ci, few)
    if v == SAME:
        return f"no difference ({text})"
    if v == TOO_FEW:
        return f"{text}, {TOO_FEW} to claim"
    return text


def noise_floor(repeat_task_s: Sequence[Sequence[float]]) -> dict:
    """The same configuration measured twice or more (the target alone): repeat 2's time per
    task against repeat 1's, with its interval, and the spread of all repeats' mean time per
    task. A configuration's ratio to the target within this is not resolved."""
    means = [statistics.fmean(r) for r in repeat_task_s]
    out = {"s_per_task_repeats": means, "spread": spread(means), "self_ratio": None, "self_ratio_ci": None}
    if len(repeat_task_s) >= 2:
        first, second = repeat_task_s[0], repeat_task_s[1]
        out["self_ratio"] = speed_ratio(first, second)
        out["self_ratio_ci"] = speed_ratio_ci(first, second)
    return out
