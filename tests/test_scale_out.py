"""Tensor parallelism 2 on CPU: PARSE on vLLM's default (multiprocessing)
executor with `tensor_parallel_size=2`, target and draft each split over the
two ranks (`draft_tensor_parallel_size=2`).

One engine at a time: the references (the target alone, the draft alone) are
generated first and their engines closed, then the TP 2 PARSE engine serves
every check. The references run at TP 1 in this process (a TP 2 engine starts
two worker processes, each importing vLLM: ~35 s here, a TP 1 engine ~5). TP 2
sums each row-parallel matmul in two halves, which moves a float32 logit by
~1e-6, so a greedy choice can differ from TP 1's only where the top two
log-probs are that close: the token comparisons stop at a reference's first
such near tie (top two under TIE apart; rare, the logits have std ~3 over 49k
tokens), and most tokens are compared. The judgments are compared with plain
single-process target forwards (HF transformers, float32), as test_offline
does for TP 1.

vLLM's CPU executor binds each rank's OpenMP threads to a NUMA node of its
own by default (VLLM_CPU_OMP_THREADS_BIND=auto), which refuses two ranks on a
one-node machine ("Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers"): the ranks are given a core each here, also under xdist.
"""

from __future__ import annotations

import contextlib
import os

import pytest
from conftest import (
    PROMPTS,
    WINDOW,
    assert_judgments_match_target_forwards,
    close_llm,
    engine_kwargs,
    finish_engine_steps,
    make_llm,
    parse_kwargs,
)

pytestmark = pytest.mark.slow

TP = 2
MAX_TOKENS = 48
# A reference token whose top two log-probs are closer than this may be another TP's
# other choice (TP 2 moves a float32 logit by ~1e-6 against TP 1): comparisons stop there.
TIE = 1e-4


def _rank_cores() -> list[int]:
    """The cores the ranks run on: the machine's (under xdist conftest.py pins
    each worker to one core; two ranks and the engine core spinning on one
    core start ~4x slower, so this module takes the cores back while it runs,
    one per rank)."""
    cores = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):
        cores = cores | os.sched_getaffinity(os.getppid())
    return sorted(cores)


@pytest.fixture(scope="module", autouse=True)
def _bind():
    """One core list per rank ("0|1"): vLLM's default binding (auto) wants a
    NUMA node per rank; "nobind" where there are fewer cores than ranks."""
    saved = os.sched_getaffinity(0)
    cores = _rank_cores()
    per = len(cores) // TP
    bind = "|".join(",".join(map(str, cores[r * per : (r + 1) * per])) for r in range(TP)) if per else "nobind"
    os.sched_setaffinity(0, cores)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
            yield
    finally:
        os.sched_setaffinity(0, saved)


def sp(max_tokens=MAX_TOKENS, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def prompt_ids(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["target"])
    return [tok.encode(p) for p in PROMPTS]


def _generate_alone(model, prompts, params) -> tuple[list[list[int]], list[int]]:
    """`model` alone at TP 1 (in this process): its greedy tokens per prompt, and per answer
    how many tokens come before its first near tie (the top two log-probs under TIE apart;
    the whole answer where there is none)."""
    llm = make_llm(**engine_kwargs(model))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        close_llm(llm)
    clear = []
    for o in outs:
        tops = [sorted((x.logprob for x in lp.values()), reverse=True) for lp in o.outputs[0].logprobs]
        clear.append(next((k for k, t in enumerate(tops) if t[0] - t[1] < TIE), len(tops)))
    return ids(outs), clear


def _assert_equal_up_to_near_ties(got, want, clear):
    """Answer by answer, `got` equals the reference `want` up to the reference's first near
    tie, and whole (its length too) where there is none; most reference tokens are compared."""
    assert len(got) == len(want) == len(clear)
    for g, w, n in zip(got, want, clear):
        assert g[:n] == w[:n] and (n < len(w) or g == w), (g, w, n)
    assert sum(clear) >= 0.8 * sum(map(len, want)), (clear, [len(w) for w in want])


@pytest.fixture(scope="module")
def target_alone(tiny_models, prompt_ids):
    """The target's greedy tokens (no speculation, TP 1) and their near-tie-free lengths."""
    return _generate_alone(tiny_models["target"], prompt_ids, sp(logprobs=2))


@pytest.fixture(scope="module")
def draft_after_first_token(tiny_models, prompt_ids, target_alone):
    """The draft's W greedy tokens (TP 1) after the prompt and the target's first token, and
    their near-tie-free lengths."""
    first = [p + t[:1] for p, t in zip(prompt_ids, target_alone[0])]
    return _generate_alone(tiny_models["draft"], first, sp(WINDOW, ignore_eos=True, logprobs=2))


@pytest.fixture(scope="module")
def parse_tp2(tiny_models, target_alone, draft_after_first_token):  # references first: one engine at a time
    kw = parse_kwargs(tiny_models, record_judgments=4096, audit_kv_blocks=True)
    kw["speculative_config"]["draft_tensor_parallel_size"] = TP
    llm = make_llm(**kw, tensor_parallel_size=TP, disable_log_stats=False)
    yield llm
    close_llm(llm)


def test_two_ranks_each_with_the_parse_runner(parse_tp2):
    blocks = parse_tp2.collective_rpc("parse_kv_blocks")
    assert len(blocks) == TP and len({b["pid"] for b in blocks}) == TP
    assert all(b["scratch_blocks"] > 0 for b in blocks)


def test_greedy_guard_one_is_the_tp2_target(parse_tp2, prompt_ids, target_alone):
    """τ = 0.5 with the strictest token guard (1: only the target's argmax is
    accepted): exactly the target's own greedy tokens (up to a near tie between
    TP 1's and TP 2's rounding, module docstring)."""
    import parse_vllm

    parse_vllm.reset_stats(parse_tp2)
    got = ids(
        parse_tp2.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], sp(extra_args={"parse_threshold": 0.5, "parse_guard": 1})
        )
    )
    _assert_equal_up_to_near_ties(got, *target_alone)
    stats = parse_vllm.get_stats(parse_tp2)
    assert stats["drafts"] > 0 and stats["tokens_accepted_semantic"] == 0


def test_threshold_zero_takes_the_draft_whole(parse_tp2, prompt_ids, target_alone, draft_after_first_token):
    """τ = 0: the target's first token, then the draft's W greedy tokens whole
    (up to a near tie between TP 1's and TP 2's rounding, module docstring)."""
    got = ids(
        parse_tp2.generate(
            [{"prompt_token_ids": p} for p in prompt_ids],
            sp(1 + WINDOW, ignore_eos=True, extra_args={"parse_threshold": 0.0}),
        )
    )
    (targets, target_clear), (drafts, draft_clear) = target_alone, draft_after_first_token
    want = [t[:1] + d for t, d in zip(targets, drafts)]
    # A near tie at the target's first token leaves nothing to compare: the draft's
    # reference continues that token, which TP 2 may not have picked.
    clear = [1 + dc if tc > 0 else 0 for tc, dc in zip(target_clear, draft_clear)]
    _assert_equal_up_to_near_ties(got, want, clear)


def test_judgments_equal_single_process_target_forwards(parse_tp2, prompt_ids, tiny_models):
    """The TP 2 verification pass's log P(label) equal a plain target forward
    over prompt + draft[:b] + suffix within 1e-4 (every recorded judgment)."""
    import parse_vllm

    parse_tp2.generate([{"prompt_token_ids": p} for p in prompt_ids], sp(40, extra_args={"parse_threshold": 0.5}))
    records = parse_vllm.get_judgments(parse_tp2)
    assert len(records) >= 10 and len({r["req_id"] for r in records}) > 1
    assert all(r["requests_kv_unchanged"] is True for r in records)
    # Every rank recorded the same judgments (the ranks decide together).
    per_rank = parse_tp2.collective_rpc("parse_judgments")
    assert all(len(r) == len(records) for r in per_rank)
    for other in per_rank[1:]:
        for a, b in zip(records, other):
            assert a["token_ids"] == b["token_ids"] and abs(a["p_yes"] - b["p_yes"]) <= 1e-6
    assert_judgments_match_target_forwards(tiny_models["target"], records)


def test_scratch_blocks_agree_across_ranks(parse_tp2):
    scratch = parse_tp2.collective_rpc("parse_scratch_ids")
    assert len(scratch) == TP and len(scratch[0]) > 0
    assert all(s == scratch[0] for s in scratch)


def test_no_kv_block_leak_after_100_requests(parse_tp2):
    """100 mixed PARSE requests; afterwards the scheduler holds no KV block,
    no rank holds request blocks or runner state, and no scratch block ever
    appeared in a request's block table (the per-step audit)."""
    parse_tp2.collective_rpc("parse_reset_kv_audit")
    prompts = [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(100)]
    params = [sp(4 + (i * 7) % 30, extra_args={"parse_threshold": [0.0, 0.5, 1.5][i % 3]}) for i in range(100)]
    outs = parse_tp2.generate(prompts, params)
    assert len(outs) == 100 and all(o.finished for o in outs)
    usage = [m for m in parse_tp2.get_metrics() if m.name == "vllm:kv_cache_usage_perc"]
    assert usage and usage[0].value == 0.0
    finish_engine_steps(parse_tp2)  # the step that tells the workers of the last finished requests
    for b in parse_tp2.collective_rpc("parse_kv_blocks"):
        assert b["request_blocks_held"] == 0 and b["runner_requests"] == 0 and b["parse_request_states"] == 0
        assert b["audit"]["steps"] > 0 and b["audit"]["request_blocks_held_max"] > 0
        assert b["audit"]["scratch_blocks_in_request_tables_max"] == 0
