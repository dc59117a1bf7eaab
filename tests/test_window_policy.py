"""The adaptive window policy (parse_vllm/window_policy.py) on scripted judges and costs:
plain numbers in, decisions out, no engine."""

from __future__ import annotations

import numpy as np
import pytest

from parse_vllm.window_policy import (
    FIRST_BACKOFF,
    MIN_WINDOW,
    CostModel,
    RequestPolicy,
    WindowPolicy,
    expected_taken,
    exploration_bound,
    window_sizes,
)

W = 128


def _steps(policy: WindowPolicy, theta, steps: int, seed: int) -> None:
    """Random engine steps (FEATURES) timed by a linear cost theta."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        fwd = rng.integers(0, 2)
        x = np.array(
            [
                1.0,
                fwd,
                fwd * rng.integers(1, 200),
                rng.integers(0, 32),
                rng.integers(0, 200),
                *[rng.integers(0, 3)] * 1,
                0,
            ]
        )
        x[6] = x[5] * rng.integers(20, 60)
        policy.step_done(float(np.dot(theta, x)), x, rows=1)


def gpu_like(policy: WindowPolicy, steps: int = 80) -> None:
    """A memory-bound GPU: a target forward 20 ms, a draft forward 2 ms, tokens nearly free."""
    _steps(policy, np.array([1e-3, 0.02, 1e-5, 2e-3, 1e-6, 0.02, 1e-5]), steps, 0)


def cpu_like(policy: WindowPolicy, steps: int = 80) -> None:
    """A compute-bound CPU: each target token costs a decode step's worth (20 ms)."""
    _steps(policy, np.array([5e-3, 5e-3, 0.02, 1e-3, 5e-3, 5e-3, 0.02]), steps, 1)


def run(policy: WindowPolicy, judge, answer_tokens: int, k_accepts: float = 2.0):
    """One request writing `answer_tokens` tokens: each window the policy opens is judged
    by `judge(i, w) -> taken` (i: the window's index), a window taken whole unless taken <
    w; the token-level arm accepts `k_accepts` of its k each step. Returns (window lengths
    opened, draft tokens spent on windows, tokens written on the token-level arm)."""
    r = RequestPolicy()
    out = windows_drafted = token_level = 0
    opened = []
    while out < answer_tokens:
        d = policy.decide(r, room=answer_tokens - out)
        if d.window:
            opened.append(d.window)
            windows_drafted += d.window
            taken = judge(len(opened) - 1, d.window)
            policy.window_judged(r, d.window, taken, rejected=taken < d.window)
            out += taken + 1
        else:
            n = 1 + (k_accepts if policy.spec_tokens else 0)
            policy.token_level_verified(r, 1, int(k_accepts))
            policy.tokens_out(r, int(n))
            out += int(n)
            token_level += int(n)
    return opened, windows_drafted, token_level


@pytest.mark.parametrize("answer", [100, 384, 2000])
def test_a_judge_that_always_rejects_costs_a_bounded_exploration(answer):
    """Every window rejected at its first token: windows of MIN_WINDOW at growing
    intervals, never more draft tokens on windows than the stated bound."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    gpu_like(policy)
    opened, drafted, _ = run(policy, lambda i, w: 0, answer)
    assert set(opened) == {MIN_WINDOW}
    assert drafted <= exploration_bound(answer)
    assert exploration_bound(384) == MIN_WINDOW * (1 + int(np.log2(384 / FIRST_BACKOFF + 1)))


def test_a_judge_that_always_accepts_grows_windows_to_w():
    """On a GPU-like cost model, whole windows double from MIN_WINDOW to W and stay there
    (until the answer's end leaves room for less)."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    gpu_like(policy)
    opened, _, token_level = run(policy, lambda i, w: w, 1500)
    assert opened[:4] == [16, 32, 64, 128] and set(opened[4:-2]) == {W}
    assert token_level < MIN_WINDOW  # only a tail too short for a window


def test_a_judge_that_takes_the_first_half_settles_on_short_windows():
    """Half of each window taken: longer windows waste more draft steps than they gain;
    the policy keeps windows short, and never reaches W."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    gpu_like(policy)
    opened, _, _ = run(policy, lambda i, w: w // 2, 1500)
    assert max(opened) < W


def test_alternating_judgments_keep_probing_and_never_run_away():
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    gpu_like(policy)
    opened, _, token_level = run(policy, lambda i, w: w if i % 2 == 0 else 0, 1500)
    assert len(opened) > 4 and max(opened) <= 2 * MIN_WINDOW * 2  # a rejection halves the run of growth
    assert token_level > 0


def test_where_tokens_cost_compute_the_token_level_arm_wins():
    """A CPU-like cost model, a judge that takes half a window: the target's forward over
    a window costs as many steps as it has tokens, so token-level k 4 (2 accepted a
    step) has the higher goodput and the request stays with it (probing only after
    rejections, none here)."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    cpu_like(policy)
    r = RequestPolicy()
    policy.token_level_verified(r, 10, 20)
    assert policy.goodput_token_level(r) > max(policy.goodput_window(0.5, w) for w in window_sizes(W))
    assert policy.decide(r, room=500).window == 0 and r.backoff_left == FIRST_BACKOFF


def test_the_cost_model_recovers_step_costs():
    model = CostModel()
    rng = np.random.default_rng(3)
    theta = np.array([1e-3, 0.02, 0.001, 0.003, 0.0005, 0.02, 0.0002])
    for _ in range(400):
        x = np.concatenate(
            [[1.0, rng.integers(0, 2)], rng.integers(0, 100, 3), [rng.integers(0, 3)], [rng.integers(0, 99)]]
        )
        model.update(x, float(theta @ x))
    assert np.allclose(model.theta, theta, rtol=1e-3, atol=1e-6)
    assert model.cost(np.array([1, 1, 10, 0, 0, 0, 0])) == pytest.approx(0.031, rel=1e-3)


def test_an_idle_gap_is_not_learnt_from():
    model = CostModel()
    x = np.array([1.0, 1, 10, 0, 0, 0, 0])
    for _ in range(20):
        model.update(x, 0.05)
    before = model.theta.copy()
    model.update(x, 30.0)  # the engine sat idle before this step
    assert np.allclose(model.theta, before)


def test_expected_taken_is_the_geometric_mean_run():
    assert expected_taken(0.0, 10) == 0.0
    assert expected_taken(0.5, 1) == pytest.approx(0.5)
    assert expected_taken(0.9, 3) == pytest.approx(0.9 + 0.81 + 0.729)
    assert expected_taken(1.0, 64) == pytest.approx(64, rel=1e-6)
    assert window_sizes(128) == [16, 32, 64, 128] and window_sizes(48) == [16, 32, 48]
