"""`parse-vllm demo --tasks`'s reading of the judge (parse_vllm/tools/demo.py): judgment
records grouped into windows and each window's taken prefix, by hand."""

from __future__ import annotations

import math

import pytest

from parse_vllm.tools.demo import TaskRun, WindowJudged, total_lines, windows_of

PROMPT = 100


def rec(start: int, boundary: int, p: float) -> dict:
    # what controller.judgments holds: the prefix's ids (prompt + answer so far + draft[:boundary])
    # and the log-odds
    return {
        "token_ids": [7] * (PROMPT + start + boundary),
        "boundary": boundary,
        "p_yes": p,
        "logit": math.log(p / (1 - p)),
    }


def test_the_module_docstrings_worked_example():
    records = [
        rec(20, 128, 0.91),  # taken whole at stage one
        rec(149, 128, 0.40),  # the next window fails whole, then its boundaries are judged
        rec(149, 31, 0.88),
        rec(149, 64, 0.52),
        rec(149, 97, 0.81),
        rec(149, 128, 0.40),
    ]
    first, second = windows_of(records, tau=0.7, prompt_len=PROMPT)
    assert (first.start, first.taken, first.length) == (20, 128, 128)
    assert first.verdict() == "taken whole: 128 tokens"
    assert second.start == 149 and second.boundaries == [128, 31, 64, 97, 128]
    assert second.passed == [False, True, False, True, False]
    assert second.taken == 31 and second.verdict() == "cut: 31 of 128 tokens"
    assert second.line() == (
        "window at answer token 149: P(correct) at boundary 128:0.40✗ 31:0.88✓ 64:0.52✗ 97:0.81✓ 128:0.40✗ → cut: 31 of 128 tokens"
    )


@pytest.mark.parametrize(
    "ps, tau, taken",
    [
        ([0.9, 0.9, 0.9], 0.7, 96),  # every boundary passes: the whole window
        ([0.5, 0.9, 0.9], 0.7, 0),  # the first fails: nothing, whatever follows
        ([0.9, 0.9, 0.5], 0.7, 64),
        ([0.01, 0.01, 0.01], 0.0, 96),  # τ 0 passes everything
        ([0.99, 0.99, 0.99], 1.0, 0),  # τ 1 passes nothing
    ],
)
def test_taken_is_the_longest_prefix_whose_boundaries_all_pass(ps, tau, taken):
    (w,) = windows_of([rec(10, b, p) for b, p in zip((32, 64, 96), ps)], tau, PROMPT)
    assert w.taken == taken


def test_a_boundary_judged_twice_counts_by_its_last_judgment():
    w = WindowJudged(0, boundaries=[64, 32, 64], p_yes=[0.1, 0.9, 0.9], passed=[False, True, True])
    assert w.taken == 64 and w.verdict() == "taken whole: 64 tokens"


def test_totals_add_the_tasks_up():
    whole = WindowJudged(0, [32], [0.9], [True])
    rejected = WindowJudged(40, [16, 32], [0.2, 0.9], [False, True])
    parse = [TaskRun(100, 2.0, True, 40, 10, [whole, rejected]), TaskRun(50, 1.0, False, 0, 25, [])]
    target = [TaskRun(100, 8.0, True), TaskRun(48, 4.0, True)]
    lines = total_lines(parse, target)
    assert (
        lines[0] == "totals over 2 tasks: 2 windows judged (1 taken whole, 0 cut, 1 rejected at their first boundary)"
    )
    assert lines[1] == "  PARSE's 150 tokens: 27% taken semantically, 23% token-level, 50% written by the target"
    assert lines[2] == "  tests passed: PARSE 1/2, target alone 2/2"
    assert lines[3].startswith("  time: PARSE 3.0 s, target alone 12.0 s: 4.00x on the same tasks")
