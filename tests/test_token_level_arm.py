"""Windows drafted over steps beside token-level drafts, through `LLM(...)`, at the shipped
pace (draft_chunk 2, spec_tokens 4): a window's chunk of 2 is drafted in the pass of the
token-level drafts of 4 (drafting.plan_passes `room`), keeping its 2, and its draft is still
the draft model's own greedy text."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, close_llm, engine_kwargs, make_llm, parse_kwargs

import parse_vllm

pytestmark = pytest.mark.slow

W = 64


def sp(max_tokens, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def draft(tiny_models):
    llm = make_llm(**engine_kwargs(tiny_models["draft"]))
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def shipped_pace(tiny_models, ref, draft):  # the references first: one engine at a time
    llm = make_llm(**parse_kwargs(tiny_models, window=W, spec_tokens=4, draft_chunk=2))
    yield llm
    close_llm(llm)


def test_a_window_drafted_in_the_token_level_pass_is_the_drafts_own_text(shipped_pace, ref, draft):
    """Request a takes every window (τ 0): its answer is the target's first token, then the
    draft model's greedy text, drafted 2 tokens a step, mostly in the same drafter call as
    request b's token-level drafts of 4 (b has PARSE off: the target's tokens). A chunk
    taken from the wrong positions of the joined pass, or drafted from misplaced KV, changes
    a's answer."""
    tok = shipped_pace.get_tokenizer()
    a, b = (tok.encode(p) for p in PROMPTS[1:3])
    n = 40  # one window of 39 (W 64, cut by max_tokens): 20 steps of chunks
    parse_vllm.reset_stats(shipped_pace)
    got = ids(
        shipped_pace.generate(
            [{"prompt_token_ids": a}, {"prompt_token_ids": b}],
            [sp(n, extra_args={"parse_threshold": 0.0}), sp(96, extra_args={"parse": False})],
        )
    )
    t0 = ids(ref.generate([{"prompt_token_ids": a}], sp(1)))[0]
    d = ids(draft.generate([{"prompt_token_ids": a + t0}], sp(n - 1)))[0]
    assert got[0] == t0 + d
    assert got[1] == ids(ref.generate([{"prompt_token_ids": b}], sp(96)))[0]
    st = parse_vllm.get_stats(shipped_pace)
    assert st["window_chunks"] >= (n - 1) // 2 and st["token_level_drafts"]["draft_model"] > 0
    # a's chunks with room for 4 (18 of its 20) drafted in the calls of b's drafts: each
    # such step one call, not two
    token_level = st["token_level_drafts"]["draft_model"]
    assert st["drafter_passes"] <= st["window_chunks"] + token_level - 12, st
