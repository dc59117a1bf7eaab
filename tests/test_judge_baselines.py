"""The judges the head is compared with (tools/judge/baselines.py): the top-k KL against the
exact one, the per-example features by hand. The stage itself runs in test_judge_mbpp.py's
held-out build, against HF forwards of the tiny pair."""

from __future__ import annotations

import numpy as np
import pytest

from parse_vllm.tools.judge import baselines


def _softmax_topk(logits: np.ndarray, k: int):
    lp = logits - np.logaddexp.reduce(logits)
    ids = np.argsort(-lp, kind="stable")[:k]
    return ids, lp[ids]


def test_topk_kl_is_the_exact_kl_when_the_top_set_is_the_vocabulary():
    rng = np.random.default_rng(0)
    for _ in range(20):
        p, q = rng.normal(size=50) * 2, rng.normal(size=50) * 2
        exact = baselines.exact_kl(p[None], q[None])[0]
        got = baselines.topk_kl(*_softmax_topk(p, 50), *_softmax_topk(q, 50), vocab=50)
        assert got == pytest.approx(exact, rel=1e-9, abs=1e-12)
    assert baselines.topk_kl(*_softmax_topk(p, 50), *_softmax_topk(p, 50), vocab=50) == pytest.approx(0, abs=1e-12)


def test_topk_kl_by_hand_with_the_rest_spread():
    """V = 4, k = 1. P's top: token 0 at 0.7, the rest 0.3 over 3 tokens (0.1 each); Q's top:
    token 1 at 0.6, the rest 0.4 over 3 (0.1333 each). U = {0, 1}: P = (0.7, 0.1), Q =
    (0.1333, 0.6), rests P 0.2, Q 0.2667. KL = 0.7 ln(0.7/0.1333) + 0.1 ln(0.1/0.6)
    + 0.2 ln(0.2/0.2667)."""
    q_rest = 0.4 / 3
    want = 0.7 * np.log(0.7 / q_rest) + 0.1 * np.log(0.1 / 0.6) + 0.2 * np.log(0.2 / (1 - q_rest - 0.6))
    got = baselines.topk_kl([0], np.log([0.7]), [1], np.log([0.6]), vocab=4)
    assert got == pytest.approx(want, rel=1e-12)


def test_topk_kl_is_close_on_peaked_distributions():
    """Language-model-like distributions (most mass on a few tokens of a large vocabulary, the
    two models' tails differing by noise): with ~0.6% of the mass outside the top 20 of 5000,
    the KL to within 1% (median). What the top sets cannot see is the tails' own divergence:
    the error grows with the mass outside them (~2% of it: 2% median error; ~10%: 13%), which
    is why the real sets' error is measured on a sample of their answers."""
    rng = np.random.default_rng(1)
    errs = []
    for _ in range(50):
        base = rng.normal(size=5000)
        base[rng.choice(5000, 5, replace=False)] += 12
        p, q = base + rng.normal(size=5000) * 0.3, base + rng.normal(size=5000) * 0.3
        q[rng.integers(5000)] += 4
        exact = baselines.exact_kl(p[None], q[None])[0]
        got = baselines.topk_kl(*_softmax_topk(p, 20), *_softmax_topk(q, 20), vocab=5000)
        errs.append(abs(got - exact) / exact)
    assert np.median(errs) < 0.02 and max(errs) < 0.2, errs


def test_kl_features_over_the_boundarys_window_by_hand():
    """An answer of 10 tokens, W = 4: a boundary at 6 reads tokens 4 and 5; at 4 tokens 0-3."""
    td = np.arange(10, dtype=float)
    dt = 10 * np.arange(10, dtype=float)
    got = baselines.example_kl(
        [{"task": "t", "answer": 0, "length": 6}, {"task": "t", "answer": 0, "length": 4}],
        {("t", 0): np.stack([td, dt])},
        window=4,
    )
    assert got[0].tolist() == pytest.approx([4.5, 5, 4.9, 45, 50, 49])
    assert got[1].tolist() == pytest.approx([1.5, 3, 2.7, 15, 30, 27])
