"""Speed ratios whose intervals hold the spread between repeats (issue 47 item 1,
parse_vllm/tools/eval/timing.py): each repeat's ratio beside the pooled one, an interval that
resamples repeats as well as tasks, verdicts only where every repeat agrees; the committed
runs' repeats read back from their timings.jsonl; the policy's goal keys of bench_adaptive."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

from parse_vllm.tools.eval import report, timing

ROOT = Path(__file__).parents[1]


def test_two_repeats_that_disagree_by_hand():
    # the reference takes 2 s a task in both repeats; the row 1 s in repeat 1 and 4 s in repeat 2.
    # Pooled: 8 s / 10 s = 0.8x; by repeat 2.0x and 0.5x. Tasks are alike within a repeat, so a
    # resample's ratio depends only on the repeats drawn: (1, 1) 2.0x with probability 1/4, (2, 2)
    # 0.5x with 1/4, one of each 0.8x with 1/2 -> the 2.5% and 97.5% points are 0.5 and 2.0.
    f = timing.speed_figures([[2.0, 2.0], [2.0, 2.0]], [[1.0, 1.0], [4.0, 4.0]])
    assert f["ratio"] == pytest.approx(0.8) and f["by_repeat"] == pytest.approx([2.0, 0.5])
    assert f["ci"] == pytest.approx([0.5, 2.0]) and f["verdict"] == timing.SAME
    text = timing.describe_ratio(f["ratio"], f["ci"], by_repeat=f["by_repeat"])
    assert text == "no difference (0.80x [0.50, 2.00]; repeats 2.00x / 0.50x)"


def test_the_interval_spans_the_repeats_where_a_task_only_interval_is_a_point():
    # token-level k 4 at batch 8 on odd, in miniature: every task 1.07x faster in repeat 1 and
    # 1.33x in repeat 2. Resampling tasks of the per-task medians sees every task alike and gives
    # one point; the interval over repeats runs from one repeat's figure to the other's.
    t = np.random.default_rng(0).uniform(4.0, 8.0, 40)
    ref = [t, t]
    x = [t / 1.07, t / 1.33]
    medians = timing.per_task(x)
    narrow = timing.speed_ratio_ci(t, medians)
    assert narrow[1] - narrow[0] < 0.01
    f = timing.speed_figures(ref, x)
    assert f["by_repeat"] == pytest.approx([1.07, 1.33])
    assert f["ci"] == pytest.approx([1.07, 1.33], abs=1e-9)
    assert f["ratio"] == pytest.approx(timing.speed_ratio(t, medians))  # two repeats: the median is the mean
    # both repeats faster and the interval above 1.0: faster
    assert f["verdict"] == timing.FASTER


def _loop_bootstrap(ref, x, n=20000, seed=1):
    """Written here, independently: draw repeats, then tasks, sum the chosen cells."""
    ref, x = np.asarray(ref), np.asarray(x)
    R, T = ref.shape
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n):
        rr, tt = rng.integers(0, R, R), rng.integers(0, T, T)
        vals.append(ref[np.ix_(rr, tt)].sum() / x[np.ix_(rr, tt)].sum())
    return np.percentile(vals, [2.5, 97.5])


def test_the_crossed_bootstrap_against_a_loop_written_here():
    rng = np.random.default_rng(4)
    t = rng.uniform(2.0, 6.0, 24)
    ref = np.stack([t * rng.uniform(0.9, 1.1, 24), t * 1.2 * rng.uniform(0.9, 1.1, 24)])
    x = np.stack([ref[0] / 1.3 * rng.uniform(0.8, 1.2, 24), ref[1] / 1.1 * rng.uniform(0.8, 1.2, 24)])
    lo, hi = timing.speed_figures(ref, x)["ci"]
    want = _loop_bootstrap(ref, x)
    assert lo == pytest.approx(want[0], abs=0.01) and hi == pytest.approx(want[1], abs=0.01)
    # one repeat: the paired bootstrap over tasks
    one = timing.speed_figures(ref[:1], x[:1])
    assert one["by_repeat"] == [pytest.approx(ref[0].sum() / x[0].sum())]
    want = _loop_bootstrap(ref[:1], x[:1])
    assert one["ci"][0] == pytest.approx(want[0], abs=0.01) and one["ci"][1] == pytest.approx(want[1], abs=0.01)
    with pytest.raises(ValueError, match="same task list in the same repeats"):
        timing.speed_figures(ref, x[:1])


def test_a_direction_stands_only_where_every_repeat_agrees():
    assert timing.verdict([1.05, 1.3], by_repeat=[1.2, 1.1]) == timing.FASTER
    assert timing.verdict([1.05, 1.3], by_repeat=[1.2, 0.98]) == timing.SAME
    assert timing.verdict([0.6, 0.9], by_repeat=[0.7, 1.01]) == timing.SAME
    assert timing.verdict([0.6, 0.9], by_repeat=[0.7, 0.8]) == timing.SLOWER
    assert timing.verdict([1.05, 1.3], few=True, by_repeat=[1.2, 1.1]) == timing.TOO_FEW
    assert timing.describe_ratio(1.25, [1.1, 1.4], by_repeat=[1.2, 1.3]) == "1.25x [1.10, 1.40]; repeats 1.20x / 1.30x"


def _timings(path: Path, jobs: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(x) for x in [{"settings": {}}, *jobs]) + "\n")
    return path


def _job(config, repeat, task_s, tau=None, batch=8):
    return {
        "set": "humaneval-odd",
        "config": config,
        "tau": tau,
        "guard": None,
        "batch": batch,
        "repeat": repeat,
        "task_s": task_s,
    }


def test_rows_saved_without_their_repeats_get_them_from_the_runs_timings(tmp_path):
    path = _timings(
        tmp_path / "timings.jsonl",
        [_job("target", 0, [2.0, 4.0]), _job("token-k4", 0, [1.0, 2.0]), _job("target", 1, [4.0, 6.0]),
         _job("token-k4", 1, [3.0, 3.0])],
    )  # fmt: skip
    rows = [
        {"set": "humaneval-odd", "config": "target", "tau": None, "guard": None, "batch": 8, "task_s": [3.0, 5.0],
         "tok_s": 1.0},
        {"set": "humaneval-odd", "config": "token-k4", "tau": None, "guard": None, "batch": 8, "task_s": [2.0, 2.5],
         "tok_s": 1.0},
    ]  # fmt: skip
    timing.with_repeats(rows, path)
    assert rows[0]["task_s_repeats"] == [[2.0, 4.0], [4.0, 6.0]]
    k4 = rows[1]
    report._speed(k4, rows[0])  # the eval report's speed-up against the target
    # by hand: pooled 16 / 9; repeat 1 6 / 3 = 2.0x, repeat 2 10 / 6
    assert k4["speedup"] == pytest.approx(16 / 9) and k4["speedup_by_repeat"] == pytest.approx([2.0, 10 / 6])
    bad = [dict(rows[1], task_s=[2.0, 2.0])]
    del bad[0]["task_s_repeats"]
    with pytest.raises(ValueError, match="another run's"):
        timing.with_repeats(bad, path)


def _ba_row(config, batch, split, task_s_repeats, tau=None, pass_at_1=None, run="a", **extra):
    task_s = timing.per_task(task_s_repeats)
    return {
        "pair": "coder", "config": config, "tau": tau, "batch": batch, "split": split, "pass_at_1": pass_at_1,
        "run": run,
        "task_s": task_s, "task_s_repeats": task_s_repeats, "s_per_task": float(np.mean(task_s)), **extra,
    }  # fmt: skip


def test_the_policys_goal_keys_by_hand():
    ba = load_script("bench_adaptive")
    rows = [
        _ba_row("target", 8, "odd", [[4.0, 4.0], [4.0, 4.0]], pass_at_1=0.5),
        _ba_row("token-k4", 8, "odd", [[2.0, 2.0], [3.0, 3.0]]),  # the fastest: 2.5 s a task
        _ba_row("continue", 8, "odd", [[5.0, 5.0], [5.0, 5.0]], tau=0.75, window_draft_tokens=300,
                window_tokens_taken=100, rejected_windows=4),
        _ba_row("adaptive", 8, "odd", [[2.0, 2.0], [4.0, 4.0]], tau=0.75, pass_at_1=0.45),
        _ba_row("continue", 8, "test", [[5.0, 5.0], [5.0, 5.0]], tau=0.75, window_draft_tokens=100,
                window_tokens_taken=40, rejected_windows=1),
        _ba_row("continue-parts", 8, "odd", [[5.0, 5.0], [5.0, 5.0]], tau=0.75, window_draft_tokens=130,
                window_tokens_taken=100, rejected_windows=3),
        _ba_row("target", 1, "odd", [[4.0, 4.0], [4.0, 4.0]]),  # no adaptive row at batch 1: no key
    ]  # fmt: skip
    keys = ba.goal_keys(rows)
    # k 4's 10 s over adaptive's 12 s; repeat 1 4 / 4, repeat 2 6 / 8
    assert keys["policy_over_best_odd_bs8"] == pytest.approx(10 / 12)
    assert keys["policy_over_best_odd_bs8_by_repeat"] == pytest.approx([1.0, 0.75])
    assert keys["policy_over_best_odd_bs8_baseline"] == "token-k4"
    assert "policy_over_best_odd_bs8_probe" not in keys  # rows without probe units: no such key
    # the same rows probed: adaptive's repeat 2 ran in a spell twice as slow (8 s of work 4 in
    # units of 1 s), k 4's did not: 10 units over 8, repeats 1.0 and 1.5
    probed = [dict(r, task_probe_repeats=r["task_s_repeats"]) for r in rows]
    probed[3]["task_probe_repeats"] = [[2.0, 2.0], [2.0, 2.0]]
    keys_probe = ba.goal_keys(probed)
    assert keys_probe["policy_over_best_odd_bs8_probe"] == pytest.approx(10 / 8)
    assert keys_probe["policy_over_best_odd_bs8_probe_by_repeat"] == pytest.approx([1.0, 1.5])
    assert keys_probe["policy_over_best_odd_bs8"] == pytest.approx(10 / 12)  # the seconds' as before
    # (the repeats disagree on the side of 1: no difference, whatever the pooled 1.25x)
    assert "in probe units no difference (1.25x" in "\n".join(ba.goal_lines(keys_probe))
    assert "policy_over_best_odd_bs1" not in keys and "policy_over_best_mbpp_test_bs8" not in keys
    assert keys["policy_pass_at_1_odd"] == 0.45 and keys["target_pass_at_1_odd"] == 0.5
    # continue at batch 8 over both sets: (300 + 100 - 100 - 40) draft tokens over 5 rejections
    assert keys["discarded_draft_per_rejection_before"] == pytest.approx(260 / 5)
    assert keys["discarded_draft_per_rejection_after"] == pytest.approx(30 / 3)  # judged in parts
    assert keys["discarded_draft_per_rejection_before_batch"] == keys["discarded_draft_per_rejection_after_batch"] == 8
    # batch 1 from two runs: the ratio compares rows of one run, the last with a policy row (b),
    # whose policy is adaptive judged in parts and whose `continue` in parts is the fastest
    # baseline; run a's faster k 4 is another run's and does not count
    later = [
        _ba_row("token-k4", 1, "odd", [[1.0, 1.0], [1.0, 1.0]], run="a"),
        _ba_row("adaptive", 1, "odd", [[9.0, 9.0], [9.0, 9.0]], tau=0.75, run="a"),
        _ba_row("token-k4", 1, "odd", [[3.0, 3.0], [3.0, 3.0]], run="b"),
        _ba_row("continue-parts", 1, "odd", [[2.0, 2.0], [2.0, 2.0]], tau=0.75, run="b", window_draft_tokens=50,
                window_tokens_taken=40, rejected_windows=2),
        _ba_row("adaptive-parts", 1, "odd", [[4.0, 4.0], [2.0, 2.0]], tau=0.75, run="b"),
        _ba_row("adaptive", 1, "odd", [[8.0, 8.0], [8.0, 8.0]], tau=0.75, run="b"),
    ]  # fmt: skip
    keys = ba.goal_keys(rows + later)
    assert keys["policy_over_best_odd_bs1"] == pytest.approx(4 / 6)  # continue-parts' 4 s over 6 s
    assert keys["policy_over_best_odd_bs1_by_repeat"] == pytest.approx([0.5, 1.0])
    assert keys["policy_over_best_odd_bs1_baseline"] == "continue-parts"
    assert (keys["policy_over_best_odd_bs1_policy"], keys["policy_over_best_odd_bs1_run"]) == ("adaptive-parts", "b")
    assert keys["policy_over_best_odd_bs8_run"] == "a"
    # judged in parts only at batch 1 and whole only at 8: each at its own batch, said so
    keys = ba.goal_keys([r for r in rows if r["config"] != "continue-parts"] + later)
    assert keys["discarded_draft_per_rejection_before_batch"] == 8
    assert keys["discarded_draft_per_rejection_after"] == pytest.approx(10 / 2)
    assert keys["discarded_draft_per_rejection_after_batch"] == 1


def test_runs_of_one_experiment_pool_their_repeats_in_the_goals(tmp_path):
    """A set and batch timed twice with the same settings: the goal's ratio is over both runs'
    repeats (each run's repeat r beside the same run's repeat r), and a run of other settings
    given before them is left out."""
    ba = load_script("bench_adaptive")
    rows = [
        _ba_row("token-k4", 1, "test", [[1.0, 1.0], [1.0, 1.0]], run="old", experiment="y"),
        _ba_row("adaptive-parts", 1, "test", [[9.0, 9.0], [9.0, 9.0]], tau=0.75, run="old", experiment="y"),
        _ba_row("target", 1, "test", [[5.0, 5.0], [5.0, 5.0]], run="c", experiment="x"),
        _ba_row("token-k4", 1, "test", [[2.0, 2.0], [2.0, 2.0]], run="c", experiment="x"),
        _ba_row("adaptive-parts", 1, "test", [[2.0, 2.0], [4.0, 4.0]], tau=0.75, run="c", experiment="x"),
        _ba_row("target", 1, "test", [[5.0, 5.0], [5.0, 5.0]], run="d", experiment="x"),
        _ba_row("token-k4", 1, "test", [[3.0, 3.0], [3.0, 3.0]], run="d", experiment="x"),
        _ba_row("adaptive-parts", 1, "test", [[3.0, 3.0], [3.0, 3.0]], tau=0.75, run="d", experiment="x"),
    ]  # fmt: skip
    keys = ba.goal_keys(rows)
    # k 4 is the best (2.5 s a task over both runs against the target's 5): 20 s over adaptive's 24;
    # repeats: c's 4 / 4 and 4 / 8, d's 6 / 6 twice
    assert keys["policy_over_best_mbpp_test_bs1"] == pytest.approx(20 / 24)
    assert keys["policy_over_best_mbpp_test_bs1_by_repeat"] == pytest.approx([1.0, 0.5, 1.0, 1.0])
    assert keys["policy_over_best_mbpp_test_bs1_run"] == "c, d"
    assert "`c`, `d` | **not met** |" in "\n".join(ba.goal_lines(keys))  # repeat 2 of c: 0.5x
    # the last run alone where the two differ in what they timed
    keys = ba.goal_keys(rows[:5] + [dict(r, experiment="z") for r in rows[5:]])
    assert (
        keys["policy_over_best_mbpp_test_bs1"] == pytest.approx(1.0)
        and keys["policy_over_best_mbpp_test_bs1_run"] == "d"
    )
    # a run's digest is of its saved settings: equal settings, equal digests; none saved, none
    for name, settings in (("a", {"args": {"batch": 1}}), ("b", {"args": {"batch": 1}}), ("e", {"args": {"batch": 8}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "timings.jsonl").write_text(json.dumps({"settings": settings}) + "\n")
    digest = {n: ba.experiment_of(tmp_path / n) for n in "abe"}
    assert digest["a"] == digest["b"] != digest["e"] and ba.experiment_of(tmp_path) is None


def _strip_speeds(summary: dict) -> dict:
    """A summary as eval wrote it before runs kept their repeats: no task_s_repeats, no
    per-repeat speed-ups, the intervals over tasks alone."""
    for r in summary["rows"]:
        for k in ("task_s_repeats", "speedup_by_repeat"):
            r.pop(k, None)
        r["speedup_ci"] = None
    return summary


def test_rescore_rebuilds_a_committed_run_from_its_timings(tmp_path):
    import shutil

    from parse_vllm import cli

    run = ROOT / "bench" / "judge-coder" / "e2e-mbpp-test"
    out = tmp_path / "run"
    shutil.copytree(run, out)
    committed = json.loads((run / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps(_strip_speeds(json.loads((run / "summary.json").read_text()))))
    assert cli.main(["eval", "--rescore", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text()) == committed
    assert (out / "summary.md").read_text() == (run / "summary.md").read_text()
    # timings of another run are refused, naming the row
    lines = (out / "timings.jsonl").read_text().splitlines()
    job = json.loads(lines[1])
    job["task_s"] = [t * 2 for t in job["task_s"]]
    (out / "timings.jsonl").write_text("\n".join([lines[0], json.dumps(job), *lines[2:]]) + "\n")
    (out / "summary.json").write_text(json.dumps(_strip_speeds(json.loads((run / "summary.json").read_text()))))
    assert cli.main(["eval", "--rescore", "--out", str(out)]) != 0


def test_the_committed_end_to_end_speed_keys_come_from_the_committed_timings():
    je = load_script("judge_e2e")
    committed = json.loads((ROOT / "bench" / "judge-coder" / "summary.json").read_text())
    odd = je.load_run(ROOT / "bench" / "judge-coder" / "e2e-odd")
    mbpp = je.load_run(ROOT / "bench" / "judge-coder" / "e2e-mbpp-test")
    tau = committed["e2e_tau"]
    rebuilt = {**je.figures(odd, tau), **je.mbpp_figures(mbpp, tau)}
    speed = [k for k in rebuilt if "_speed_" in k or "_time_per_task_" in k]
    assert len(speed) >= 20 and all(k.endswith(("_ci", "_by_repeat", "_verdict", "_baseline_bs1")) or
                                    f"{k}_by_repeat" in rebuilt for k in speed)  # fmt: skip
    # every end-to-end key, the rows and noise floors included, as committed
    assert len(rebuilt) >= 40
    assert {k: rebuilt[k] for k in rebuilt} == {k: committed.get(k) for k in rebuilt}
