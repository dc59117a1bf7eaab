"""How `parse-vllm eval` times (parse_vllm/tools/eval/timing.py, issue 36): the interleaved
schedule, per-task time, bootstrap intervals and "no difference", the labelling of PARSE rows
that opened no window (eval report, scripts/bench_adaptive.py, scripts/judge_e2e.py), the
refusal of too few batch-1 tasks, and -- through the command line on the tiny models -- the
prefix cache emptied before every timed job, fresh engines, interleaving and resumption."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

from parse_vllm import cli
from parse_vllm.tools import engine as tools_engine
from parse_vllm.tools.eval import report, run, timing
from parse_vllm.window_policy import FEATURES

ROOT = Path(__file__).parents[1]


# -- the schedule ---------------------------------------------------------------------------


def test_configurations_run_interleaved_each_repeat_in_the_same_order():
    assert timing.schedule(["A", "B", "C"], 2) == [("A", 0), ("B", 0), ("C", 0), ("A", 1), ("B", 1), ("C", 1)]
    jobs = [{"set": "s", "batch": b, "tau": t, "guard": 0} for b in (1, 8) for t in (0.0, 0.7)]
    engines = [
        {"name": "target", "jobs": [{"set": "s", "batch": 1, "tau": None, "guard": None}], "per_job": False},
        {"name": "parse W=8 k4", "jobs": jobs, "per_job": False},
        {"name": "parse W=8 adaptive-k4", "jobs": jobs, "per_job": True},  # one engine per job
    ]
    plan = run.sessions(engines, 2, per_job=False)
    # target | parse (4 jobs, one engine) | adaptive, 4 engines of one job | again, same order
    assert [(e["name"], len(js)) for e, js in plan] == 2 * (
        [("target", 1), ("parse W=8 k4", 4)] + [("parse W=8 adaptive-k4", 1)] * 4
    )
    flat = [j for _, js in plan for j in js]
    assert [j["order"] for j in flat] == list(range(18))
    assert [j["repeat"] for j in flat] == [0] * 9 + [1] * 9
    assert [(j["config"], j["batch"], j["tau"]) for j in flat[:9]] == [
        (j["config"], j["batch"], j["tau"]) for j in flat[9:]
    ]
    # --engine-per-job: every job an engine of its own
    assert all(len(js) == 1 for _, js in run.sessions(engines, 2, per_job=True))


# -- time per task --------------------------------------------------------------------------


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Out:
    def __init__(self, rid: str, n: int):
        self.request_id, self.finished = rid, True
        self.outputs = [type("C", (), {"token_ids": [7] * n})()]


class _Engine:
    """Each task needs a scripted number of steps; a step costs `step_s`, adding a request `add_s`."""

    def __init__(self, clock: _Clock, steps: list[int], step_s: float, add_s: float):
        self.clock, self.steps, self.step_s, self.add_s = clock, steps, step_s, add_s
        self.live: dict[str, int] = {}
        self.added: list[tuple[float, int]] = []

    def add_request(self, rid, prompt, params):
        self.clock.t += self.add_s
        i = int(rid.split("-")[0][1:])
        self.live[rid] = self.steps[i]
        self.added.append((self.clock.t, i))

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.clock.t += self.step_s
        done = []
        for rid in list(self.live):
            self.live[rid] -= 1
            if self.live[rid] == 0:
                del self.live[rid]
                done.append(_Out(rid, self.steps[int(rid.split("-")[0][1:])]))
        return done


def _run(steps, batch, step_s=1.0, add_s=0.0):
    clock = _Clock()
    llm = type("LLM", (), {})()
    llm.llm_engine = _Engine(clock, steps, step_s, add_s)
    return tools_engine.run_batch(llm, [[1]] * len(steps), [None] * len(steps), batch, clock=clock)


def test_per_task_time_shares_each_step_among_the_requests_in_flight():
    """By hand, batch 2, tasks of 2, 4 and 3 steps of 1 s: steps 1-2 run tasks 0 and 1 (0.5 s
    each a step), task 0 ends; steps 3-4 run tasks 1 and 2; step 5 task 2 alone.
    Task 0: 1.0 s, task 1: 2.0 s, task 2: 0.5 + 0.5 + 1.0 = 2.0 s; 5 s in all, the wall time."""
    got = _run([2, 4, 3], batch=2)
    assert got["task_s"] == pytest.approx([1.0, 2.0, 2.0]) and got["wall_s"] == pytest.approx(5.0)
    assert got["latency_s"] == pytest.approx([2.0, 4.0, 3.0]) and got["tokens"] == 9
    assert got["tok_s"] == pytest.approx(9 / 5)
    # adding a request costs 0.5 s, charged with the step that follows to those in flight:
    # 0 -> 2 s over tasks 0, 1 (1.0 each); step 2, 0.5 each; task 2 added, 3 -> 4.5 over 1, 2
    # (0.75 each); step 4, 0.5 each; step 5, task 2 alone, 1.0. -> 1.5, 2.75, 2.25 = 6.5 s
    got = _run([2, 4, 3], batch=2, add_s=0.5)
    assert got["task_s"] == pytest.approx([1.5, 2.75, 2.25]) and got["wall_s"] == pytest.approx(6.5)
    # batch 1: a task's time is its whole request, added and run alone
    got = _run([2, 3], batch=1, add_s=0.5)
    assert got["task_s"] == pytest.approx([2.5, 3.5]) and sum(got["task_s"]) == pytest.approx(got["wall_s"])
    # more tokens for the same work do not make a task cheaper: tok/s and time per task differ
    assert timing.per_task([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [2.0, 9.0, 2.0]]) == [2.0, 2.0, 2.0]


def test_a_slow_spell_of_the_machine_inflates_task_s_and_not_the_probe_units():
    """The same tasks as above (batch 2, 2, 4 and 3 steps of 1 s), the machine twice as slow
    in steps 3 and 4; a probe before each step takes 0.1 s at full speed, 0.2 s in the slow
    spell, and reads it. By hand, seconds (probes left out): step 1-2 0.5 each to tasks 0 and
    1, steps 3-4 1.0 each to tasks 1 and 2, step 5 1.0 to task 2: task_s 1, 3, 3 (wall 7).
    In probe units each stretch over its probe: 0.5 / 0.1 = 5, 1.0 / 0.2 = 5, 1.0 / 0.1 =
    10: task 0 10, task 1 20, task 2 20, the times of the spell-free run (1, 2, 2) in units
    of 0.1 s. Latencies leave the probes out: 2, 6 and 5 s."""
    speeds = [1.0, 1.0, 2.0, 2.0, 1.0]
    clock = _Clock()
    engine = _Engine(clock, [2, 4, 3], 1.0, 0.0)
    step = engine.step

    def slow_step():
        engine.step_s = speeds[engine.n]
        engine.n += 1
        return step()

    def probe():
        clock.t += 0.1 * speeds[engine.n]
        return 0.1 * speeds[engine.n]

    engine.n, engine.step = 0, slow_step
    llm = type("LLM", (), {})()
    llm.llm_engine = engine
    got = tools_engine.run_batch(llm, [[1]] * 3, [None] * 3, 2, clock=clock, probe=probe)
    assert got["task_s"] == pytest.approx([1.0, 3.0, 3.0]) and got["wall_s"] == pytest.approx(7.0)
    assert got["task_probe"] == pytest.approx([10.0, 20.0, 20.0]) and got["probe_s"] == pytest.approx(0.1)
    assert got["latency_s"] == pytest.approx([2.0, 6.0, 5.0])
    assert _run([2, 4, 3], batch=2)["task_probe"] is None


def test_probe_units_take_a_slow_spell_out_of_a_ratio():
    """Two rows of 12 tasks, 2 repeats: the target alone at 4 s a task; the other row does
    the same work, but its repeat 2 ran in a spell 1.5x slower (6 s a task in seconds). In
    seconds: repeats 1.0x and 0.67x, pooled 8 / 10 = 0.8x, "no difference" (they disagree).
    In probe units (the probe slowed alike, 1.5x): 40 units a task throughout, 1.0x in each
    repeat with the point interval [1, 1]. The summary keeps the probe keys, and the table
    gains the probe column, only where a run probed."""
    tasks = [f"HumanEval/{i}" for i in range(12)]
    base = {"set": "humaneval-odd", "batch": 1, "item_ids": tasks, "n_prompts": 12, "few_tasks": False}
    target = dict(base, config="target", task_s=[4.0] * 12, task_s_repeats=[[4.0] * 12] * 2)
    target["task_probe_repeats"] = [[40.0] * 12] * 2
    other = dict(base, config="token-k4", task_s=[5.0] * 12, task_s_repeats=[[4.0] * 12, [6.0] * 12])
    other["task_probe_repeats"] = [[40.0] * 12] * 2
    report.speeds([target, other])
    assert other["speedup"] == pytest.approx(0.8) and other["speedup_by_repeat"] == pytest.approx([1.0, 2 / 3])
    assert other["speedup_verdict"] == timing.SAME
    assert other["speedup_probe"] == pytest.approx(1.0) and other["speedup_probe_ci"] == pytest.approx([1.0, 1.0])
    assert other["speedup_probe_by_repeat"] == pytest.approx([1.0, 1.0])
    assert report.summary_row(other)["speedup_probe"] == pytest.approx(1.0)
    assert any(c[0] == "speed_probe_text" for c in report._columns([target, other]))
    for r in (target, other):
        for k in report.PROBE_KEYS:
            r.pop(k, None)
    report.speeds([target, other])
    assert "speedup_probe" not in report.summary_row(other)
    assert not any(c[0] == "speed_probe_text" for c in report._columns([target, other]))


def test_the_speed_probe_probes_once_a_second_and_reads_the_median_of_its_last_three():
    """Probes of 10, 30, 20 and 50 ms at t = 0, 1, 2.5 and 3.5 s; read at t = 0, 0.5, 1, 2.5,
    3.5: 10 (one probe), 10 (none due), median(10, 30) = 20, median(10, 30, 20) = 20,
    median(30, 20, 50) = 30. A real probe reads some milliseconds."""
    clock = _Clock()
    probe = tools_engine.SpeedProbe(interval_s=1.0, keep=3, clock=clock)
    probe.probe = iter([0.01, 0.03, 0.02, 0.05]).__next__
    got = []
    for t in (0.0, 0.5, 1.0, 2.5, 3.5):
        clock.t = t
        got.append(probe())
    assert got == pytest.approx([0.01, 0.01, 0.02, 0.02, 0.03])
    assert 0 < tools_engine.SpeedProbe()() < 5


# -- intervals and "no difference" -----------------------------------------------------------


def _numpy_bootstrap(ref, x, n=20000, seed=1):
    """A percentile bootstrap written here: resample task indices, ratio of the sums."""
    ref, x = np.asarray(ref), np.asarray(x)
    idx = np.random.default_rng(seed).integers(0, len(ref), size=(n, len(ref)))
    vals = ref[idx].sum(1) / x[idx].sum(1)
    return np.percentile(vals, [2.5, 97.5])


def test_ratio_and_interval_against_hand_values_and_an_independent_bootstrap():
    # by hand: mean times 2.5 s and 1 s -> 2.5x; every task 2x -> the interval is the point
    assert timing.speed_ratio([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]) == 2.5
    assert timing.speed_ratio_ci([2.0] * 12, [1.0] * 12) == [2.0, 2.0]
    assert timing.mean_ci([3.0] * 5) == [3.0, 3.0] and timing.speed_ratio_ci([1.0], [1.0]) is None
    rng = np.random.default_rng(0)
    ref = rng.uniform(2.0, 6.0, 24)
    x = ref / 1.2 * rng.uniform(0.85, 1.15, 24)
    lo, hi = timing.speed_ratio_ci(ref, x)
    want = _numpy_bootstrap(ref, x)
    assert lo == pytest.approx(want[0], abs=0.01) and hi == pytest.approx(want[1], abs=0.01)
    assert lo < timing.speed_ratio(ref, x) < hi and lo > 1.0
    # tokens / seconds over tasks
    lo, hi = timing.tok_s_ci([10.0] * 12, [2.0] * 12)
    assert lo == hi == 5.0
    with pytest.raises(ValueError, match="same task list"):
        timing.speed_ratio([1.0, 2.0], [1.0])


def test_an_interval_holding_one_is_no_difference():
    assert timing.verdict([1.01, 1.3]) == timing.FASTER
    assert timing.verdict([0.7, 0.99]) == timing.SLOWER
    assert timing.verdict([0.95, 1.1]) == timing.verdict([1.0, 1.0]) == timing.SAME == "no difference"
    assert timing.verdict([1.2, 1.4], few=True) == timing.TOO_FEW
    assert timing.describe_ratio(1.04, [0.97, 1.1]) == "no difference (1.04x [0.97, 1.10])"
    assert timing.describe_ratio(1.25, [1.1, 1.4]) == "1.25x [1.10, 1.40]"
    # the same computation timed twice: identical but for noise -> no difference
    rng = np.random.default_rng(3)
    base = rng.uniform(1.0, 3.0, 16)
    nf = timing.noise_floor([base * rng.uniform(0.95, 1.05, 16), base * rng.uniform(0.95, 1.05, 16)])
    assert timing.verdict(nf["self_ratio_ci"]) == timing.SAME and nf["spread"] < 0.1


def test_the_noise_floor_in_probe_units_comes_from_the_targets_probed_repeats(tmp_path):
    """A machine 20% slower in repeat 2: the target's seconds differ by 20%, its probe units
    (seconds over a probe that slowed by as much) not at all; read back from timings.jsonl for
    a summary saved without them, and said in the report's line."""
    task_s = [1.0, 2.0, 3.0, 4.0]
    probe = 0.01
    jobs = [
        {"repeat": r, "task_s": [x * slow for x in task_s], "task_probe": [x * slow / (probe * slow) for x in task_s]}
        for r, slow in enumerate((1.0, 1.2))
    ]
    nf = timing.noise_floor([j["task_s"] for j in jobs])
    assert nf["self_ratio"] == pytest.approx(1 / 1.2) and nf["spread"] == pytest.approx(0.2 / 1.1)
    pf = timing.probe_noise_floor([j["task_probe"] for j in jobs])
    assert pf["probe_self_ratio"] == pytest.approx(1.0) and pf["probe_spread"] == pytest.approx(0.0)
    assert timing.probe_noise_floor([jobs[0]["task_probe"], None]) == {}  # a repeat not probed
    # a summary saved before the probe figures: they come from the run's timings
    lines = [json.dumps({"settings": {}})]
    for j in jobs:
        lines.append(
            json.dumps({"set": "humaneval-odd", "config": "target", "tau": None, "guard": None, "batch": 1, **j})
        )
        k4 = {**j, "task_probe": [1.0] * 4}  # another configuration's: not the noise floor's
        lines.append(
            json.dumps({"set": "humaneval-odd", "config": "token-k4", "tau": None, "guard": None, "batch": 1, **k4})
        )
    (tmp_path / "timings.jsonl").write_text("\n".join(lines) + "\n")
    saved = report.noise_floor_summary([{"set": "humaneval-odd", "batch": 1, **nf}])
    assert saved["max_spread_probe"] is None
    got = report.with_probe_noise_floor(saved, tmp_path / "timings.jsonl")
    e = got["by_set_batch"][0]
    assert e["probe_self_ratio"] == pytest.approx(1.0) and got["max_spread_probe"] == pytest.approx(0.0)
    assert e["self_ratio"] == nf["self_ratio"]  # the seconds' figures as saved
    line = report.noise_floor_line(got)
    assert "repeats differ by up to 18.2% (0.0% in probe units, where probed)" in line
    assert "in probe units no difference (1.00x" in line
    # a summary computed with them is left as it is
    direct = report.noise_floor_summary([{"set": "humaneval-odd", "batch": 1, **nf, **pf}])
    assert report.with_probe_noise_floor(direct, tmp_path / "timings.jsonl") == direct
    # another run's timings are refused, not read
    other = report.noise_floor_summary([{"set": "humaneval-odd", "batch": 1, **timing.noise_floor([task_s, task_s])}])
    with pytest.raises(ValueError, match="another run's"):
        report.with_probe_noise_floor(other, tmp_path / "timings.jsonl")


def _row(config, tau, task_s, tokens, acceptance=None, batch=8, windows_repeats=None):
    n = len(task_s)
    return {
        "set": "humaneval-odd",
        "split": "odd",
        "config": config,
        "tau": tau,
        "guard": 0 if tau is not None else None,
        "batch": batch,
        "n": n,
        "n_prompts": n,
        "task_s": list(task_s),
        "task_tokens": [tokens / n] * n,
        "s_per_task": float(np.mean(task_s)),
        "s_per_task_repeats": [float(np.mean(task_s)) * 0.98, float(np.mean(task_s)) * 1.02],
        "tokens": tokens,
        "wall_s": float(np.sum(task_s)),
        "tok_s": tokens / float(np.sum(task_s)),
        "few_tasks": batch == 1 and n < 12,
        "acceptance": acceptance,
        "windows_repeats": windows_repeats,
        "outputs": [[1, 2, 3]] * n,
        "correct": [True] * n,
        "nll_logprobs": None,
        "pass_at_1": 1.0,
    }


def _rows():
    rng = np.random.default_rng(5)
    t = rng.uniform(4.0, 8.0, 16)
    judged = {"drafts": 12, "windows_opened": {}, "tokens_accepted_semantic": 300}
    none = {"drafts": 0, "windows_opened": {}, "tokens_accepted_semantic": 0}
    return [
        _row("target", None, t, 3600),
        # faster by tok/s (more tokens) but not per task: the same time per task, noise apart
        _row("parse W=128 k4", 0.0, t * rng.uniform(0.97, 1.03, 16), 4000, judged, windows_repeats=[12, 12]),
        # 25% faster per task, but opened no window in any repeat: token-level through the PARSE engine
        _row("parse W=128 adaptive-k4", 0.7, t / 1.25, 3600, none, windows_repeats=[0, 0]),
        _row("token-k4", None, t / 1.1 * rng.uniform(0.99, 1.01, 16), 3600, {"drafts": 0}),
    ]


def test_zero_window_rows_are_labelled_and_unresolved_ratios_claim_nothing(tmp_path):
    rows = _rows()
    report.score(rows)
    by = {r["config"]: r for r in rows}
    accept_all, adaptive, k4 = by["parse W=128 k4"], by["parse W=128 adaptive-k4"], by["token-k4"]
    assert accept_all["speedup_tok_s"] == pytest.approx(4000 / 3600, rel=0.05)  # tok/s alone says 1.11x
    assert accept_all["speedup_verdict"] == "no difference" and accept_all["windows"] == 12
    assert accept_all["label"] == "parse W=128 k4 τ=0"
    assert (
        adaptive["windows"] == 0
        and adaptive["label"] == "parse W=128 adaptive-k4 τ=0.7 (no window opened: token-level)"
    )
    assert adaptive["speedup"] == pytest.approx(1.25) and adaptive["speedup_verdict"] == "faster"
    assert k4["label"] == "token-k4" and k4["windows"] is None
    rec = report.recommend(rows, 1.0, 1.0)
    assert rec["recommended"]["config"] == "parse W=128 adaptive-k4"
    assert "(no window opened: token-level)" in rec["recommendation"]
    # accept-all alone: faster on its face, no difference by its interval -> no recommendation
    only = [r for r in rows if r["config"] in ("target", "parse W=128 k4")]
    rec = report.recommend(only, 1.0, 1.0)
    assert rec["recommended"] is None and rec["recommendation"].startswith(report.NO_SETTING)
    summary = {
        "machine": {"cores": 2, "vllm": "0", "date": "today", "cpu": "AMD EPYC", "memory_gib": 24, "boot": "b-1"},
        "harness": {k: k for k in ("repeats", "order", "state", "per_task_time", "speed_ratio", "ci")}
        | {"min_bs1_tasks": timing.MIN_BS1_TASKS},
        "models": {"target": "t", "draft": "d", "window": 128, "spec_k": [4]},
        "args": {"max_tokens": 8},
        "budget": {"max_accuracy_drop": 1.0, "max_nll_increase": 1.0},
        "sets": ["humaneval-odd"],
        "rows": [{k: r.get(k) for k in report.ROW_KEYS} for r in rows],
        "baselines": [],
        # the target's second repeat 10% slower on every task: 1/1.1 = 0.91x, a spread of 10% / 1.05
        "noise_floor": report.noise_floor_summary(
            [
                {
                    "set": "humaneval-odd",
                    "batch": 8,
                    **timing.noise_floor([list(rows[0]["task_s"]), list(np.asarray(rows[0]["task_s"]) * 1.1)]),
                }
            ]
        ),
        **report.recommend(rows, 1.0, 1.0),
    }
    nf = summary["noise_floor"]["by_set_batch"][0]
    assert nf["self_ratio"] == pytest.approx(1 / 1.1) and nf["self_ratio_ci"] == pytest.approx([1 / 1.1] * 2)
    assert nf["spread"] == pytest.approx(0.1 / 1.05) and summary["noise_floor"]["max_spread"] == nf["spread"]
    paths = report.write(summary, tmp_path)
    md = paths["md"].read_text()
    assert "repeat 2 over repeat 1: 0.91x [0.91, 0.91]" in md
    assert "| parse W=128 adaptive-k4 τ=0.7 (no window opened: token-level) |" in md
    assert "no difference (" in md and "## Noise floor" in md and "repeat 2 over repeat 1" in md
    assert "- Machine: AMD EPYC, 2 cores, 24 GiB; every job on this boot of it (b-1)" in md
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_bench_adaptive_and_judge_e2e_label_zero_window_rows_and_give_intervals(tmp_path):
    rows = _rows()
    report.score(rows)
    runs = tmp_path / "odd"
    runs.mkdir()
    at1 = [dict(r, batch=1, few_tasks=False) for r in _rows()]  # 16 tasks at batch 1 too
    report.score(at1)
    nf = report.noise_floor_summary(
        [{"set": "humaneval-odd", "batch": 8, **timing.noise_floor([rows[0]["task_s"]] * 2)}]
    )
    (runs / "summary.json").write_text(json.dumps({"rows": rows + at1, "noise_floor": nf}))
    ba = load_script("bench_adaptive")
    assert ba.main(["--coder", str(runs), "--out", str(tmp_path / "adaptive")]) == 0
    s = json.loads((tmp_path / "adaptive" / "summary.json").read_text())
    for r in s["rows"]:  # the committed keys stay, each speed figure gains its interval
        assert {"pair", "config", "tau", "batch", "tok_s", "pass_at_1", "split", "n", "run", "ratio"} <= set(r)
        assert len(r["tok_s_ci"]) == 2 and len(r["ratio_ci"]) == 2 and len(r["s_per_task_ci"]) == 2
    a = next(r for r in s["rows"] if r["config"] == "adaptive" and r["batch"] == 8)
    assert a["windows"] == 0 and a["label"] == "adaptive (no window opened: token-level)"
    assert a["baseline"] == "token-k4" and a["ratio"] == pytest.approx(1.25 / 1.1, rel=0.02)
    section = (tmp_path / "adaptive" / "section.md").read_text()
    assert "| adaptive (no window opened: token-level) |" in section and "Noise floor of each run" in section
    cont = next(r for r in s["rows"] if r["config"] == "continue" and r["batch"] == 8)
    assert cont["label"] == "continue" and cont["verdict"] == "slower"  # 1/1.1 of token-level's speed
    # beside a SmolLM2 run timed before per-task timing (the one committed until 2026-11-27):
    # its rows keep tok/s, and say so
    old = ROOT / "tests" / "fixtures" / "smollm2-eagle3-before-timing"
    assert ba.main(["--coder", str(runs), "--smollm2", str(old), "--out", str(tmp_path / "mixed")]) == 0
    section = (tmp_path / "mixed" / "section.md").read_text()
    line = next(x for x in section.splitlines() if x.startswith("| smollm2 | — | 1 | 0.9 | adaptive"))
    assert "(no window opened: token-level)" in line and ba.OLD_RUN in line

    je = load_script("judge_e2e")
    (tmp_path / "judge.json").write_text(json.dumps({"auc_head_whole_odd": 0.7}))
    # the head: 1.25x accept-all's time on every task at batch 1 (0.8x its speed, an interval
    # of one point: slower), and at batch 8 faster on half the tasks and slower on the rest
    # (no difference), passing 13 of 16 where accept-all passes 16
    mixed = np.where(np.arange(16) % 2 == 0, 0.5, 1.5)
    head = [
        dict(r, tau=0.7, task_s=list(np.asarray(r["task_s"]) * (1.25 if r["batch"] == 1 else mixed)), pass_at_1=13 / 16)
        for r in rows + at1
        if r["config"] == "parse W=128 k4"
    ]
    (runs / "summary.json").write_text(json.dumps({"rows": rows + at1 + head, "noise_floor": nf}))
    assert je.main([str(runs), "--tau", "0.7", "--summary", str(tmp_path / "judge.json")]) == 0
    j = json.loads((tmp_path / "judge.json").read_text())
    assert j["odd_speed_head_over_accept_all_bs1"] == pytest.approx(0.8)
    assert j["odd_speed_head_over_accept_all_bs1_ci"] == pytest.approx([0.8, 0.8])
    assert j["odd_speed_head_over_accept_all_bs1_verdict"] == "slower"
    acc8 = next(r for r in rows if r["config"] == "parse W=128 k4")["task_s"]
    want = sum(acc8) / sum(np.asarray(acc8) * mixed)
    assert j["odd_speed_head_over_accept_all_bs8"] == pytest.approx(want)
    assert j["odd_speed_head_over_accept_all_bs8_verdict"] == "no difference"
    assert j["odd_pass_at_1_head"] == pytest.approx(13 / 16) and j["odd_pass_at_1_target"] == 1.0
    assert len(j["odd_speed_head_over_target_bs8_ci"]) == 2
    labels = {r["label"] for r in j["e2e_odd"]}
    assert "parse W=128 adaptive-k4 τ=0.7 (no window opened: token-level)" in labels
    assert j["odd_e2e_noise_floor"]["by_set_batch"]


# -- refusals (no engine starts) --------------------------------------------------------------


def _argv(tiny_models, out: Path, *extra: str) -> list[str]:
    return [
        "eval",
        "--target", str(tiny_models["target"]),
        "--draft", str(tiny_models["draft"]),
        "--window", "8",
        "--engine", json.dumps({"dtype": "float32", "kv_cache_memory_bytes": 96 << 20}),
        "--max-tokens", "10",
        "--out", str(out),
        "--same-process",  # the tests below monkeypatch this process; a process per job: its own test
        *extra,
    ]  # fmt: skip


def test_too_few_batch1_tasks_and_a_single_repeat_are_refused(tiny_models, tmp_path, capsys, monkeypatch):
    def no_engine(*a, **kw):
        raise AssertionError("an engine started")

    monkeypatch.setattr(run, "run_engine", no_engine)
    rc = cli.main(
        _argv(tiny_models, tmp_path / "a", "--prompts", "mtbench", "--bs1-prompts", "4", "--num-prompts", "2")
    )
    err = capsys.readouterr().err
    assert (
        rc == 2 and "batch-1 rows need at least 12 tasks" in err and "mtbench: 4" in err and "--allow-few-tasks" in err
    )
    rc = cli.main(_argv(tiny_models, tmp_path / "b", "--prompts", "mtbench", "--batch", "1", "--num-prompts", "8"))
    assert rc == 2 and "mtbench: 8" in capsys.readouterr().err
    rc = cli.main(_argv(tiny_models, tmp_path / "c", "--prompts", "mtbench", "--bs1-prompts", "0", "--repeats", "1"))
    assert rc == 2 and "--repeats must be >= 2" in capsys.readouterr().err


# Made-up seconds per task unit by (config, τ): the target 2, so each row's speed-up is 2 / its own
SCALE = {("target", None): 2.0, ("token-k4", None): 1.0, ("parse W=8 k4", 0.0): 1.6, ("parse W=8 k4", 0.7): 2.5,
         ("parse W=8 adaptive-k4", 0.7): 2.0}  # fmt: skip


def _made_up_engine(ran: list):
    """A stand-in for run.run_engine: each job's record made up, each job noted in `ran` as
    (config, τ, batch, repeat). Task i of a job takes SCALE · (i + 1) seconds, 10% more in
    repeat 2 for every configuration (a slow spell every repeat shares)."""

    def fake(config, kw, jobs, *, max_tokens, is_parse, progress, warmup, on_done=None):
        out = []
        for j in jobs:
            ran.append((config, j["tau"], j["batch"], j["repeat"]))
            n = len(j["prompts"])
            task_s = [SCALE.get((config, j["tau"]), 1.0) * (i + 1) * (1 + 0.1 * j["repeat"]) for i in range(n)]
            rec = {
                **{k: j[k] for k in ("config", "set", "batch", "tau", "guard", "repeat", "order", "item_ids")},
                "engine": "fresh", "wall_s": sum(task_s), "tokens": 3 * n, "tok_s": 3 * n / sum(task_s),
                "task_s": task_s,
                "latency_s": [1.0] * n, "latency_p50_s": 1.0, "latency_p90_s": 1.0, "outputs": [[42] * 3] * n,
                "acceptance": None if config == "target" else {"drafts": 0, "windows_opened": {}},
                "prefix_cache": {"emptied": True, "hits": 0, "queries": 0},
            }  # fmt: skip
            out.append(rec)
            if on_done:
                on_done(rec)
        return out

    return fake


def test_a_variant_can_run_its_own_taus(tiny_models, tmp_path, monkeypatch, capsys):
    """--variant-taus adaptive-k4=0.7: the adaptive engine runs τ 0.7 only, the others --taus;
    engines faked (each job's record made up), so the schedule and the rows are what is tested."""
    ran = []
    monkeypatch.setattr(run, "run_engine", _made_up_engine(ran))
    argv = _argv(tiny_models, tmp_path / "v", "--prompts", "mtbench", "--bs1-prompts", "0", "--num-prompts", "3",
                 "--batch", "2", "--variants", "k4", "adaptive-k4", "--taus", "0", "0.7",
                 "--variant-taus", "adaptive-k4=0.7", "--no-nll")  # fmt: skip
    assert cli.main(argv) == 0
    once = [("target", None), ("token-k4", None), ("parse W=8 k4", 0.0), ("parse W=8 k4", 0.7),
            ("parse W=8 adaptive-k4", 0.7)]  # fmt: skip
    assert [(c, t) for c, t, _, _ in ran] == once * 2 and [r for *_, r in ran] == [0] * 5 + [1] * 5
    s = json.loads((tmp_path / "v" / "summary.json").read_text())
    assert {(r["config"], r["tau"]) for r in s["rows"]} == set(once)
    verdicts = {1.0: "no difference", 2.0: "faster", 1.25: "faster", 0.8: "slower"}
    for r in s["rows"]:  # by hand: 2 / SCALE, the same in each repeat (an interval of one point)
        want = 2.0 / SCALE[(r["config"], r["tau"])]
        assert r["speedup"] == pytest.approx(want) and r["speedup_by_repeat"] == pytest.approx([want, want])
        assert r["config"] == "target" or r["speedup_verdict"] == verdicts[round(want, 2)]
        if r["config"].startswith("parse"):
            assert r["label"].endswith("(no window opened: token-level)")
    capsys.readouterr()
    bad = argv[:-3] + ["--variant-taus", "adaptive-k8=0.7", "--no-nll"]
    assert cli.main(bad) == 2 and "not one of --variants" in capsys.readouterr().err


def test_tau_head_runs_the_tau_the_judge_head_records(tiny_models, tmp_path, monkeypatch, capsys):
    """--taus head / --variant-taus V=head: the τ_head the named judge head's training chose
    (engines faked: the schedule is what is tested); no head, or one without τ_head, is refused."""
    from parse_vllm.judge_head import HeadIdentity, JudgeHead

    ident = HeadIdentity(target="tiny", architecture="LlamaForCausalLM", hidden_size=4, num_layers=1,
                         vocab_size=10, suffix_ids=(1,), question="Q?", labels=("Correct", "Incorrect"),
                         label_ids=((2,), (3,)), boundaries={"mode": "sentence", "every": 32, "max_boundaries": 8},
                         lm_head_fingerprint=((0.5,), (-0.5,)))  # fmt: skip

    def head(training):
        return JudgeHead(np.ones(4), 0.0, np.zeros(4), np.ones(4), ("hidden",), ident, training=training)

    with_tau = head({"tau_head": {"tau": 0.65, "rule": "…"}}).save(tmp_path / "h.safetensors")
    without = head({}).save(tmp_path / "old.safetensors")
    ran = []
    monkeypatch.setattr(run, "run_engine", _made_up_engine(ran))

    def argv(head_path, *extra):
        return _argv(tiny_models, tmp_path / "v", "--prompts", "mtbench", "--bs1-prompts", "0", "--num-prompts",
                     "3", "--batch", "2", "--variants", "k4", "adaptive-k4", "--no-nll",
                     *(["--parse", json.dumps({"judge_head": str(head_path)})] if head_path else []), *extra)  # fmt: skip

    # τ 0.65 given twice, once as a number and once as head: one job each
    assert cli.main(argv(with_tau, "--taus", "0", "0.65", "head", "--variant-taus", "adaptive-k4=head,.65")) == 0
    parse_jobs = [(c, t) for c, t, *_ in ran if c.startswith("parse")]
    assert len(parse_jobs) == len(set(parse_jobs)) * 2  # two repeats, nothing else twice
    assert sorted({t for c, t in parse_jobs}) == [0.0, 0.65]
    assert {t for c, t, *_ in ran if "adaptive" in c} == {0.65}
    s = json.loads((tmp_path / "v" / "summary.json").read_text())
    assert s["tau_head"] == {"tau": 0.65, "judge_head": str(with_tau)} and s["args"]["taus"] == [0.0, 0.65]
    capsys.readouterr()
    assert cli.main(argv(without, "--taus", "head")) == 2
    assert "records no τ_head" in capsys.readouterr().err
    assert cli.main(argv(None, "--taus", "head")) == 2
    assert "name no judge_head" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own refusal, saying what τ may be
        cli.main(argv(with_tau, "--taus", "hed"))
    assert e.value.code == 2 and "the judge head's τ_head" in capsys.readouterr().err


# -- the whole command on the tiny models ------------------------------------------------------

# prompts sharing a long opening (more than one 32-token KV block), so a job that found an
# earlier job's KV in the prefix cache would show it in vLLM's prefix-cache hits
OPENING = "Read this passage and answer the question after it. " + " ".join(f"word{i}" for i in range(48)) + ". "


@pytest.fixture(scope="module")
def timed(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("timing")
    prompts = root / "shared.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": OPENING + q}) + "\n" for i, q in enumerate(
        ["Which word comes first?", "Which word comes last?", "How many words are there?"]
    )))  # fmt: skip
    argv = _argv(
        tiny_models, root / "out", "--prompts", str(prompts), "--bs1-prompts", "0", "--num-prompts", "3",
        "--batch", "2", "--spec-k", "--variants", "continue", "adaptive", "--taus", "0", "1.5", "--no-nll",
    )  # fmt: skip
    assert cli.main(argv) == 0
    return {"argv": argv, "out": root / "out", "summary": json.loads((root / "out" / "summary.json").read_text())}


@pytest.mark.slow
def test_every_timed_job_starts_from_an_emptied_cache_on_the_interleaved_schedule(timed):
    s = timed["summary"]
    jobs = s["jobs"]
    # target, continue τ 0 and τ 1.5 (one engine), adaptive τ 0 and τ 1.5 (an engine each); twice
    once = [("target", None), ("parse W=8", 0.0), ("parse W=8", 1.5), ("parse W=8 adaptive", 0.0),
            ("parse W=8 adaptive", 1.5)]  # fmt: skip
    assert [(j["config"], j["tau"]) for j in jobs] == once * 2
    assert [j["repeat"] for j in jobs] == [0] * 5 + [1] * 5 and [j["order"] for j in jobs] == list(range(10))
    fresh = [j["engine"] == "fresh" for j in jobs]
    assert fresh == [True, True, False, True, True] * 2
    # the prompt cache: every job finds the same hits (only its own tasks' shared opening), so
    # none found the warm-up's or an earlier job's KV
    lines = (timed["out"] / "timings.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines[1:]]
    hits = {r["prefix_cache"]["hits"] for r in records}
    assert len(hits) == 1 and hits.pop() > 0
    assert all(r["prefix_cache"]["emptied"] for r in records)
    # adaptive jobs record the step costs their policy chose with (learnt: the engine's own steps)
    for r in records:
        costs = r["step_costs"]
        if "adaptive" in r["config"]:
            assert set(costs["seconds"]) == set(FEATURES) and not costs["fixed"] and costs["steps"] > 0
        else:
            assert costs is None
    # per-task times add up to each job's wall time, and each task's is the wall while it was in
    # flight split between at most the batch's 2 requests: at least half its latency (timed
    # apart, from its arrival to its last token), at most all of it and its arrival; at batch 2
    # over 3 tasks the requests overlap, so some task's share is below its latency
    for r in records:
        assert sum(r["task_s"]) == pytest.approx(r["wall_s"], rel=1e-9) and len(r["task_s"]) == 3
        pairs = list(zip(r["task_s"], r["latency_s"]))
        assert all(lat / 2 - 1e-9 <= share <= lat + 0.25 for share, lat in pairs), pairs
        assert any(share < 0.9 * lat for share, lat in pairs), pairs
    for row in s["rows"]:
        assert row["repeats"] == 2 and row["s_per_task_spread"] is not None and len(row["s_per_task_ci"]) == 2
        # the row's time per task is the timed jobs' own: each repeat's mean over its tasks,
        # read from the records the jobs wrote, and their mean
        own = sorted((r for r in records if (r["config"], r["tau"]) == (row["config"], row["tau"])),
                     key=lambda r: r["repeat"])  # fmt: skip
        assert [r["repeat"] for r in own] == [0, 1]
        by_repeat = [float(np.mean(r["task_s"])) for r in own]
        assert row["s_per_task_repeats"] == pytest.approx(by_repeat, rel=1e-9)
        assert row["s_per_task"] == pytest.approx(np.mean(by_repeat), rel=1e-9)
        assert len(row["tok_s_ci"]) == 2
        if row["config"] != "target":
            assert len(row["speedup_ci"]) == 2 and row["speedup_verdict"] in ("faster", "slower", "no difference")
        # τ 1.5 never drafts: no window, labelled token-level; τ 0 judges every window it opens
        if row["tau"] == 1.5:
            assert row["windows"] == 0 and row["label"].endswith("(no window opened: token-level)"), row
        if row["config"] == "parse W=8" and row["tau"] == 0.0:
            assert row["windows"] > 0 and "token-level" not in row["label"]
    nf = s["noise_floor"]["by_set_batch"]
    assert len(nf) == 1 and len(nf[0]["s_per_task_repeats"]) == 2 and len(nf[0]["self_ratio_ci"]) == 2
    md = (timed["out"] / "summary.md").read_text()
    assert "## Noise floor" in md and "(no window opened: token-level)" in md and "## How this was timed" in md


@pytest.mark.slow
def test_without_the_cache_reset_a_later_job_finds_the_earlier_ones_prompts(tiny_models, monkeypatch):
    """The control of the test above: the same two jobs twice on one engine, the reset done
    before the first two and skipped before the last two."""
    from transformers import AutoTokenizer

    from parse_vllm.tools.benchmarks import common
    from parse_vllm.tools.eval.run import _render

    common.setup_env()
    tok = AutoTokenizer.from_pretrained(tiny_models["target"])
    # each question longer than a KV block: a job that found the other's whole prompt cached hits more
    prompts = [
        _render(tok, {"prompt": OPENING + q + " " + " ".join(f"{q.lower()}{i}" for i in range(40))})
        for q in ("First", "Second")
    ]
    job = {"set": "s", "batch": 1, "tau": None, "guard": None, "pass_guard": False, "prompts": prompts,
           "item_ids": ["a", "b"], "config": "target"}  # fmt: skip
    jobs = [dict(job, repeat=r, order=r) for r in range(4)]
    kw = {**run.engine_kwargs({"preset": None, "engine": {"dtype": "float32", "kv_cache_memory_bytes": 96 << 20}},
                              str(tiny_models["target"]), 512, 2)}  # fmt: skip

    class Bar:
        def set_description(self, *a):
            pass

        def update(self, *a):
            pass

        def write(self, *a):
            pass

    resets = []
    real_reset = tools_engine.reset_prefix_cache

    def first_two_only(llm):  # one engine for both halves: the reset before jobs 0 and 1, none before 2 and 3
        resets.append(None)  # counted, the engine not kept
        if len(resets) <= 2:
            real_reset(llm)

    monkeypatch.setattr(tools_engine, "reset_prefix_cache", first_two_only)
    got = run.run_engine("target", kw, jobs, max_tokens=6, is_parse=False, progress=Bar(), warmup=prompts[0])
    hits = [g["prefix_cache"]["hits"] for g in got]
    assert len(resets) == len(jobs) and hits[0] == hits[1] > 0  # one reset asked for before each job
    assert hits[2] > hits[1]  # the reset skipped: job 2 finds job 1's prompts


@pytest.mark.slow
def test_a_cut_run_resumes_at_the_first_job_not_saved(timed, monkeypatch, capsys):
    out = timed["out"]
    path = out / "timings.jsonl"
    lines = path.read_text().splitlines()
    kept = lines[:10]  # the settings and the first 9 jobs
    path.write_text("\n".join(kept) + "\n" + lines[10][: len(lines[10]) // 2])  # the 10th cut mid-line
    ran = []
    real = run.run_engine

    def counting(config, kw, jobs, **k):
        ran.extend((j["config"], j["tau"], j["repeat"]) for j in jobs)
        return real(config, kw, jobs, **k)

    monkeypatch.setattr(run, "run_engine", counting)
    assert cli.main(timed["argv"]) == 0
    assert ran == [("parse W=8 adaptive", 1.5, 1)]
    again = path.read_text().splitlines()
    assert again[:10] == kept and len(again) == 11  # the saved jobs kept as they were
    s = json.loads((out / "summary.json").read_text())
    assert [j["order"] for j in s["jobs"]] == list(range(10))
    # other settings on this folder are refused, saying which
    monkeypatch.setattr(run, "run_engine", lambda *a, **k: pytest.fail("an engine started"))
    capsys.readouterr()
    argv = list(timed["argv"])
    argv[argv.index("--max-tokens") + 1] = "11"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "other settings (args" in err and "--fresh" in err


def test_timings_saved_before_the_process_mode_resume_only_in_one_process(tmp_path):
    """A timings.jsonl written before `processes` was a setting came from one process: it
    resumes a --same-process run and is refused, naming the setting, by a process per job."""
    path = tmp_path / "timings.jsonl"
    job = {"config": "target", "set": "s", "batch": 1, "tau": None, "guard": None, "repeat": 0, "wall_s": 1.0}
    path.write_text(json.dumps({"settings": {"args": {"x": 1}}}) + "\n" + json.dumps(job) + "\n")
    t = run.Timings(path, {"args": {"x": 1}, "processes": "one for the run"}, fresh=False)
    assert list(t.done.values()) == [job]
    with pytest.raises(run.EvalError, match=r"other settings \(processes\)"):
        run.Timings(path, {"args": {"x": 1}, "processes": "one per job"}, fresh=False)


def test_timings_resume_only_on_the_machine_and_boot_that_took_them(tmp_path):
    """Times from two machines are not side by side: a run saved on another machine (or
    before a reboot, or before the machine was recorded) is refused, saying so; on the same
    one it resumes."""
    from parse_vllm.tools.benchmarks import common

    here = common.machine_identity()
    assert here == common.machine_identity() and set(here) == {"cpu", "cores", "memory_gib", "boot"}
    assert here["cores"] >= 1 and here["boot"]
    path = tmp_path / "timings.jsonl"
    job = {"config": "target", "set": "s", "batch": 8, "tau": None, "guard": None, "repeat": 0, "wall_s": 1.0}
    settings = {"args": {"x": 1}, "processes": "one per job", "machine": here}
    path.write_text(json.dumps({"settings": settings}) + "\n" + json.dumps(job) + "\n")
    assert list(run.Timings(path, settings, fresh=False).done.values()) == [job]
    for saved in [dict(here, boot="another-boot"), None]:  # a fresh VM of the same kind; not recorded
        old = {k: v for k, v in settings.items() if k != "machine"} | ({"machine": saved} if saved else {})
        path.write_text(json.dumps({"settings": old}) + "\n" + json.dumps(job) + "\n")
        with pytest.raises(run.EvalError, match="another machine, or before this one rebooted") as e:
            run.Timings(path, settings, fresh=False)
        assert "--fresh" in str(e.value) and ("another-boot" in str(e.value)) == (saved is not None)
        assert path.read_text().count("\n") == 2  # refused: the saved jobs kept
        assert run.Timings(path, settings, fresh=True).done == {}  # --fresh starts over here


@pytest.mark.slow
def test_by_default_every_timed_job_runs_in_a_process_of_its_own_and_a_staged_run_resumes(
    tiny_models, tmp_path, capsys
):
    """The default: the command starts one process per timed job (a long-lived process ages:
    docs/benchmarks.md), each saving its job; `--max-jobs N` stops after N with status 3
    and no report, and the same command goes on from there, keeping the jobs saved. The target
    alone (`--taus` with none: no PARSE engine), twice: a process's job order is the `timed`
    fixture's test."""
    import os

    out = tmp_path / "out"
    argv = [a for a in _argv(tiny_models, out) if a != "--same-process"] + [
        "--prompts", "mtbench", "--bs1-prompts", "0", "--num-prompts", "2", "--batch", "2", "--spec-k",
        "--taus", "--no-nll",
    ]  # fmt: skip
    assert cli.main(argv + ["--max-jobs", "1"]) == 3
    assert "1 jobs left" in capsys.readouterr().out  # the target's second repeat
    lines = (out / "timings.jsonl").read_text().splitlines()
    assert len(lines) == 2 and not (out / "summary.json").exists()
    assert json.loads(lines[0])["settings"]["processes"] == "one per job"
    first = json.loads(lines[1])
    assert (first["config"], first["repeat"], first["process_job"]) == ("target", 0, 0)

    assert cli.main(argv) == 0
    jobs = json.loads((out / "summary.json").read_text())["jobs"]
    assert [(j["config"], j["repeat"]) for j in jobs] == [("target", 0), ("target", 1)]
    pids = [j["pid"] for j in jobs]
    assert len(set(pids)) == 2 and os.getpid() not in pids and pids[0] == first["pid"]
    assert all(j["process_job"] == 0 and j["engine"] == "fresh" for j in jobs)
    records = [json.loads(x) for x in (out / "timings.jsonl").read_text().splitlines()[1:]]
    assert records[0] == first  # the staged job kept as it was saved
    # the mode is part of the settings: the same folder refuses the other one
    assert cli.main(argv + ["--same-process"]) == 2
    assert "other settings (processes)" in capsys.readouterr().err


def test_judge_e2e_issue_37_keys_by_hand(tmp_path):
    """scripts/judge_e2e.py: the head's time per task at batch 1 over the faster of the target
    and token-level k 4, with its interval; the head's semantic share over the tasks whose
    draft-alone answer passes (per-task counters); MBPP test's n and pass@1 (--mbpp)."""
    je = load_script("judge_e2e")
    ids = [f"HumanEval/{2 * i + 1}" for i in range(12)]
    t = np.linspace(4.0, 8.0, 12)

    def row(config, tau, task_s, batch, **kw):
        r = _row(config, tau, task_s, 1200, {"tokens_accepted_semantic": 600}, batch=batch)
        return {**r, "item_ids": ids, **kw}

    per_task = [{"semantic": 80 if i < 6 else 20, "token_level": 5} for i in range(12)]
    rows = [
        row("target", None, t, 1),
        row("token-k4", None, t / 1.2, 1),  # the faster baseline at batch 1
        row("parse W=128 k4", 0.7, t / 1.5, 1),  # the head: 1.2 / 1.5 = 0.8 of k 4's time
        row("parse W=128 k4", 0.0, t / 1.6, 1),
        row("target", None, t, 8),
        row("parse W=128 k4", 0.7, t, 8, task_acceptance=per_task),  # 100 tokens a task (_row)
        row("draft", None, t, 1, correct=[i < 6 for i in range(12)]),  # batch 1: not the head row's
        row("draft", None, t, 8, correct=[i % 2 == 0 for i in range(12)]),  # passes on 0, 2, ..., 10
    ]
    run = tmp_path / "odd"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"rows": rows}))
    mbpp = tmp_path / "mbpp"
    mbpp.mkdir()
    m_rows = [
        dict(row("target", None, t, 8), pass_at_1=0.5),
        dict(row("parse W=128 k4", 0.7, [2 * x for x in t], 8), pass_at_1=0.45),  # half the target's speed
        dict(row("parse W=128 k4", 0.0, [x * (1.1 if i % 2 else 0.9) for i, x in enumerate(t)], 8), pass_at_1=0.25),
    ]
    (mbpp / "summary.json").write_text(json.dumps({"rows": m_rows}))
    (tmp_path / "judge.json").write_text("{}")
    assert je.main([str(run), "--tau", "0.7", "--summary", str(tmp_path / "judge.json"), "--mbpp", str(mbpp)]) == 0
    j = json.loads((tmp_path / "judge.json").read_text())
    assert j["odd_time_per_task_head_over_best_bs1"] == pytest.approx(1.2 / 1.5)
    lo, hi = j["odd_time_per_task_head_over_best_bs1_ci"]
    assert lo <= 0.8 <= hi and j["odd_time_per_task_head_best_baseline_bs1"] == "token-k4"
    # tasks 0, 2, 4 (80 semantic each) and 6, 8, 10 (20 each) of 100 tokens: 300 / 600
    assert j["odd_semantic_share_head_where_draft_passes"] == pytest.approx(0.5)
    assert j["odd_tasks_where_draft_passes"] == 6
    assert j["mbpp_test_e2e_n"] == 12 and j["mbpp_test_pass_at_1_target"] == 0.5
    assert j["mbpp_test_pass_at_1_head"] == 0.45 and j["mbpp_test_pass_at_1_accept_all"] == 0.25
    assert j["mbpp_test_speed_head_over_target_bs8"] == pytest.approx(0.5)
    assert j["mbpp_test_speed_head_over_target_bs8_verdict"] == "slower"
    assert j["mbpp_test_speed_head_over_accept_all_bs8"] == pytest.approx(np.mean(m_rows[2]["task_s"]) / np.mean(2 * t))
    assert j["mbpp_test_speed_accept_all_over_target_bs8_verdict"] == "no difference"
    assert [r["tau"] for r in j["e2e_mbpp_test"]] == [None, 0.7, 0.0]
    # without --tau the head's τ is the one the runs recorded (`eval --taus head`)
    (tmp_path / "judge.json").write_text("{}")
    assert je.main([str(run), "--summary", str(tmp_path / "judge.json")]) == 2  # the run records none
    (run / "summary.json").write_text(json.dumps({"rows": rows, "tau_head": {"tau": 0.7, "judge_head": "h"}}))
    (mbpp / "summary.json").write_text(json.dumps({"rows": m_rows, "tau_head": {"tau": 0.7, "judge_head": "h"}}))
    assert je.main([str(run), "--summary", str(tmp_path / "judge.json"), "--mbpp", str(mbpp)]) == 0
    assert json.loads((tmp_path / "judge.json").read_text())["odd_time_per_task_head_over_best_bs1"] == j[
        "odd_time_per_task_head_over_best_bs1"]  # fmt: skip
    assert je.main([str(run), "--tau", "0.75", "--summary", str(tmp_path / "judge.json")]) == 2  # not the run's τ
    (mbpp / "summary.json").write_text(json.dumps({"rows": m_rows, "tau_head": {"tau": 0.75, "judge_head": "h"}}))
    assert je.main([str(run), "--summary", str(tmp_path / "judge.json"), "--mbpp", str(mbpp)]) == 2
