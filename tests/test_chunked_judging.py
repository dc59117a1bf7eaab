"""Judging a window while it is drafted (`judge_chunks`, issue 47 item 3), through
`LLM(...)` on the tiny models in float32: each part of a window drafted since its last
judgment goes to the target once it holds a boundary, its passing prefix is taken, and the
window stops at its first failing boundary. The maximal valid prefix is a first-failure
rule and a boundary's judgment reads only the tokens before it, so the text is the whole
window's at the same τ -- over a batch whose windows are taken in part, whole and not at
all -- while a rejection throws away far fewer draft tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import GPU_COSTS, PROMPTS, close_llm, make_llm, parse_kwargs

import parse_vllm

pytestmark = pytest.mark.slow

WINDOW, CHUNK = 32, 4
# One-stage judging, every boundary kept (no thinning to max_boundaries), a cut every 6
# tokens of the window: most chunks end between two cuts, so a judged part leaves a tail
# that is judged again with the next chunk.
JUDGING = dict(two_stage=False, boundaries="tokens", every=6, max_boundaries=64, record_judgments=4096)


@pytest.fixture(scope="module")
def engines(tiny_models):
    chunked = make_llm(**parse_kwargs(tiny_models, window=WINDOW, draft_chunk=CHUNK, judge_chunks=True, **JUDGING))
    whole = make_llm(**parse_kwargs(tiny_models, window=WINDOW, draft_chunk=CHUNK, **JUDGING))
    yield chunked, whole
    close_llm(chunked)
    close_llm(whole)


def _params(tau: float, max_tokens: int = 96):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"parse_threshold": tau})


def _run(llm, tau: float, prompts=PROMPTS):
    parse_vllm.reset_stats(llm)
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _params(tau))]
    return out, parse_vllm.get_stats(llm)


def _middle_tau(llm) -> float:
    """A τ between the judge's answers on these prompts: about half its judgments pass, so
    windows are taken in part, whole and not at all. The widest gap between two of the
    middle half of its P(yes), so that no judgment sits at τ within float noise (a whole
    window's forward and a part's differ in the last bits)."""
    _run(llm, 1e-9)  # (τ 0 passes every window unjudged; this one judges them all, and passes them)
    p = np.unique([j["p_yes"] for j in parse_vllm.get_judgments(llm)])
    assert p.shape[0] >= 20, "the run judged too few boundaries to place τ"
    mid = p[p.shape[0] // 4 : 3 * p.shape[0] // 4 + 1]
    i = int(np.argmax(np.diff(mid)))
    return float((mid[i] + mid[i + 1]) / 2)


def test_chunked_judging_takes_the_whole_windows_text_and_discards_less(engines):
    chunked, whole = engines
    tau = _middle_tau(whole)
    want, w = _run(whole, tau)
    got, c = _run(chunked, tau)
    assert got == want
    # the windows: some rejected with a prefix taken, some at their first boundary, some whole
    by_boundary = w["rejections_by_boundary"]
    assert w["rejections"] > 0 and by_boundary.get(0, 0) > 0 and sum(v for k, v in by_boundary.items() if k != 0) > 0
    assert w["drafts_accepted_whole"] > 0, w
    # chunked: parts taken while the windows went on, the same rejections, fewer tokens thrown away each
    assert c["chunk_commits"] > 0 and c["rejections"] == w["rejections"], (c, w)
    assert c["draft_tokens_discarded"] / c["rejections"] < w["draft_tokens_discarded"] / w["rejections"] / 2, (c, w)
    assert c["draft_tokens_discarded"] / c["rejections"] <= CHUNK + 6  # at most the judged part: a chunk and a tail
    print(f"τ {tau:.9f}: discarded per rejection, whole {w['draft_tokens_discarded'] / w['rejections']:.1f}, "
          f"chunked {c['draft_tokens_discarded'] / c['rejections']:.1f}; rejections {w['rejections']}, "
          f"windows taken whole {w['drafts_accepted_whole']}, parts committed {c['chunk_commits']}")  # fmt: skip


@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_every_window_taken_and_none_taken_match_too(engines, tau):
    """τ 0 takes every window (its parts committed as drafted), τ 1 none (each window's first
    boundary fails): the whole windows' text either way."""
    chunked, whole = engines
    want, w = _run(whole, tau, PROMPTS[:4])
    got, c = _run(chunked, tau, PROMPTS[:4])
    assert got == want
    if tau == 0.0:
        assert c["rejections"] == w["rejections"] == 0 and c["chunk_commits"] > 0
    else:
        assert c["rejections"] == w["rejections"] > 0 and c["chunk_commits"] == 0


def test_adaptive_windows_the_policy_judges_in_parts_are_judged_in_parts(tiny_models, engines, monkeypatch):
    """`on_reject: adaptive` with judge_chunks: a window the policy chose to judge in parts
    (`Decision.parts`; when it chooses so is tests/test_window_policy.py's) is judged part by
    part -- parts committed, a window's rejection throwing away a part -- and at the lossless
    setting (guard 1, τ 1: every boundary fails) the text is the target's own."""
    from vllm import SamplingParams

    from parse_vllm import window_policy

    decide = window_policy.WindowPolicy.decide

    def in_parts(self, r, room):
        d = decide(self, r, room)
        return dataclasses.replace(d, window=min(self.window, room), parts=True) if d.window else d

    monkeypatch.setattr(window_policy.WindowPolicy, "decide", in_parts)
    adaptive = make_llm(
        **parse_kwargs(
            tiny_models,
            window=WINDOW,
            draft_chunk=CHUNK,
            judge_chunks=True,
            on_reject="adaptive",
            adaptive_step_costs=GPU_COSTS,  # windows pay: what is tested is how they are judged
            **JUDGING,
        )
    )
    try:
        _, st = _run(adaptive, _middle_tau(engines[1]))
        assert st["chunk_commits"] > 0 and st["rejections"] > 0, st
        # each request's decisions by their reason (window_policy.WHY)
        why = [c["policy"] for c in parse_vllm.get_request_stats(adaptive).values() if c["policy"]]
        assert why and all(set(w) <= set(window_policy.WHY) for w in why), why
        assert st["draft_tokens_discarded"] / st["rejections"] <= CHUNK + 6, st
        lossless = SamplingParams(
            max_tokens=64, temperature=0.0, ignore_eos=True, extra_args={"parse_threshold": 1.0, "parse_guard": 1}
        )
        got = [o.outputs[0].token_ids for o in adaptive.generate(PROMPTS[:4], lossless)]
        plain = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, extra_args={"parse": False})
        want = [o.outputs[0].token_ids for o in engines[1].generate(PROMPTS[:4], plain)]
        assert got == want
    finally:
        close_llm(adaptive)
