"""The adaptive window policy (parse_vllm/window_policy.py) on scripted judges and costs:
plain numbers in, decisions out, no engine."""

from __future__ import annotations

import numpy as np
import pytest

from parse_vllm.window_policy import (
    COST_STEPS,
    DRAFTER,
    FEATURES,
    FIRST_BACKOFF,
    MIN_WINDOW,
    CostModel,
    Decision,
    RequestPolicy,
    WindowPolicy,
    expected_drafted,
    expected_taken,
    exploration_bound,
    token_lengths,
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
                rng.integers(0, 4),
            ]
        )
        x[6] = x[5] * rng.integers(20, 60)
        drafter = float(np.dot(theta[DRAFTER], x[DRAFTER]))
        policy.step_done(float(np.dot(theta, x)), x, rows=1, drafter_seconds=drafter)


def gpu_like(policy: WindowPolicy, steps: int = 80) -> None:
    """A memory-bound GPU: a target forward 20 ms, a draft forward 2 ms, tokens nearly free."""
    _steps(policy, np.array([1e-3, 0.02, 1e-5, 2e-3, 1e-6, 0.02, 1e-5, 0]), steps, 0)


def learnt(policy: WindowPolicy, theta: np.ndarray) -> None:
    """The policy's cost model as if it had learnt θ from its engine's steps (COST_STEPS of
    every feature): a window can be priced."""
    policy.costs.theta = theta.copy()
    policy.costs.runs[:] = COST_STEPS


def cpu_like(policy: WindowPolicy, steps: int = 80) -> None:
    """A compute-bound CPU: each target token costs a decode step's worth (20 ms)."""
    _steps(policy, np.array([5e-3, 5e-3, 0.02, 1e-3, 5e-3, 5e-3, 0.02, 0]), steps, 1)


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
            policy.token_level_verified(r, policy.spec_tokens, int(k_accepts))
            policy.tokens_out(r, int(n))
            out += int(n)
            token_level += int(n)
    return opened, windows_drafted, token_level


@pytest.mark.parametrize(
    "answer, windows, bound",
    [
        # Worked by hand. The first window opens at output token 0 and is rejected (1 token
        # out: the target's); each back-off (16, 32, 64, ... output tokens, doubling with
        # every rejection in a row) runs on the token-level arm at 3 tokens a step (k 4, 2
        # accepted + 1), so the probes open at output tokens 0, 19, 53, 120, 250, 509, 1023:
        # 3 of them before token 100, 5 before 384, 7 before 2000.
        # exploration_bound(N) = 16 * (1 + floor(log2(N / 16 + 1))):
        #   N = 100: log2(7.25) = 2.86 -> 3 probes, 48; N = 384: log2(25) = 4.64 -> 5, 80;
        #   N = 2000: log2(126) = 6.98 -> 7, 112.
        (100, 3, 48),
        (384, 5, 80),
        (2000, 7, 112),
    ],
)
def test_a_judge_that_always_rejects_costs_a_bounded_exploration(answer, windows, bound):
    """Every window rejected at its first token: windows of MIN_WINDOW at the back-off's
    doubling intervals, as many as the stated bound allows and no more."""
    assert (MIN_WINDOW, FIRST_BACKOFF) == (16, 16)  # the hand-worked numbers assume these
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    gpu_like(policy)
    opened, drafted, _ = run(policy, lambda i, w: 0, answer)
    assert opened == [MIN_WINDOW] * windows and drafted == bound
    assert exploration_bound(answer) == bound


def test_exploration_bound_at_the_back_off_edges():
    """By hand: N / 16 + 1 reaches 2 (one doubling) at N = 16 and 4 at N = 48."""
    assert [exploration_bound(n) for n in (1, 15, 16, 47, 48)] == [16, 16, 32, 32, 48]
    assert exploration_bound(100, min_window=8, first_backoff=4) == 8 * (1 + 4)  # log2(26) = 4.70


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


CPU_THETA = np.array([5e-3, 5e-3, 0.02, 1e-3, 5e-3, 5e-3, 0.02, 0])  # s per FEATURES unit
GPU_THETA = np.array([1e-3, 0.02, 1e-5, 2e-3, 1e-6, 0.02, 1e-5, 0])


def test_where_tokens_cost_compute_the_token_level_arm_wins():
    """A CPU-like cost (θ = CPU_THETA set, not fitted), batch 1, k 4, chunk 2, 30 suffix
    tokens a judgment; the request's token-level record is 10 drafts of 4 tokens, 2 accepted
    of each (20 survivals, 10 failures).

    By hand: the engine's α (its record is the same) is (20 + 8 · 0.9) / (30 + 8) = 0.715789,
    the request's (20 + 8 · 0.715789) / 38 = 0.677008, so E[accepted | 4] = α (1 - α^4) / (1 -
    α) = 1.655725. The token-level step runs x = [1, 1, k+1, k, a+1+k, 0, 0] = [1, 1, 5, 4,
    6.655725, 0, 0], 0.005 + 0.005 + 0.1 + 0.004 + 0.033279 = 0.147279 s, and (1.655725 + 1) /
    0.147279 = 18.032 tokens/s.
    A window of w runs x = [w/2, 1, w+1, w, 2w, 1, 30] (each of its w/2 steps drafts 2 tokens
    and writes the KV of 2): w 16 costs 0.04 + 0.005 + 0.34 + 0.016 + 0.16 + 0.005 + 0.6 =
    1.166 s and yields E[taken | ρ 0.5] + 1 = 2 - 0.5^16, 1.7152 tokens/s; w 32: 1.702 s,
    1.1751; w 64: 2.774 s, 0.7210; w 128: 4.918 s, 0.4067. The
    token-level arm wins, and the request stays with it for FIRST_BACKOFF tokens: the engine
    and the request have seen windows take 10 tokens over 10 rejections, so ρ is (10 + 32 ·
    0.795) / 52 = 0.682 (the engine's (10 + 32 · 0.98) / 52 = 0.795 its prior)."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    learnt(policy, CPU_THETA)
    r = RequestPolicy()
    for s in (r.stats, policy.prior(r)):
        s.judged_tokens, s.rejections = 10, 10
    assert policy.rho(r) == pytest.approx(0.682, abs=1e-3)
    for _ in range(10):
        policy.token_level_verified(r, 4, 2)
    assert policy.alpha(r) == pytest.approx(0.677008, abs=1e-6)
    assert policy.goodput_token_level(r) == pytest.approx(2.655725 / 0.147279, rel=1e-5)
    got = [policy.goodput_window(0.5, w) for w in window_sizes(W)]
    assert got == pytest.approx([(2 - 0.5**16) / 1.166, 2 / 1.702, 2 / 2.774, 2 / 4.918], rel=1e-4)
    assert policy.decide(r, room=500).window == 0 and r.backoff_left == FIRST_BACKOFF == 16


def test_where_forwards_cost_the_same_for_any_tokens_a_first_window_wins():
    """A GPU-like cost (θ = GPU_THETA), a fresh request: no record, so ρ is the optimistic
    0.98 (32 prior tokens at 0.98) and α the optimistic 0.9.

    By hand: E[accepted | 4] = 0.9 (1 - 0.9^4) / 0.1 = 3.0951; token-level x = [1, 1, 5, 4,
    8.0951, 0, 0]: 0.001 + 0.02 + 5e-5 + 0.008 + 8.0951e-6 = 0.0290581 s, 4.0951 / 0.0290581 =
    140.93 tokens/s. The first window is MIN_WINDOW = 16 tokens:
    x = [8, 1, 17, 16, 32, 1, 30], 0.008 + 0.02 + 1.7e-4 + 0.032 + 3.2e-5 + 0.02 + 3e-4 =
    0.080502 s; E[taken] = 0.98 (1 - 0.98^16) / 0.02 = 49 (1 - 0.723798) = 13.5339, so
    14.5339 / 0.080502 = 180.54 tokens/s: the window wins."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    learnt(policy, GPU_THETA)
    r = RequestPolicy()
    assert policy.rho(r) == pytest.approx(0.98)
    assert policy.goodput_token_level(r) == pytest.approx(4.0951 / 0.0290581, rel=1e-6)
    assert policy.goodput_window(0.98, 16) == pytest.approx(14.5339 / 0.080502, rel=1e-4)
    assert policy.decide(r, room=500).window == 16 and r.backoff_left == 0


def test_at_batch_8_a_request_pays_an_eighth_of_the_drafters_forwards():
    """The token-level arm's k drafter forwards are one pass over every row that drafts, as
    its target forward is one forward over every row: a request's share is k / batch.

    By hand (GPU_THETA, 8 rows a step, a fresh request: α 0.9, E[accepted | 4] 3.0951): x =
    [1/8, 1/8, 5, 4/8, 8.0951, 0, 0]: 1.25e-4 + 0.0025 + 5e-5 + 0.001 + 8.0951e-6 = 0.0036831
    s for 4.0951 tokens, 1111.9 tokens/s (charged the drafter's 4 forwards whole, 0.0106831 s:
    383.3)."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    learnt(policy, GPU_THETA)
    policy.batch = 8.0
    assert policy.token_level_cost(4, 3.0951) == pytest.approx([0.125, 0.125, 5, 0.5, 8.0951, 0, 0, 0.125])
    assert policy.goodput_token_level(RequestPolicy()) == pytest.approx(4.0951 / 0.0036831, rel=1e-5)


def test_the_cost_model_recovers_step_costs():
    model = CostModel()
    rng = np.random.default_rng(3)
    theta = np.array([1e-3, 0.02, 0.001, 0.003, 0.0005, 0.02, 0.0002, 0])
    for _ in range(400):
        x = np.concatenate(
            [[1.0, rng.integers(0, 2)], rng.integers(0, 100, 3), [rng.integers(0, 3)], [rng.integers(0, 99)],
             [rng.integers(0, 4)]]
        )  # fmt: skip
        model.update(x, float(theta @ x), drafter_seconds=float(theta[DRAFTER] @ x[DRAFTER]))
    assert np.allclose(model.theta, theta, rtol=1e-3, atol=1e-6)
    assert model.cost(np.array([1, 1, 10, 0, 0, 0, 0, 0])) == pytest.approx(0.031, rel=1e-3)


def test_an_idle_gap_is_not_learnt_from():
    model = CostModel()
    x = np.array([1.0, 1, 10, 0, 0, 0, 0, 0])
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


def test_given_step_costs_are_used_and_never_refitted():
    """parse.adaptive_step_costs: θ as named (features not named cost 0), whatever steps the
    engine then times, so the GPU-like first decision of the test above holds on any load."""
    named = dict(step=1e-3, target_forward=0.02, target_tokens=1e-5, draft_forwards=2e-3, draft_tokens=1e-6)
    policy = WindowPolicy(
        W,
        spec_tokens=4,
        chunk=2,
        verify_tokens_per_window=30,
        step_costs={**named, "verify_passes": 0.02, "verify_tokens": 1e-5},
    )
    assert np.array_equal(policy.costs.theta, GPU_THETA)
    cpu_like(policy)  # steps timed as a compute-bound CPU: not learnt from
    assert np.array_equal(policy.costs.theta, GPU_THETA)
    assert policy.decide(RequestPolicy(), room=500).window == 16
    assert CostModel(fixed={"draft_tokens": 0.5}).theta.tolist() == [0, 0, 0, 0, 0.5, 0, 0, 0]


def test_judged_in_parts_a_window_costs_what_it_drafts_to_its_first_failure():
    """E[drafted | w] = min(w, E[taken | w] + (1 - ρ^w) part). By hand, part 8 (the prior: the
    chunk, 2, is shorter): ρ 0.5, w 128: E[taken] = 1 - 0.5^128 ≈ 1, so 1 + 8 = 9 drafted;
    ρ 0.8: 4 (1 - 0.8^128) + 8 ≈ 12; ρ 1: all 128.

    On the CPU-like cost at ρ 0.5: 9 drafted over 9 / 8 = 1.125 parts and 9 / 2 = 4.5 steps
    (each writing the KV of 2 tokens): x = [4.5 + 1.125, 1.125, 9 + 1.125, 9, 9 + 9, 1.125,
    1.125 · 30] = [5.625, 1.125, 10.125, 9, 18, 1.125, 33.75], 0.028125 + 0.005625 + 0.2025 +
    0.009 + 0.09 + 0.005625 + 0.675 = 1.015875 s for 2 tokens: 1.97 tokens/s, against 0.4067
    whole (the 128 drafted tokens) and the token-level arm's 18.03 (the first test's
    records), which the policy takes."""
    assert expected_drafted(0.5, 128, 8) == pytest.approx(9.0)
    assert expected_drafted(0.8, 128, 8) == pytest.approx(12.0)
    assert expected_drafted(1.0, 128, 8) == pytest.approx(128.0, rel=1e-4)
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30, judge_chunks=True)
    learnt(policy, CPU_THETA)
    assert policy.window_cost(128, 0.5) == pytest.approx([5.625, 1.125, 10.125, 9, 18, 1.125, 33.75, 4.5])
    assert policy.goodput_window(0.5, 128, parts=True) == pytest.approx(2 / 1.015875, rel=1e-6)
    assert policy.goodput_window(0.5, 128) == pytest.approx(2 / 4.918, rel=1e-4)
    r = RequestPolicy()
    for st in (r.stats, policy.prior(r)):
        st.judged_tokens, st.rejections = 10, 10
    for _ in range(10):
        policy.token_level_verified(r, 4, 2)
    assert policy.decide(r, room=500) == Decision(0, why="token-level pays")


def test_parts_are_chosen_where_whole_windows_would_waste_costly_drafts():
    """A costly drafter (0.02 s a forward), a costly target forward (0.05 s), cheap tokens; the
    token-level arm is the target alone (k 0); the request's last window, 64, was taken whole,
    so a whole window would be 128; its record gives ρ = (37.8 + 32 · 0.98) / (37.8 + 3 + 32) =
    0.95.

    By hand: the target alone, x = [1, 1, 1, 0, 0, 0, 0]: 0.001 + 0.05 + 1e-5 = 0.05101 s a
    token, 19.604 tokens/s. A whole 128: E[taken] = 19 (1 - 0.95^128) = 18.9732, x = [64, 1,
    129, 128, 128, 1, 30]: 0.064 + 0.05 + 0.00129 + 2.56 + 0.000128 + 0.005 + 0.0003 = 2.6807 s,
    7.45 tokens/s. In parts: 18.9732 + 8 (1 - 0.95^128) = 26.962 drafted, 3.3702 parts, 13.481
    steps: 0.7428 s, 19.9732 / 0.7428 = 26.89 tokens/s: the policy opens 128 judged in parts.
    Without judge_chunks the same request stays with the target alone."""
    theta = np.array([1e-3, 0.05, 1e-5, 0.02, 1e-6, 0.005, 1e-5, 0])
    for chunks in (True, False):
        policy = WindowPolicy(W, spec_tokens=0, chunk=2, verify_tokens_per_window=30, judge_chunks=chunks)
        learnt(policy, theta)
        r = RequestPolicy(last_window=64, last_whole=True)
        r.stats.judged_tokens, r.stats.rejections = 37.8, 3
        assert policy.rho(r) == pytest.approx(0.95)
        assert policy.goodput_token_level(r) == pytest.approx(1 / 0.05101, rel=1e-9)
        assert policy.goodput_window(0.95, 128) == pytest.approx(19.9732 / 2.6807, rel=1e-4)
        assert policy.goodput_window(0.95, 128, parts=True) == pytest.approx(19.9732 / 0.7428, rel=1e-3)
        want = Decision(128, parts=True, why="window in parts pays") if chunks else Decision(0, why="token-level pays")
        assert policy.decide(r, room=500) == want


def test_judged_in_parts_a_rejection_is_followed_by_a_back_off_and_a_new_choice_not_a_forced_probe():
    """GPU-like costs, judge_chunks: the first window (a whole 16, the best for a fresh request
    where forwards cost whatever their tokens) is rejected at once; the request backs off for
    FIRST_BACKOFF tokens, and then chooses again by goodput (here: a window again, ρ still high
    from the engine's prior) instead of a forced 16-token probe. The request's drafts were
    never accepted token by token (4 drafts of 4, none taken): α = 0.4 (the engine's (7.2 /
    12) = 0.6 as its prior), E[accepted | 4] = 0.6496, 56.8 tokens/s on the token-level arm."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30, judge_chunks=True)
    learnt(policy, GPU_THETA)
    r = RequestPolicy()
    for _ in range(4):
        policy.token_level_verified(r, 4, 0)
    assert policy.alpha(r) == pytest.approx(0.4)
    first = policy.decide(r, room=500)
    assert first == Decision(16, why="window pays")  # 180.58 tokens/s whole, 114.48 in parts, 56.8 token-level
    policy.window_judged(r, 16, 0, rejected=True)
    assert policy.decide(r, room=500) == Decision(0, why="backing off") and r.backoff_left == FIRST_BACKOFF
    policy.tokens_out(r, FIRST_BACKOFF)
    again = policy.decide(r, room=500)
    assert again.window and again.probe and r.probes == 1 and again.why in ("window pays", "window in parts pays")
    assert policy.decide(r, room=0) == Decision(0, why="no room")


# A target forward that costs what its weights cost to read (0.2 s, 1 ms a token) beside a
# drafter whose tokens cost compute (1 ms a forward, 20 ms a token): drafting pays for one
# request and not for eight.
DRAFTER_BOUND = np.array([1e-3, 0.2, 1e-3, 1e-3, 0.02, 0.02, 1e-4, 0])


def test_the_token_level_arm_may_draft_any_power_of_two_up_to_its_k_or_nothing():
    assert token_lengths(4) == [0, 1, 2, 4] and token_lengths(3) == [0, 1, 2, 3]
    assert token_lengths(1) == [0, 1] and token_lengths(0) == [0]


@pytest.mark.parametrize("n, k", [(1, 4), (8, 0)])
def test_the_token_level_k_is_the_batchs_best(n, k):
    """DRAFTER_BOUND, fresh requests (α the optimistic 0.9, so E[accepted | k] = 0.9, 1.71,
    3.0951 at k 1, 2, 4). A step at k over n rows runs x = [1, 1, n(k + 1), k, n(E + 1) + nk,
    0, 0] (the drafter passes each row's accepted tokens and the target's, then drafts k).

    By hand, batch 1: k 0 costs 0.001 + 0.2 + 0.001 = 0.202 s for 1 token, 4.95 tokens/s;
    k 1: 0.262 s for 1.9, 7.25; k 2: 0.3002 s for 2.71, 9.03; k 4: 0.001 + 0.2 + 0.005 +
    0.004 + 0.02 · 8.0951 = 0.371902 s for 4.0951, 11.01: k 4. Batch 8: k 0 costs 0.209 s for
    8 tokens, 38.28 tokens/s; k 1: 0.682 s for 15.2, 22.29; k 2: 0.9806 s for 21.68, 22.11; k
    4: 1.540216 s for 32.76, 21.27: the target alone."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    learnt(policy, DRAFTER_BOUND)
    rows = [RequestPolicy() for _ in range(n)]
    assert policy.choose_token_k(rows) == k == policy.token_k
    assert policy.costs.cost(policy.token_level_step_cost(4, [3.0951] * n)) == pytest.approx(
        0.371902 if n == 1 else 1.540216, rel=1e-6
    )
    assert policy.choose_token_k([]) == k  # no row on the arm: the choice stands


def test_a_request_whose_drafts_are_rejected_stops_drafting():
    """Batch 1, DRAFTER_BOUND: with α 0.9 the arm drafts 4 (the test above); a request whose
    drafts of 4 are all rejected at their first token has α = 8 · 0.9 / (8 + n) after n of
    them (the engine's record being the same), and by 8 the target alone pays more."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    learnt(policy, DRAFTER_BOUND)
    r = RequestPolicy()
    for _ in range(8):
        policy.token_level_verified(r, 4, 0)
    assert policy.prior(r).alpha(0.9) == pytest.approx(0.45)
    assert policy.choose_token_k([r]) == 0


def test_steps_that_always_draft_k_tokens_still_tell_the_drafters_cost_from_the_targets():
    """Every step drafts 4 tokens per row, so the drafter's forwards are constant and its
    tokens move with the target's: fitted to the step time alone the two could not be told
    apart. Fitted beside the drafter's own time, both are recovered."""
    model = CostModel()
    rng = np.random.default_rng(5)
    theta = DRAFTER_BOUND.copy()
    for _ in range(300):
        n = int(rng.integers(1, 9))
        x = np.array([1.0, 1, 5 * n, 4, 9 * n, 0, 0, 1])
        model.update(x, float(theta @ x), drafter_seconds=float(theta[DRAFTER] @ x[DRAFTER]))
    drafter_at_4 = np.array([0, 0, 0, 4, 36, 0, 0, 0])  # k 4 over 4 rows: the drafter's part
    assert model.cost(drafter_at_4) == pytest.approx(theta @ drafter_at_4, rel=1e-3)
    target_alone = np.array([1.0, 1, 8, 0, 0, 0, 0, 0])  # k 0 over 8 rows: never run, yet priced
    assert model.cost(target_alone) == pytest.approx(theta @ target_alone, rel=0.05)


@pytest.mark.parametrize("n, k", [(1, 4), (8, 0)])
def test_an_engine_learns_its_k_from_its_own_steps(n, k):
    """A simulated engine of n requests on the token-level arm, timed as DRAFTER_BOUND with
    noise, each draft token accepted with probability 0.93: the policy starts from nothing
    (every cost 0, so drafting looks free: it drafts spec_tokens) and, from the steps it
    times and the drafts it sees verified, settles on the batch's best k."""
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    rows = [RequestPolicy() for _ in range(n)]
    rng = np.random.default_rng(n)
    chosen = []
    for _ in range(200):
        k = policy.choose_token_k(rows)
        chosen.append(k)
        accepted = [int(np.argmin(np.append(rng.random(k) < 0.93, False))) for _ in rows]
        drafted = sum(a + 1 for a in accepted) + n * k if k else 0
        x = np.array([1.0, 1, n * (k + 1), k, drafted, 0, 0, k > 0])
        seconds = DRAFTER_BOUND @ x * rng.uniform(0.9, 1.1)
        policy.step_done(seconds, x, rows=n, drafter_seconds=DRAFTER_BOUND[DRAFTER] @ x[DRAFTER])
        for r, a in zip(rows, accepted):
            if k:
                policy.token_level_verified(r, k, a)
    assert chosen[0] == 4  # nothing known: drafting is free
    assert chosen[-100:] == [k] * 100


def test_the_drafters_clock_counts_only_its_spans_and_starts_again_when_read():
    import time

    from parse_vllm.clock import SpanClock

    clock = SpanClock("cpu")
    t0 = time.perf_counter()
    with clock.span():
        time.sleep(0.02)
    time.sleep(0.05)  # outside any span
    with clock.span():
        time.sleep(0.01)
    outside = time.perf_counter() - t0
    seconds = clock.take()
    assert 0.03 <= seconds < outside - 0.04
    assert clock.take() == 0.0


def test_a_disabled_drafters_clock_keeps_nothing():
    import time

    from parse_vllm.clock import SpanClock

    clock = SpanClock("cpu", enabled=False)
    with clock.span():
        time.sleep(0.01)
    assert clock.take() == 0.0


def test_judged_windows_are_the_token_level_arms_evidence():
    """A window's draft is the token-level arm's drafter's, so the controller counts its
    leading run of tokens the target would have taken token-level (l_tok) into α: a
    rejected window of 64 with 5 such tokens is 5 survivals and a failure, one taken
    token-level whole 64 survivals, a judged part that committed 30 of 48 with l_tok 40
    counts its 30 (the other 18 are offered again with the next part). Nothing is counted
    where another proposer (EAGLE-3) drafts for the token-level arm."""
    from types import SimpleNamespace

    from parse_vllm.config import ParseConfig, request_options
    from parse_vllm.controller import ParseController
    from parse_vllm.policy import RequestState
    from parse_vllm.windows import OpenWindow

    cfg = ParseConfig.from_dict({"on_reject": "adaptive", "judge_chunks": True})

    def controller(token_proposer=None):
        ctl = ParseController(
            cfg,
            W,
            None,
            np.zeros(8, dtype=bool),
            SimpleNamespace(suffix_len=20),
            [],
            "m",
            token_proposer=token_proposer,
        )
        for req in "abc":
            ctl.states[req] = RequestState(request_options(None, cfg), adaptive=RequestPolicy(), arm_window=64)
        ctl.windows["c"] = OpenWindow(list(range(49)), start=10, length=64, stops=frozenset(), judging=True)
        batch = SimpleNamespace(l_tok=np.array([5, 64, 40]))
        result = SimpleNamespace(
            text_len=np.array([64, 64, 48]),
            commit=np.array([False, False, True]),
            accepted=np.array([5, 64, 30]),
            rejected=np.array([True, False, False]),
            judged=np.array([True, False, True]),
            guard_cut=np.zeros(3, dtype=bool),
            cut=np.zeros(3, dtype=bool),
            first_fail=np.array([0, -1, -1]),
        )
        ctl._apply(["a", "b", "c"], batch, result)
        return ctl

    ctl = controller()
    seen = {req: (s.adaptive.stats.token_accepted, s.adaptive.stats.token_failures) for req, s in ctl.states.items()}
    assert seen == {"a": (5, 1), "b": (64, 0), "c": (30, 0)}
    engine = ctl.policy.prior(ctl.states["a"].adaptive)
    assert (engine.token_accepted, engine.token_failures) == (99, 1)
    assert ctl.windows["c"].taken == 30  # the part committed, the window goes on
    eagle = controller("eagle3")
    assert all(s.adaptive.stats.token_accepted == s.adaptive.stats.token_failures == 0 for s in eagle.states.values())


# This CPU at batch 1 on the Coder pair (float32), as the goal runs time it: a target forward
# 0.25 s plus 20 ms a token, a drafter forward 85 ms plus 3 ms a token and 80 ms a call, a
# step's host work 2 ms, a verification pass a target forward (bench/adaptive/coder-odd-bs1,
# 2026-11-29: k 4 0.70 s a step; a window's drafting step, one call of 2 forwards, 0.25 s).
CPU_BS1 = np.array([0.002, 0.25, 0.02, 0.085, 0.003, 0.25, 0.02, 0.08])


def _engine_at_batch_1(policy, theta, rho: float, alpha: float, requests: int, seed: int):
    """Requests of 300 tokens one after another, every step timed as theta · x: a window is
    drafted 2 tokens a step (x = [1, 0, 0, 2, 4, 0, 0, 1]: one call, no target forward; the
    KV of 2 tokens written, 2 drafted) and judged in one step ([1, 1, w + 1, 0, 0, 1, 30, 0]),
    its tokens kept in a row with probability `rho`; a token-level step at k drafts k tokens
    in one call, each accepted in a row with probability `alpha`. policy None: plain
    token-level k 4. Returns (seconds, tokens, windows opened)."""
    rng = np.random.default_rng(seed)
    seconds = tokens = opened = 0.0

    def step(x):
        nonlocal seconds
        t = float(theta @ x)
        seconds += t
        if policy is not None:
            policy.step_done(t, x, rows=1, drafter_seconds=float(theta[DRAFTER] @ x[DRAFTER]))

    for _ in range(requests):
        r, out = RequestPolicy(), 0
        # the prompt's prefill: 150 target tokens, the drafter's catch-up over them and its
        # first k 4 drafts, in one call
        step(np.array([1.0, 1, 150, 4, 154, 0, 0, 1]))
        while out < 300:
            d = policy.decide(r, room=300 - out) if policy is not None else Decision(0)
            if d.window:
                opened += 1
                for _ in range(-(-d.window // 2)):
                    step(np.array([1.0, 0, 0, 2, 4, 0, 0, 1]))
                step(np.array([1.0, 1, d.window + 1, 0, 0, 1, 30, 0]))
                taken = min(int(rng.geometric(1 - rho)) - 1, d.window)
                policy.window_judged(r, d.window, taken, rejected=taken < d.window)
                out += taken + 1
                continue
            k = policy.choose_token_k([r]) if policy is not None else 4
            a = min(int(rng.geometric(1 - alpha)) - 1, k)
            step(np.array([1.0, 1, k + 1, k, a + 1 + k if k else 0, 0, 0, k > 0]))
            if policy is not None:
                policy.token_level_verified(r, k, a)
                policy.tokens_out(r, a + 1)
            out += a + 1
        tokens += out
    return seconds, tokens, opened


@pytest.mark.parametrize("rho", [0.997, 0.9])
@pytest.mark.parametrize("call", [0.0, CPU_BS1[-1]])
def test_at_batch_1_on_this_cpu_the_policy_stays_with_k4(rho, call):
    """An engine that has seen nothing (costs unknown) beside plain k 4 at this CPU's batch-1
    costs, the token-level arm accepting with α 0.94 (odd's k 4 rows), over 12 requests and 4
    more, with and without the drafter call's 80 ms, with a judge that keeps 99.7% of tokens
    in a row (odd's `continue` rows) or 90%. No window opens before the engine has timed
    COST_STEPS steps (the first request's prefill and decoding steps), and a verification
    pass is priced as a target forward until one is timed; by then a first window of 16 does
    not pay where a judgment costs a forward and a pass and the drafter costs nearly what a
    token-level step yields. So the engine stays within 2% of k 4 (what windows it opens are
    a request's whose own drafts went badly, and no probe is forced where even a judge taking
    everything would not pay), and none opens in the later requests. (Windows that would pay
    only when long, a judge keeping 99.7% with free drafter calls, are not found: the price
    of a first window of 16.)"""
    theta = np.append(CPU_BS1[:-1], call)
    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    s, n, opened = _engine_at_batch_1(policy, theta, rho, 0.94, requests=12, seed=1)
    s_k4, n_k4, _ = _engine_at_batch_1(None, theta, rho, 0.94, requests=12, seed=1)
    s2, n2, late = _engine_at_batch_1(policy, theta, rho, 0.94, requests=4, seed=2)
    s2_k4, n2_k4, _ = _engine_at_batch_1(None, theta, rho, 0.94, requests=4, seed=2)
    assert (n / s) / (n_k4 / s_k4) > 0.98 and (n2 / s2) / (n2_k4 / s2_k4) > 0.98
    # without the call's cost drafting looks cheap, yet no window opens; with it, the few
    # that open are a request's whose own k 4 drafts went badly
    assert late == 0 and opened <= (6 if call else 0)
    # the host's work told from the forward, and the call from the forwards
    got = policy.costs.as_dict()["seconds"]
    assert got["step"] < 0.01 and got["target_forward"] == pytest.approx(theta[1], rel=0.2)


def test_steps_without_a_window_for_long_neither_overflow_the_fit_nor_lose_the_next_window():
    """40,000 decoding steps and no window: forgetting would inflate the verification pass's
    variance 0.98^-40000-fold (past a float's range: the fit turned NaN at some 35,000 steps);
    capped at P_MAX, the fit stays finite and the next window's judgment step is learnt."""
    from parse_vllm.window_policy import P_MAX

    model = CostModel()
    x = np.array([1.0, 1, 5, 4, 9, 0, 0, 1])
    for _ in range(40_000):
        model.update(x, float(CPU_BS1 @ x), drafter_seconds=float(CPU_BS1[DRAFTER] @ x[DRAFTER]))
    assert np.all(np.isfinite(model.theta)) and np.all(np.isfinite(model.P)) and model.P.max() <= P_MAX * (1 + 1e-9)
    judged = np.array([1.0, 1, 17, 0, 0, 1, 30, 0])
    model.update(judged, float(CPU_BS1 @ judged))
    assert model.cost(judged) == pytest.approx(CPU_BS1 @ judged, rel=0.02)
    assert model.cost(x) == pytest.approx(CPU_BS1 @ x, rel=0.02)


def test_a_first_drafting_step_is_learnt_from_though_predicted_at_nothing():
    """An engine whose token-level arm is the target alone (spec_tokens 0) never timed the
    drafter: a window's first drafting step is predicted at the step's host work, nearly 0
    (the prior gives decoding steps' common cost to the forward), 20 times less than it
    takes. It ran features no step had, so it is learnt from, not dropped as an idle gap."""
    model = CostModel()
    decode = np.array([1.0, 1, 1, 0, 0, 0, 0, 0])
    for _ in range(10):
        model.update(decode, float(CPU_BS1 @ decode))
    drafting = np.array([1.0, 0, 0, 2, 4, 0, 0, 1])
    assert model.cost(drafting) < float(CPU_BS1 @ drafting) / 20
    model.update(drafting, float(CPU_BS1 @ drafting), drafter_seconds=float(CPU_BS1[DRAFTER] @ drafting[DRAFTER]))
    assert model.cost(drafting) > 0.8 * float(CPU_BS1 @ drafting)  # (one step of RLS: most of the way)
    model.update(decode, 30.0)  # an idle gap before a step of known features is still dropped
    assert model.cost(decode) == pytest.approx(CPU_BS1 @ decode, rel=0.05)


def test_no_window_opens_before_the_engine_has_timed_its_steps():
    """A fresh engine on GPU-like costs: every cost is the prior's nothing, so a window's
    drafting looks free; until COST_STEPS steps ran the target's forward and the drafter,
    every request stays on the token-level arm ("learning costs"). The eighth step (a prefill
    and seven k 4 decoding steps) makes the costs known, and the first window of 16 opens,
    because on these costs it pays. Given step costs need no wait."""
    from parse_vllm.window_policy import LEARNING_COSTS

    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    r = RequestPolicy()
    steps = [np.array([1.0, 1, 150, 4, 154, 0, 0, 1])] + [np.array([1.0, 1, 5, 4, 9, 0, 0, 1])] * (COST_STEPS - 1)
    for x in steps:
        assert policy.decide(r, room=500) == Decision(0, why=LEARNING_COSTS) and not policy.costs_learnt()
        policy.step_done(float(GPU_THETA @ x), x, rows=1, drafter_seconds=float(GPU_THETA[DRAFTER] @ x[DRAFTER]))
    assert policy.costs_learnt()
    assert policy.decide(r, room=500) == Decision(16, why="window pays")
    given = WindowPolicy(
        W, spec_tokens=4, chunk=2, verify_tokens_per_window=30, step_costs=dict(zip(FEATURES, GPU_THETA))
    )
    assert given.decide(RequestPolicy(), room=500) == Decision(16, why="window pays")


def test_a_verification_pass_is_priced_as_a_target_forward_until_one_is_timed():
    """After decoding steps only, the fit has never seen a verification pass; priced at the
    prior's nothing, a judgment would be free. It is priced as a target forward over its
    tokens (here 0.25 s + 30 x 0.02 s = 0.85 s) until a pass is timed, then as timed (0.3 s
    + 30 x 0.03 s = 1.2 s, learnt over a few judgments)."""
    theta = np.array([0.002, 0.25, 0.02, 0.085, 0.003, 0.3, 0.03, 0.08])
    model = CostModel()
    for x in [np.array([1.0, 1, 150, 4, 154, 0, 0, 1])] + [np.array([1.0, 1, 5, 4, 9, 0, 0, 1])] * 20:
        model.update(x, float(theta @ x), drafter_seconds=float(theta[DRAFTER] @ x[DRAFTER]))
    judgment = np.array([0.0, 0, 0, 0, 0, 1, 30, 0])
    assert model.cost(judgment) == pytest.approx(0.85, rel=0.01)
    for w in (16, 32, 16, 64, 16, 32, 16, 32, 16, 64):
        x = np.array([1.0, 1, w + 1, 0, 0, 1, 30 + w % 7, 0])
        model.update(x, float(theta @ x))
    assert model.cost(judgment) == pytest.approx(1.2, rel=0.05)


def test_where_the_draft_model_does_not_draft_token_level_only_the_forward_is_waited_for():
    """With a token proposer (EAGLE-3) writing the token-level drafts, or vLLM's whole-batch
    proposer, no token-level step counts the draft model: its cost is learnt from the first
    windows. The policy waits for COST_STEPS target forwards only, else it would wait
    forever. The controller says which (`token_drafts_counted`)."""
    from types import SimpleNamespace

    from parse_vllm.config import ParseConfig
    from parse_vllm.controller import ParseController
    from parse_vllm.window_policy import LEARNING_COSTS

    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    policy.token_drafts_counted = False
    r = RequestPolicy()
    x = np.array([1.0, 1, 5, 0, 0, 0, 0, 0])
    for _ in range(COST_STEPS):
        assert policy.decide(r, room=500) == Decision(0, why=LEARNING_COSTS)
        policy.step_done(float(GPU_THETA @ x), x, rows=1)
    assert policy.costs_learnt() and policy.decide(r, room=500).window == 16

    def controller(token_proposer):
        cfg = ParseConfig.from_dict({"on_reject": "adaptive", "spec_tokens": 4})
        args = (cfg, W, None, np.zeros(8, dtype=bool), SimpleNamespace(suffix_len=20), [], "m")
        return ParseController(*args, token_proposer=token_proposer)

    assert controller(None).policy.token_drafts_counted and not controller("eagle3").policy.token_drafts_counted


def test_a_probe_is_forced_only_where_a_judge_taking_every_token_would_pay():
    """After a rejected window's back-off, a request probes with a window of 16 whatever its
    ρ, to test the judge again: on GPU-like costs. On CPU-like ones even a judge that kept
    every token would not make the window pay (drafting costs what the token-level arm
    yields), so there is nothing to test: the request stays on the token-level arm for the
    same back-off again. Where a judgment costs 0.5 s, a window of 16 would not pay even taken
    whole (17 tokens in 0.56 s, 30 a second, against the token-level arm's 141) but one of
    128 would (129 in 0.84 s, 153 a second): the probe is still forced (any window up to W)."""
    long_only = GPU_THETA.copy()
    long_only[5] = 0.5
    for theta, want in (
        (GPU_THETA, Decision(16, probe=True, why="probe")),
        (long_only, Decision(16, probe=True, why="probe")),
        (CPU_THETA, Decision(0, why="token-level pays")),
    ):
        policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
        learnt(policy, theta)
        r = RequestPolicy(last_window=16, failed_in_row=2)
        assert policy.decide(r, room=500) == want
        assert r.backoff_left == (0 if want.window else 2 * FIRST_BACKOFF)


def test_a_request_on_the_target_alone_forgets_its_drafts_and_drafts_again():
    """A request whose first 8 drafts went badly (3 tokens accepted, 5 drafts failing) reads
    α (3 + 8 x 0.94) / 16 = 0.66 against the engine's 0.94; at this CPU's batch-1 costs the
    target alone (k 0) then pays best, and drafting nothing it would gather no evidence to
    change that. Each step on k 0 keeps ALPHA_FORGET of its own record, so its α returns
    towards the engine's and it drafts again."""
    from parse_vllm.window_policy import ALPHA_FORGET

    policy = WindowPolicy(W, spec_tokens=4, chunk=2, verify_tokens_per_window=30)
    learnt(policy, CPU_BS1)
    r = RequestPolicy()
    engine = policy.prior(r)
    engine.token_accepted, engine.token_failures = 9400.0, 600.0
    r.stats.token_accepted, r.stats.token_failures = 3.0, 5.0
    assert policy.alpha(r) == pytest.approx((3 + 8 * 0.94) / 16, abs=1e-3)
    assert policy.choose_token_k([r]) == 0
    assert (r.stats.token_accepted, r.stats.token_failures) == pytest.approx((3 * ALPHA_FORGET, 5 * ALPHA_FORGET))
    # one step later α = (2.7 + 7.52) / 15.2 = 0.672: k 2 yields 2.124 tokens in 0.574 s,
    # 3.70 a second, past the target alone's 1 / 0.272 = 3.68; its drafts, accepted, lead to k 4
    assert [policy.choose_token_k([r]) for _ in range(5)] == [2] * 5
    for _ in range(20):
        policy.token_level_verified(r, 2, 2)
    assert policy.alpha(r) > 0.9 and policy.choose_token_k([r]) == 4
