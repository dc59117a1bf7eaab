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
* **Ratios with an interval that holds the repeats.** A speed ratio is the reference's mean
  time per task over the row's (> 1: faster than the reference), on the same tasks, pooled
  over the repeats (:func:`speed_figures`). Each repeat's own ratio (repeat r of the
  reference against repeat r of the row: they ran in the same stretch of the ABAB schedule)
  is reported beside it, because two repeats can differ by more than the tasks do (a slow
  spell of the machine lands on one job). Its 95% interval resamples both: repeats and
  tasks drawn independently with replacement, pairs kept together (repeats and tasks are
  crossed, every task runs in every repeat), :data:`RESAMPLES` resamples, seed 0. With one
  repeat it is the paired bootstrap over tasks. A ratio is "faster" or "slower" only where
  its interval excludes 1.0 *and* every repeat's ratio lies on that side; otherwise it is
  "no difference".
* **Probe units: the machine's speed taken out.** This VM's speed changes by a third from
  one minute to the next (other tenants: the same 5-token forward takes 170 ms, then 235
  ms), in spells longer than a step and shorter than a job, so two jobs minutes apart, or
  two repeats of one, differ by up to 18% for the same work. A fixed probe
  (:class:`parse_vllm.tools.engine.SpeedProbe`, 17 ms here, run at most once a second) is
  read before every engine step, outside the timed stretches, and each stretch is also
  counted in probe units (its seconds over the reading, the median of the last three
  probes): ``task_probe``. Only where the engine runs on this CPU in the eval's process. The same figures (ratio, repeats, interval, verdict)
  are computed from them beside the seconds' (``row_repeats(row, probe=True)``): the
  seconds say what a user waits, the probe units which configuration does less work.
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


def _by_repeat(repeats: Sequence[Sequence[float]]) -> np.ndarray:
    """[R, T] from R repeats of one task list (a flat list of T times: one repeat)."""
    a = np.asarray(repeats, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError("repeats of one task list: a list of per-task time lists, the same length each")
    return a


def crossed_bootstrap(ref: np.ndarray, x: np.ndarray, n: int = RESAMPLES, seed: int = 0) -> list[float] | None:
    """95% percentile interval of Σ ref / Σ x over [R, T] arrays whose rows are repeats and
    columns tasks, resampling repeats and tasks independently with replacement (a repeat
    drawn twice counts twice; ref and x share every draw). Each resample weighs cell (r, t)
    by (times repeat r was drawn) x (times task t was drawn), so its sums are
    einsum('br,bt,rt->b'). None with fewer than two tasks."""
    R, T = ref.shape
    if T < 2:
        return None
    point = float(ref.sum() / x.sum())
    if np.allclose(ref * x.sum(), x * ref.sum(), rtol=1e-12, atol=0.0):
        return [point, point]  # every cell has the pooled ratio: no draw moves it
    rng = np.random.default_rng(seed)
    w_rep = rng.multinomial(R, np.full(R, 1.0 / R), size=n).astype(np.float64)  # [n, R]
    w_task = rng.multinomial(T, np.full(T, 1.0 / T), size=n).astype(np.float64)  # [n, T]
    vals = np.einsum("br,bt,rt->b", w_rep, w_task, ref) / np.einsum("br,bt,rt->b", w_rep, w_task, x)
    lo, hi = np.percentile(vals, [100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2])
    return [float(lo), float(hi)]


def speed_figures(
    ref_repeats: Sequence[Sequence[float]], repeats: Sequence[Sequence[float]], few: bool = False
) -> dict:
    """A speed ratio from per-task times by repeat ([R][T] each, repeat r of one against
    repeat r of the other; a flat [T] list is one repeat): ``ratio``, the reference's time
    per task over the row's pooled over every repeat and task; ``by_repeat``, each repeat's
    own ratio; ``ci``, its 95% interval resampling repeats and tasks
    (:func:`crossed_bootstrap`); ``verdict`` (:func:`verdict`: a direction only where every
    repeat agrees).

    Worked example, 2 repeats of 2 tasks, the reference at 2 s a task throughout, the row at
    1 s in repeat 1 and 4 s in repeat 2: ratio 8 / 10 = 0.8x, by repeat 2.0x and 0.5x; the
    repeats disagree, so whatever the interval the verdict is "no difference"."""
    ref, x = _by_repeat(ref_repeats), _by_repeat(repeats)
    if ref.shape != x.shape or x.shape[1] == 0:
        raise ValueError(
            f"a speed ratio compares the same task list in the same repeats: {ref.shape} against {x.shape}"
        )
    total = float(x.sum())
    ratio = float(ref.sum()) / total if total > 0 else None
    by_repeat = [float(a.sum() / b.sum()) if b.sum() > 0 else None for a, b in zip(ref, x)]
    ci = crossed_bootstrap(ref, x) if ratio is not None else None
    return {"ratio": ratio, "ci": ci, "by_repeat": by_repeat, "verdict": verdict(ci, few, by_repeat)}


def row_repeats(row: dict, probe: bool = False) -> list[list[float]] | None:
    """A summary row's per-task times by repeat: ``task_s_repeats`` where the run saved them,
    else its per-task medians as one repeat (a row written before they were saved: its
    interval then leaves the repeats' spread out). probe: the same in probe units
    (``task_probe_repeats``), None where the run did not probe."""
    if probe:
        return row.get("task_probe_repeats")
    return row.get("task_s_repeats") or [row["task_s"]]


def mean_ci(values: Sequence[float]) -> list[float] | None:
    """95% interval of a mean, resampling tasks."""
    return _bootstrap((values,), lambda v, axis=-1: np.mean(v, axis=axis))


def tok_s_ci(tokens: Sequence[float], task_s: Sequence[float]) -> list[float] | None:
    """95% interval of tokens / seconds over the tasks, resampling tasks."""
    return _bootstrap((tokens, task_s), lambda t, s, axis=-1: np.sum(t, axis=axis) / np.sum(s, axis=axis))


def verdict(
    ci: Sequence[float] | None, few: bool = False, by_repeat: Sequence[float | None] | None = None
) -> str | None:
    """What a speed ratio supports: faster or slower where its interval excludes 1.0 and each
    repeat's ratio (`by_repeat`, where given) lies on the same side; else no difference."""
    if few:
        return TOO_FEW
    if ci is None:
        return None
    lo, hi = ci
    v = FASTER if lo > 1.0 else SLOWER if hi < 1.0 else SAME
    if by_repeat and v != SAME:
        agree = all(b is not None and (b > 1.0 if v == FASTER else b < 1.0) for b in by_repeat)
        v = v if agree else SAME
    return v


def describe_ratio(
    ratio: float | None,
    ci: Sequence[float] | None,
    few: bool = False,
    by_repeat: Sequence[float | None] | None = None,
) -> str:
    """ "1.23x [1.10, 1.35]", "no difference (1.02x [0.95, 1.09])", and with two or more
    repeats each one's ratio after the interval: "1.23x [1.10, 1.35]; repeats 1.18x / 1.29x"."""
    if ratio is None:
        return "—"
    text = f"{ratio:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
    if by_repeat and len(by_repeat) > 1:
        text += "; repeats " + " / ".join("—" if b is None else f"{b:.2f}x" for b in by_repeat)
    v = verdict(ci, few, by_repeat)
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


def probe_noise_floor(repeat_task_probe: Sequence[Sequence[float] | None]) -> dict:
    """The noise floor in probe units (``noise_floor`` over ``task_probe``), its keys prefixed
    ``probe_``; empty where some repeat was not probed."""
    if len(repeat_task_probe) < 2 or any(not r for r in repeat_task_probe):
        return {}
    return {f"probe_{k}": v for k, v in noise_floor(repeat_task_probe).items()}


def repeats_in_timings(path, field: str = "task_s") -> dict[tuple, list[list[float]]]:
    """A run's per-task times by repeat from its timings.jsonl (one job a line after the
    settings line), by (set, config, τ, guard, batch), repeats in order; `field` "task_probe"
    gives them in probe units (None for a job that was not probed)."""
    import json
    from pathlib import Path

    jobs: dict[tuple, dict[int, list[float]]] = {}
    for line in Path(path).read_text().splitlines()[1:]:
        try:
            job = json.loads(line)
        except json.JSONDecodeError:  # a line a kill cut short (its job ran again)
            continue
        key = (job["set"], job["config"], job["tau"], job["guard"], job["batch"])
        jobs.setdefault(key, {})[job["repeat"]] = job.get(field)
    return {k: [v[r] for r in sorted(v)] for k, v in jobs.items()}


def with_repeats(rows: list[dict], timings_path) -> None:
    """Give summary rows saved without ``task_s_repeats`` theirs from the run's timings.jsonl
    (in place), checked: each task's median over the repeats must be the row's ``task_s``
    (else those timings are another run's). Rows without a timed job there are left as they are."""
    import os

    if not os.path.exists(timings_path):
        return
    saved = repeats_in_timings(timings_path)
    for r in rows:
        if r.get("task_s_repeats") or r.get("task_s") is None:
            continue
        reps = saved.get((r["set"], r["config"], r.get("tau"), r.get("guard"), r["batch"]))
        if reps is None:
            continue
        if not np.allclose(per_task(reps), r["task_s"], rtol=1e-9, atol=1e-12):
            raise ValueError(
                f"{timings_path}: the repeats of {r['config']} bs {r['batch']} τ {r.get('tau')} on {r['set']} "
                "do not give the summary's per-task times: they are another run's"
            )
        r["task_s_repeats"] = reps
