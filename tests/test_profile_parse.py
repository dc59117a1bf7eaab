"""scripts/profile_parse.py: a step's time by part (timers, py-spy frames) and the tables
that compare configurations, on hand-made numbers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "profile_parse.py"


@pytest.fixture(scope="module")
def prof():
    spec = importlib.util.spec_from_file_location("profile_parse", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_part_gets_its_own_time_its_timed_callees_removed(prof):
    now = [0.0]

    def tick(s):
        now[0] += s

    class Runner:
        def execute(self):
            tick(1.0)
            self.forward()
            tick(0.5)

        def forward(self):
            tick(3.0)

    timers = prof.StepTimers(clock=lambda: now[0])
    r = Runner()
    timers.wrap(r, "execute", "execute other")
    timers.wrap(r, "forward", "target forward")
    _, parts = timers.step(lambda: (tick(0.25), r.execute(), r.forward()))
    assert parts == {"engine": 0.25, "execute other": 1.5, "target forward": 6.0}


def test_py_spy_frames_of_vllm_and_parse_go_to_their_parts(prof):
    vllm_draft = [("run_batch", "tools/engine.py"), ("propose_draft_token_ids", "v1/worker/gpu_model_runner.py")]
    assert prof.classify(vllm_draft + [("compute_logits", "models/qwen2.py")]) == "drafter"
    judge = [
        ("ParseRunnerMixin._sample", "parse_vllm/runner.py"),
        ("ParseController.judge", "parse_vllm/controller.py"),
    ]
    assert prof.classify(judge) == "verification"
    assert prof.classify([("GPUModelRunner._sample", "v1/worker/gpu_model_runner.py")]) == "acceptance"
    assert prof.classify([("Scheduler.schedule", "core/sched/scheduler.py")]) == "engine"


def test_the_comparison_pools_repeats_and_reads_parts_over_the_forward(prof):
    def steps(kind, rows, forwards, drafts):
        return [
            {"kind": kind, "rows": rows, "parts": {"target forward": f, "draft model": d}}
            for f, d in zip(forwards, drafts)
        ]

    # k4: forwards 0.6 s, drafts 0.5 s; parse: one slow spell (everything x3) and a window step
    k4 = prof.summarize_steps(steps("token-level", 8, [0.6, 0.6, 0.6], [0.5, 0.5, 0.5]))
    parse_r1 = prof.summarize_steps(steps("token-level", 8, [0.6, 1.8], [0.45, 1.35]) + steps("window", 7, [1], [1]))
    parse_r2 = prof.summarize_steps(steps("token-level", 8, [0.6], [0.45]))
    results = [
        {"config": "k4", "steps": k4},
        {"config": "parse", "steps": parse_r1},
        {"config": "parse", "steps": parse_r2},
    ]
    table = prof.compare(results, "token-level rows=8")
    assert table["k4"]["steps"] == 3 and table["parse"]["steps"] == 3
    assert table["parse"]["total_ms"] == pytest.approx(1e3 * (1.05 + 3.15 + 1.05) / 3)
    assert table["parse"]["median_step_ms"] == pytest.approx(1050)
    assert table["parse"]["over_forward"]["draft model"] == pytest.approx(0.75)  # the slow spell cancels
    assert table["k4"]["step_over_forward"] == pytest.approx(1.1 / 0.6)
    assert [r["median_ms"] for r in table["parse"]["repeats"]] == [2100.0, 1050.0]
