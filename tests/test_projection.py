"""The projection (parse_vllm/tools/benchmarks/projection.py) at batch > 1, by hand: a
gpu_costs.json written out here with round numbers, and every expected figure computed
in the comments, not by the code under test. tests/test_gpu_costs.py has batch 1 and the
end-to-end runs."""

from __future__ import annotations

import pytest

from parse_vllm.tools.benchmarks import projection as pj


def case(kind, batch, new, positions, layer_ms, head_ms, depth=1):
    return {
        "case": kind,
        "batch": batch,
        "new_tokens": new,
        "logit_positions": positions,
        "layer_ms": layer_ms,
        "head_ms": head_ms,
        "model_ms": layer_ms * depth + head_ms,
    }


def _costs() -> dict:
    """Target t (1 layer): layers at batch 2 cost 10 ms for 1 and 2 new tokens per sequence,
    16 for 4 (flat, then 3 ms per token per sequence); its head costs 1 + p/2 ms over p
    positions (1.5, 2, 3, 5 at 1, 2, 4, 8); decode 9.5 ms at batch 1, 12 at batch 2.
    Draft d: decode 2 ms at batch 1, 3 at batch 2."""
    return {
        "device": {"name": "Test GPU"},
        "dtype": "bfloat16",
        "measurement": "by hand",
        "settings": {"context": 1024},
        "pairs": [{"draft": "d", "target": "t"}],
        "models": {
            "t": {
                "geometry": {"num_hidden_layers": 1},
                "cases": [
                    case("decode", 1, 1, 1, 8.0, 1.5),
                    case("window_forward", 1, 4, 4, 12.0, 3.0),
                    case("decode", 2, 1, 2, 10.0, 2.0),
                ],
                "batch_cases": [
                    case("window_forward", 2, 2, 4, 10.0, 3.0),
                    case("window_forward", 2, 4, 8, 16.0, 5.0),
                ],
            },
            "d": {
                "geometry": {"num_hidden_layers": 1},
                "cases": [case("decode", 1, 1, 1, 1.5, 0.5), case("decode", 2, 1, 2, 2.2, 0.8)],
                "batch_cases": [],
            },
        },
        "verify_attention": [],
    }


def _counters(**kw) -> pj.Counters:
    """100 tokens, 50 accepted: 50 target steps, of which 10 windows of W = 3 (40 tokens
    accepted in them), 10 token-level steps of k = 1, 30 plain; 4 passes of C = 3 copies
    of L = 2 tokens; the drafter: 30 rows in 20 calls (1.5 a call)."""
    c = dict(
        tokens=100,
        accepted=50,
        windows=10,
        window_tokens=30,
        accepted_in_windows=40,
        passes=4,
        copies=12,
        suffix_tokens=24,
        token_level_drafts={"draft_model": 10},
        token_level_draft_tokens={"draft_model": 10},
        drafter_calls=20,
        drafter_rows=30,
    )
    return pj.Counters(**{**c, **kw})


def test_batch_curves_interpolate_along_the_batch_and_refuse_past_the_last():
    m = pj.model_costs(_costs(), "t")
    assert m.forward_batches() == [1, 2]
    assert m.layers_by_batch[2] == [(1.0, 10.0), (2.0, 10.0), (4.0, 16.0)]
    assert m.head == [(1.0, 1.5), (2.0, 2.0), (4.0, 3.0), (8.0, 5.0)]
    assert m.layers_at(2, 3) == 13.0  # between 10 at 2 and 16 at 4
    # batch 1.5, 4 tokens a sequence: halfway between 12 (batch 1) and 16 (batch 2)
    assert m.layers_at(1.5, 4) == pytest.approx(14.0)
    assert m.decode_at(1.5) == pytest.approx((9.5 + 12.0) / 2)
    assert m.step_ms(2, 5, 5) == pytest.approx(10 + 3 * 0.5 + 3.5)  # 2.5 tokens a sequence; head(5) = 3.5
    d = pj.model_costs(_costs(), "d")
    assert d.decode_at(1.5) == pytest.approx(2.5) and d.forward_batches() == []
    with pytest.raises(pj.NotProjectable, match=r"t: no decode step measured at batch 3 \(measured at batch 1, 2\)"):
        m.decode_at(3)
    with pytest.raises(pj.NotProjectable, match="d: no window or verification forwards measured at batch 1"):
        d.layers_at(1, 4)


def test_mixture_is_the_multinomial_expectation():
    # 2 requests, each plain (p 0.6, 1 token), a window (0.2, 4 tokens) or token-level (0.2, 2 tokens);
    # cost = the step's tokens squared, 100 when all plain
    kinds = [(0.6, 1.0), (0.2, 4.0), (0.2, 2.0)]
    got = pj._mixture(2, kinds, lambda tokens, plain: 100.0 if plain else tokens**2)
    # (2 plain) 0.36 x 100, (plain + window) 0.24 x 25, (plain + tl) 0.24 x 9, (2 windows) 0.04 x 64,
    # (window + tl) 0.08 x 36, (2 tl) 0.04 x 16
    assert got == pytest.approx(36 + 6 + 2.16 + 2.56 + 2.88 + 0.64)
    # one request: the kinds apart
    assert pj._mixture(1, kinds, lambda t, plain: 7.0 if plain else t) == pytest.approx(0.6 * 7 + 0.2 * 4 + 0.2 * 2)


def test_projection_at_batch_2_by_hand():
    costs = _costs()
    p = pj.project(_counters(), pj.model_costs(costs, "t"), pj.model_costs(costs, "d"), batch=2)
    # a step of 2 requests, each plain 0.6 (1 token), window 0.2 (W + 1 = 4), token-level 0.2 (k + 1 = 2);
    # a step over T tokens costs layers(2, T/2) + head(T), all plain the decode step (12):
    #   2 plain        0.36  x 12
    #   plain + window 0.24  x (layers(2.5) 11.5 + head(5) 3.5 = 15)
    #   plain + tl     0.24  x (layers(1.5) 10 + head(3) 2.5 = 12.5)
    #   2 windows      0.04  x (layers(4) 16 + head(8) 5 = 21)
    #   window + tl    0.08  x (layers(3) 13 + head(6) 4 = 17)
    #   2 tl           0.04  x (layers(2) 10 + head(4) 3 = 13)
    mean_step = 0.36 * 12 + 0.24 * 15 + 0.24 * 12.5 + 0.04 * 21 + 0.08 * 17 + 0.04 * 13
    assert mean_step == pytest.approx(13.64)
    # passes: 10 windows / 4 passes = 2.5 requests a pass, at most 2: layers(2, 3 x 2 / 2 = 3) 13 + head(3) 2.5
    # draft: 30 window + 10 token-level tokens, 1.5 rows a call: 40 / 1.5 steps of decode(1.5) = 2.5
    assert p["time_ms"] == pytest.approx(
        {
            "target_steps": 50 / 2 * 13.64,
            "verification": 4 * 15.5,
            "draft_model": 40 / 1.5 * 2.5,
            "eagle3": 0.0,
            "total": 341.0 + 62.0 + 200 / 3,
        }
    )
    assert p["target_alone_ms"] == 100 / 2 * 12.0
    assert p["speedup"] == pytest.approx(600 / (341 + 62 + 200 / 3))
    assert p["batch"] == 2 and p["notes"] == []
    at = dict(p["at_batch"])
    assert at.pop("step_mix") == pytest.approx({"plain": 0.6, "window": 0.2, "token_level": 0.2})
    assert at == pytest.approx(
        {
            "engine_steps": 25.0,
            "mean_step_ms": 13.64,
            "requests_per_pass": 2.0,
            "rows_per_drafter_call": 1.5,
            "tokens_per_s": 100 / (341 + 62 + 200 / 3) * 1e3,
            "target_tokens_per_s": 100 / 600 * 1e3,
        }
    )
    assert p["step_ms"] == pytest.approx(
        {
            "target_decode": 12.0,
            "window_forward": 15.0,  # one window among 1 plain: 5 tokens
            "verification_pass": 15.5,
            "token_level_forward": 12.5,
            "draft_decode": 2.5,
            "eagle3_token": (10.0 + 2.0) / 2,  # one layer at batch 2 + head(2), per token
        }
    )
    # a window: its slot's share of a decode step (12 / 2) + what it adds to the step (15 - 12) + 3 draft
    # tokens at 2.5 / 1.5 each + 4 / 10 of a pass, for 40 / 10 + 1 tokens, against 6 ms a token
    w = p["per_window"]
    assert w["ms"] == pytest.approx(6 + 3 + 5 + 6.2) and w["tokens"] == 5.0
    assert w["target_ms_per_token"] == 6.0 and w["pays"] and w["ms_per_token"] == pytest.approx(20.2 / 5)


def test_batch_projection_edges():
    costs = _costs()
    t, d = pj.model_costs(costs, "t"), pj.model_costs(costs, "d")
    # nothing accepted: every step all plain, exactly the target alone
    p = pj.project(pj.Counters(tokens=50, accepted=0), t, d, batch=2)
    assert p["speedup"] == 1.0 and p["time_ms"]["total"] == p["target_alone_ms"] == 25 * 12.0
    # a PARSE row without drafter counters: its 30 draft tokens at the draft's batch-1 step, said in a note
    p = pj.project(_counters(drafter_calls=0, drafter_rows=0), t, d, batch=2)
    assert p["time_ms"]["draft_model"] == 40 * 2.0 and p["at_batch"]["rows_per_drafter_call"] == 1.0
    assert p["notes"] == ["no drafter counters in this row: every draft token costed at the draft's batch-1 step"]
    # vLLM's own draft-model proposer (a row without PARSE counters): it drafts for the whole batch
    row = {"config": "token-k1", "tokens": 40, "batch": 2, "n_prompts": 8}
    row["acceptance"] = {"vllm_drafts": 20, "vllm_draft_tokens": 20, "vllm_accepted": 20}
    c = pj.counters_from_row(row)
    assert c.batched_proposer and c.token_level_drafts == {"draft_model": 20}
    p = pj.project(c, t, d, batch=2)
    # 20 target steps, all token-level with 1 draft token: a step of 2 such requests, 4 tokens, costs
    # layers(2, 2) 10 + head(4) 3 = 13; the 20 draft tokens in steps of 2 at 3 ms
    assert p["time_ms"] == pytest.approx(
        {"target_steps": 20 / 2 * 13, "verification": 0, "draft_model": 10 * 3.0, "eagle3": 0, "total": 160.0}
    )
    assert p["notes"] == [] and p["speedup"] == pytest.approx(40 / 2 * 12 / 160)
    # EAGLE-3 at batch 2: a proposal step for both requests, one layer (10) + head(2) (2), 6 ms a token
    p = pj.project(pj.Counters(tokens=20, accepted=0, token_level_draft_tokens={"eagle3": 8}), t, d, batch=2)
    assert p["time_ms"]["eagle3"] == 8 / 2 * 12.0
    # at batch 1 the batch-1 model, its kinds apart
    p1 = pj.project(_counters(), t, d, batch=1)
    assert set(p1["time_ms"]) == {"plain_decode", "window_forwards", "token_level_forwards"} | {
        "verification",
        "draft_model",
        "eagle3",
        "total",
    }
    assert p1["time_ms"]["plain_decode"] == 30 * 9.5 and p1["time_ms"]["window_forwards"] == 10 * (12 + 3)
    with pytest.raises(pj.NotProjectable):
        pj.project(_counters(), t, d, batch=3)


def test_projection_of_batch_rows_at_their_batch_or_their_prompts():
    acc = {"vllm_drafts": 4, "vllm_draft_tokens": 60, "vllm_accepted": 60, "drafts": 4, "draft_tokens": 60}
    acc |= {"drafter_passes": 10, "drafter_rows": 20}
    row = {"config": "parse W=16", "tau": 0.5, "guard": 0, "tokens": 100, "acceptance": acc}
    summary = {
        "rows": [
            {**row, "set": "a", "batch": 2, "n_prompts": 8},
            {**row, "set": "b", "batch": 2, "n_prompts": 8},
            {**row, "set": "a", "batch": 16, "n_prompts": 1},  # one prompt in flight: batch 1
            {**row, "set": "a", "batch": 4, "n_prompts": 8},  # past the largest measured batch
        ]
    }
    proj = pj.projection(_costs(), {"run": summary})
    assert [(r["batch"], r["effective_batch"], r["sets"]) for r in proj["rows"]] == [(2, 2, ["a", "b"]), (16, 1, ["a"])]
    assert [p["batch"] for r in proj["rows"] for p in r["projections"]] == [2, 1]
    assert proj["rows_not_projected"] == [
        "run: parse W=16 τ 0.5 guard 0 at batch 4 (t: no decode step measured at batch 4 (measured at batch 1, 2))"
    ]
    assert proj["assumptions"] == list(pj.ASSUMPTIONS)
    assert any(a.startswith("Batch B > 1 (the row's batch, or its prompt count") for a in pj.ASSUMPTIONS)
    md = "\n".join(pj.section(proj, _costs()))
    speedup = proj["rows"][0]["projections"][0]["speedup"]
    assert f"| run | parse W=16 | 0.5 | 0 | 2 | 200 | 8 | 0.0 | {speedup:.2f} |" in md
    assert "| run | parse W=16 | 0.5 | 0 | 16 (1 in flight) | 100 |" in md
    assert "| t | 2 | 12.000 | 2: 13.00, 4: 21.00 | — |" in md  # the measured costs, per batch
    assert all(f"- {a}" in md for a in pj.ASSUMPTIONS)
    assert "Not projected: run: parse W=16 τ 0.5 guard 0 at batch 4" in md
