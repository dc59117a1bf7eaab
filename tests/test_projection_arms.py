"""The projection's arms (issue 47 item 6: parse_vllm/tools/benchmarks/projection.py's
project_arms): target alone, token-level k 4, PARSE's whole window, chunked judging without
and with the next chunk drafted while the target judges, adaptive. Costs written out here
with round numbers (tests/test_projection.py's), every expected figure computed in the
comments, not by the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parse_vllm import window_policy
from parse_vllm.tools.benchmarks import projection as pj
from tests.test_projection import _costs

ROOT = Path(__file__).resolve().parents[1]

# The target t at batch 1: layers 8 ms for 1 new token, 12 for 4 (8 + 4/3 per token past the first,
# along that segment past 4 too); head(p) = 1.5, 2, 3, 5 at p = 1, 2, 4, 8 (0.5 a position past 4);
# decode 9.5. The draft d: 2 ms a token at batch 1.


def layers(n):  # t's layers at batch 1 over n new tokens
    return 8 + 4 / 3 * (n - 1)


def head(p):
    return 1.5 + 0.5 * (p - 1) if p <= 2 else (2 + 0.5 * (p - 2) if p <= 4 else 3 + 0.5 * (p - 4))


def _continue(**kw) -> pj.Counters:
    """100 tokens, 60 accepted: 4 windows of W = 8, 2 taken whole (16 tokens), 2 rejected after
    taking 2 tokens each (20 accepted in windows); 4 passes of 2 copies of L = 2 tokens."""
    c = dict(
        tokens=100,
        accepted=60,
        windows=4,
        window_tokens=32,
        accepted_in_windows=20,
        passes=4,
        copies=8,
        suffix_tokens=16,
        rejections=2,
        drafter_calls=32,
        drafter_rows=32,
    )
    return pj.Counters(**{**c, **kw})


def _token_level(accepted=50, drafts=25) -> pj.Counters:
    """k = 4 drafts by vLLM's own proposer."""
    return pj.Counters(
        tokens=100,
        accepted=accepted,
        token_level_drafts={"draft_model": drafts},
        token_level_draft_tokens={"draft_model": 4 * drafts},
        batched_proposer=True,
    )


def _models():
    costs = _costs()
    return pj.model_costs(costs, "t"), pj.model_costs(costs, "d")


def test_the_window_split_from_the_counters():
    s = pj.window_split(_continue())
    assert s == {"window": 8.0, "whole": 2, "rejected": 2, "taken_when_rejected": 2.0}
    # nothing rejected: every window whole
    assert pj.window_split(_continue(rejections=0, accepted_in_windows=32))["taken_when_rejected"] == 0.0


def test_arms_at_batch_1_by_hand():
    t, d = _models()
    p = pj.project_arms({"token_level": _token_level(), "continue": _continue()}, t, d, batch=1, requests=1, chunk=4)
    a = p["arms"]
    # whole window: 36 plain steps at 9.5; 4 window forwards over 9 tokens (layers(9) + head(9) = 18.667 + 5.5);
    # 4 passes over 2 x 2 tokens, 2 logits (layers(4) 12 + head(2) 2 = 14); 32 draft tokens at 2 ms
    window_ms = layers(9) + 5.5
    cont = 36 * 9.5 + 4 * window_ms + 4 * 14 + 32 * 2
    assert a["continue"]["ms"] == pytest.approx(cont)
    assert a["continue"]["speedup"] == pytest.approx(100 * 9.5 / cont)
    # a window's own cost: its forward, its 8 draft tokens, one pass
    whole_window = window_ms + 8 * 2 + 14
    assert a["continue"]["window_ms"] == pytest.approx(whole_window)
    assert a["continue"]["discarded_per_rejection"] == 8 - 2  # W - taken
    # chunked, c = 4: a chunk's forward over 4 tokens = layers(4) 12 + head(4) 3 = 15;
    #   taken whole: 8 drafted, J = 2 chunks, 2 copies a window over 2 passes of 1 copy
    #     (layers(2) + head(1)), judge = 15 + pass; no overlap 2 x (4 x 2 + judge)
    pass1 = layers(2) + head(1)
    judge_whole = 15 + pass1
    whole = 2 * (8 + judge_whole)
    #   rejected: min(8, 2 + 4) = 6 drafted, J = 1.5, 2 copies over 1.5 passes of 4/3 copies
    #     (layers(8/3) + head(4/3)), each chunk's judgment carrying 1/1.5 of them
    pass_r = layers(8 / 3) + head(4 / 3)
    judge_rej = 15 + 1.5 * pass_r / 1.5
    rejected = 1.5 * (8 + judge_rej)
    chunked = (whole + rejected) / 2
    assert a["chunked"]["window_ms"] == pytest.approx(chunked)
    assert a["chunked"]["ms"] == pytest.approx(cont + 4 * (chunked - whole_window))
    assert a["chunked"]["discarded_per_rejection"] == pytest.approx(4.0)  # 6 drafted - 2 taken = c
    # overlap: the first chunk's draft (8 ms), then max(8, judge) per further chunk, then the last judgment
    o_whole = 8 + 1 * max(8, judge_whole) + judge_whole
    o_rej = 8 + 0.5 * max(8, judge_rej) + judge_rej
    assert a["chunked_overlap"]["window_ms"] == pytest.approx((o_whole + o_rej) / 2)
    # the draft wrote min(4, judge / 2 ms) = 4 tokens of the next chunk while the failing one was judged
    assert a["chunked_overlap"]["discarded_per_rejection"] == pytest.approx(8.0)
    # token-level k 4: 25 plain steps, 25 forwards over 5 tokens (layers(5) + head(5) 3.5), 100 draft tokens
    tl = 25 * 9.5 + 25 * (layers(5) + 3.5) + 100 * 2
    assert a["token_level"]["ms"] == pytest.approx(tl)
    # adaptive: the fastest arm (overlapped chunks here), no exploration added where a window arm is the best
    best = min(cont, cont + 4 * ((o_whole + o_rej) / 2 - whole_window), tl, a["chunked"]["ms"])
    assert a["adaptive"]["best_arm"] == "chunked_overlap"
    assert a["adaptive"]["ms_per_token"] == pytest.approx(best / 100)
    assert a["adaptive"]["exploration_ms_per_token"] == 0.0
    assert p["adaptive_over_token_level"] == pytest.approx(tl / best)
    assert a["target"] == {"arm": "target", "ms_per_token": 9.5, "speedup": 1.0}


def test_adaptive_pays_its_exploration_bound_where_token_level_wins():
    """Where token-level is the fastest arm, adaptive pays what its exploration can cost: a
    window of min(MIN_WINDOW, W) = 8 where it pays at the engine's reading of the judge
    (its prior 0.98 before any window), then probes after each back-off, each costing what it
    takes beyond token-level's time for the tokens it keeps. A whole window of 8: 8 draft
    tokens (16 ms), a forward over 9 tokens (layers(9) 18.667 + head(9) 5.5), one of the
    `continue` row's passes (14): 54.1667 ms for E[taken | 8, 0.98] + 1 = 49 (1 - 0.98^8) + 1 =
    8.3038 tokens, 6.5231 ms a token. The engine explores request after request while that
    reading says a window pays; here the run is one request."""
    t, d = _models()
    window = 16 + layers(9) + 5.5 + 14
    assert window == pytest.approx(54.1667, abs=1e-4)
    # token-level accepting 80 of 100 (20 forwards over 5 tokens, 80 draft tokens): 4.967 ms a
    # token, faster than a window even if all were kept: no window opens, nothing is added
    tl = 20 * (layers(5) + 3.5) + 80 * 2
    p = pj.project_arms({"token_level": _token_level(80, 20), "continue": _continue()}, t, d, batch=1, requests=1)
    a = p["arms"]
    assert a["token_level"]["ms"] == pytest.approx(tl) and tl / 100 < window / 8.3038
    assert a["adaptive"]["best_arm"] == "token_level"
    assert a["adaptive"]["requests_exploring"] == 0 and a["adaptive"]["probes_per_request"] == 0
    assert a["adaptive"]["exploration_ms_per_token"] == 0.0 and p["adaptive_over_token_level"] == pytest.approx(1.0)
    # token-level accepting 50 (25 plain steps, 25 forwards over 5, 100 draft tokens): 8.583 ms a
    # token, slower than a kept window; `continue`'s windows all rejected at once (11.29 ms a
    # token), so token-level is the fastest arm, and the first window, 8, is explored
    tl = 25 * 9.5 + 25 * (layers(5) + 3.5) + 100 * 2
    lost = _continue(accepted_in_windows=0, accepted=0, rejections=4)
    p = pj.project_arms({"token_level": _token_level(), "continue": lost}, t, d, batch=1, requests=1)
    a = p["arms"]
    assert a["adaptive"]["best_arm"] == "token_level" and tl / 100 > window / 8.3038
    # one request of 100 tokens: a window of 8 (rejected: the judge kept no token), then
    # probes of min(16, W) = 8 at 16 and 48 (112 > 100): 1 + floor(log2(100/16 + 1)) = 3
    # windows, each costing its 54.1667 ms less what token-level takes for the one token it
    # yields (the target's), 8.5833 ms: 45.5833 ms
    assert a["adaptive"]["probes_per_request"] == 3 and a["adaptive"]["requests_exploring"] == 1
    assert window_policy.exploration_bound(100, min_window=8) == 3 * 8
    loss = window - tl / 100
    assert loss == pytest.approx(45.5833, abs=1e-4)
    assert a["adaptive"]["exploration_ms_per_token"] == pytest.approx(3 * loss / 100)
    assert a["adaptive"]["ms_per_token"] == pytest.approx(tl / 100 + 3 * loss / 100)
    # never further below the best arm than that; here below token-level k 4
    assert p["adaptive_over_token_level"] == pytest.approx((tl / 100) / (tl / 100 + 3 * loss / 100))
    assert p["adaptive_over_token_level"] < 1


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("chunk", [1, 2, 4, 8])
@pytest.mark.parametrize("taken", [0, 1, 3, 7])
def test_overlap_never_slower_and_chunks_bound_the_waste(batch, chunk, taken):
    t, d = _models()
    c = _continue(accepted_in_windows=16 + 2 * taken, accepted=56 + 2 * taken)
    rows = {"token_level": _token_level(), "continue": c}
    a = pj.project_arms(rows, t, d, batch=batch, requests=2, chunk=chunk)["arms"]
    assert a["chunked_overlap"]["ms"] <= a["chunked"]["ms"] + 1e-9
    assert a["chunked"]["discarded_per_rejection"] <= chunk + 1e-9
    assert a["chunked_overlap"]["discarded_per_rejection"] <= 2 * chunk + 1e-9
    assert a["continue"]["discarded_per_rejection"] == pytest.approx(8 - taken)
    best = min(a[k]["ms_per_token"] for k in ("token_level", "continue", "chunked", "chunked_overlap"))
    assert best <= a["adaptive"]["ms_per_token"] <= best + a["adaptive"]["exploration_ms_per_token"] + 1e-12
    # chunks of a whole window judge it at once: the whole window's draft, one forward of c tokens
    if chunk == 8:
        assert a["chunked"]["discarded_per_rejection"] == pytest.approx(min(8, taken + 8) - taken)


def test_roofline_costs_and_the_committed_runs_arms():
    costs = pj.roofline_costs("h100")
    t8, d06 = pj.model_costs(costs, "qwen3-8b"), pj.model_costs(costs, "qwen3-0.6b")
    # memory-bound decode: 8B's layer reads 2 x 193M bytes of weights at 0.8 x 3.35 TB/s, + 30 µs
    w = 4096 * 32 * 128 * 2 + 2 * 4096 * 8 * 128 + 3 * 4096 * 12288
    kv = 1024 * 2 * 8 * 128
    layer = 2 * (w + kv) / (3.35e12 * 0.8) * 1e3 + 0.03
    head_ms = 2 * 151936 * 4096 / (3.35e12 * 0.8) * 1e3 + 0.02
    assert t8.decode_at(1) == pytest.approx(36 * layer + head_ms)
    assert 6 < t8.decode_at(1) < 8 and 1 < d06.decode_at(1) < 2
    # a forward over 128 tokens costs about a decode step at batch 1, several at batch 8
    assert t8.forward_ms(128, 128) < 1.01 * t8.decode_at(1)
    assert t8.step_ms(8, 8 * 128, 8 * 128) > 3 * t8.decode_at(8)
    summary = json.loads((ROOT / pj.ARMS_COUNTERS).read_text())
    rows = pj.arm_rows(summary)
    assert sorted(rows) == [1, 8]
    assert set(rows[1][0]) == {"token_level", "continue", "adaptive"} and rows[8][1] == 82
    assert rows[8][0]["continue"].rejections == 55  # the τ_head row, not τ 0's
    proj = pj.arms_projection(costs, summary, "e2e-odd")
    runs = proj["runs"]
    assert [(r["draft"], r["target"], r["batch"]) for r in runs] == [
        ("qwen3-0.6b", "qwen3-8b", 1),
        ("qwen3-0.6b", "qwen3-8b", 8),
        ("qwen3-1.7b", "qwen3-32b", 1),
        ("qwen3-1.7b", "qwen3-32b", 8),
    ]
    for r in runs:
        a = r["arms"]
        assert a["chunked_overlap"]["ms"] <= a["chunked"]["ms"]
        assert a["chunked"]["discarded_per_rejection"] <= 16
        best = max(a[k]["speedup"] for k in ("token_level", "continue", "chunked_overlap"))
        assert a["adaptive"]["speedup"] <= best * (1 + 1e-12)
    md = "\n".join(pj.arms_section(proj))
    assert "| arm | qwen3-0.6b → qwen3-8b, batch 1 | qwen3-0.6b → qwen3-8b, batch 8 |" in md
    assert all(f"- {x}" in md for x in pj.ARM_ASSUMPTIONS)
    assert "a roofline stand-in, not measured" in md
    assert set(proj["assumptions"]) == set(pj.ASSUMPTIONS) | set(pj.ARM_ASSUMPTIONS)


def test_cli_arms(capsys):
    assert pj.main(["roofline:h200", "--arms", "--chunk", "8", str(ROOT / pj.ARMS_COUNTERS)]) == 0
    out = capsys.readouterr().out
    assert "## The arms on H200 (roofline stand-in)" in out and "chunks of 8" in out
    assert "| PARSE chunked, draft ‖ judge |" in out
    with pytest.raises(SystemExit):
        pj.main(["roofline:a100", "--arms"])
