"""`on_reject: adaptive` through `LLM(...)`: the window policy's choices counted, not timed
(a judge that rejects every window, one that takes every window), lossless settings still
the target's tokens, windows over steps and preemption losing nothing."""

from __future__ import annotations

import pytest
from conftest import GPU_COSTS, PROMPTS, close_llm, engine_kwargs, make_llm, parse_kwargs

import parse_vllm
from parse_vllm.window_policy import MIN_WINDOW, exploration_bound

pytestmark = pytest.mark.slow

W = 64
REJECT_ALL = {"parse_threshold": 1.0}  # judged, and every prefix fails
ACCEPT_ALL = {"parse_threshold": 0.0}
LOSSLESS = {"parse_threshold": 1.0, "parse_guard": 1}


def sp(max_tokens, **extra_args):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra_args or None)


def ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def adaptive(tiny_models, ref):  # the reference first: one engine at a time
    kw = parse_kwargs(tiny_models, window=W, on_reject="adaptive", adaptive_step_costs=GPU_COSTS)
    llm = make_llm(**kw, disable_log_stats=False)
    yield llm
    close_llm(llm)


def test_a_judge_that_rejects_every_window_costs_at_most_the_stated_probes(adaptive, ref):
    """Every window rejected over a 240-token answer: windows of MIN_WINDOW tokens, spaced
    by a doubling back-off, never more window tokens than `exploration_bound`; the answer is
    the target's own (nothing judged was taken)."""
    n = 240
    parse_vllm.reset_stats(adaptive)
    got = ids(adaptive.generate([PROMPTS[1]], sp(n, **REJECT_ALL)))
    st = parse_vllm.get_stats(adaptive)
    assert got == ids(ref.generate([PROMPTS[1]], sp(n)))
    opened = st["windows_opened"]
    assert set(opened) == {MIN_WINDOW} and st["rejections"] == sum(opened.values())
    assert sum(int(w) * c for w, c in opened.items()) <= exploration_bound(n)
    assert st["policy_probes"] == sum(opened.values()) - 1 and st["policy_token_level_steps"] > 0
    assert st["tokens_accepted_semantic"] == 0


def test_a_judge_that_takes_every_window_grows_them_to_w(adaptive):
    parse_vllm.reset_stats(adaptive)
    outs = adaptive.generate([PROMPTS[4]], sp(300, **ACCEPT_ALL))
    st = parse_vllm.get_stats(adaptive)
    assert len(outs[0].outputs[0].token_ids) == 300
    assert {16, 32, W} <= {int(w) for w in st["windows_opened"]}
    assert st["rejections"] == 0 and st["tokens_accepted_semantic"] > 200


def test_given_step_costs_stay_as_given(adaptive):
    costs = parse_vllm.get_step_costs(adaptive)
    assert costs == {"seconds": GPU_COSTS, "fixed": True, "steps": 0}


def test_an_engine_fits_its_step_costs_and_they_can_be_given_back(tiny_models, ref):
    """Without adaptive_step_costs the policy fits its cost model to the steps it times
    (what it then chooses depends on this machine's load, so only the fit is checked); what
    get_step_costs reads is a valid adaptive_step_costs."""
    from parse_vllm.config import ParseConfig

    llm = make_llm(**parse_kwargs(tiny_models, window=W, on_reject="adaptive"))
    try:
        outs = llm.generate(PROMPTS[:2], sp(48, **ACCEPT_ALL))
        assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
        costs = parse_vllm.get_step_costs(llm)
    finally:
        close_llm(llm)
    assert costs["fixed"] is False and costs["steps"] >= 2  # engine steps timed
    assert set(costs["seconds"]) == set(GPU_COSTS) and sum(costs["seconds"].values()) > 0
    cfg = ParseConfig.from_dict({"on_reject": "adaptive", "adaptive_step_costs": costs["seconds"]})
    assert cfg.adaptive_step_costs == costs["seconds"]


def test_lossless_settings_are_the_target_in_a_mixed_batch(adaptive, ref):
    prompts = PROMPTS[:6]
    kinds = [LOSSLESS, {"parse_threshold": 1.5}, {"parse": False}, LOSSLESS, ACCEPT_ALL, REJECT_ALL]
    got = ids(adaptive.generate(prompts, [sp(64, **k) for k in kinds]))
    want = ids(ref.generate(prompts, sp(64)))
    for i in (0, 1, 2, 3, 5):
        assert got[i] == want[i], kinds[i]


@pytest.fixture(scope="module")
def adaptive_tight(tiny_models, ref):
    # about 21 blocks of 32 tokens (2 held as PARSE scratch); 6 requests of ~140 tokens need ~30
    kw = parse_kwargs(tiny_models, window=W, on_reject="adaptive", adaptive_step_costs=GPU_COSTS)
    llm = make_llm(**{**kw, "kv_cache_memory_bytes": 2 << 20, "max_model_len": 384}, disable_log_stats=False)
    yield llm
    close_llm(llm)


def test_preemption_loses_nothing(adaptive_tight, ref):
    """More requests than the KV cache holds, windows drafted over steps: vLLM preempts
    requests mid-window; guard 1 still gives the target's tokens."""
    prompts = [p + f" ({i})" for i, p in enumerate(PROMPTS[:6])]
    parse_vllm.reset_stats(adaptive_tight)
    before = _preemptions(adaptive_tight)
    got = ids(adaptive_tight.generate(prompts, sp(112, **LOSSLESS)))
    assert _preemptions(adaptive_tight) > before, "the cache was not small enough to preempt"
    assert got == ids(ref.generate(prompts, sp(112)))
    assert parse_vllm.get_stats(adaptive_tight)["window_chunks"] > 0


def _preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


# A target forward that costs what its weights cost to read beside a drafter whose tokens
# cost compute (test_window_policy.DRAFTER_BOUND): drafting pays for one request, not for
# eight. A verification pass costs 10 s, so no window ever pays: every step is the
# token-level arm's.
DRAFTER_BOUND = {
    **GPU_COSTS,
    "target_forward": 0.2,
    "target_tokens": 1e-3,
    "draft_forwards": 1e-3,
    "draft_tokens": 0.02,
    "verify_passes": 10.0,
}


@pytest.fixture(scope="module")
def adaptive_k(tiny_models, ref):
    """The token-level arm drafting up to 4 tokens with the target itself as the drafter
    (greedy drafts all accepted, so α only grows from its 0.9 prior)."""
    target = str(tiny_models["target"])
    parse = {"on_reject": "adaptive", "spec_tokens": 4, "adaptive_step_costs": DRAFTER_BOUND, "draft_chunk": 8}
    kw = engine_kwargs(
        tiny_models["target"],
        speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": W},
        additional_config={"parse": parse},
    )
    llm = make_llm(**kw, disable_log_stats=False)
    yield llm
    close_llm(llm)


def test_the_token_level_arm_drafts_for_one_request_and_not_for_eight(adaptive_k, ref):
    """Alone, a request's steps draft 4 tokens (test_window_policy's batch-1 case); eight
    requests together run on the target alone: the drafter never runs. The tokens are the
    target's either way."""
    n = 96
    for batch, k in ((1, 4), (8, 0)):
        prompts = PROMPTS[:batch]
        parse_vllm.reset_stats(adaptive_k)
        got = ids(adaptive_k.generate(prompts, sp(n, **LOSSLESS)))
        st = parse_vllm.get_stats(adaptive_k)
        assert got == ids(ref.generate(prompts, sp(n)))
        assert not st["windows_opened"] and set(st["token_level_k_steps"]) == {k}, st["token_level_k_steps"]
        if k:
            drafts = st["token_level_drafts"]["draft_model"]
            assert st["token_level_draft_tokens"]["draft_model"] == 4 * drafts and drafts >= n // 5
            assert st["token_level_accepted_tokens"]["draft_model"] == 4 * drafts  # the target drafting for itself
        else:
            assert st["drafter_passes"] == 0 and not st["token_level_drafts"]
