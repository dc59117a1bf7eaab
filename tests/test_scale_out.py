"""Tensor parallelism 2 on CPU: PARSE on vLLM's default (multiprocessing)
executor with `tensor_parallel_size=2`, target and draft each split over the
two ranks (`draft_tensor_parallel_size=2`).

One engine at a time: the references (the TP 2 target alone, the draft alone)
are generated first and their engines closed, then the TP 2 PARSE engine
serves every check. The judgments are compared with plain single-process
target forwards (HF transformers, float32), as test_offline does for TP 1.

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


def _generate_alone(model, prompts, params):
    llm = make_llm(**engine_kwargs(model, tensor_parallel_size=TP))
    try:
        return ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def target_alone(tiny_models, prompt_ids):
    """The TP 2 target's greedy tokens (no speculation)."""
    return _generate_alone(tiny_models["target"], prompt_ids, sp())


@pytest.fixture(scope="module")
def draft_after_first_token(tiny_models, prompt_ids, target_alone):
    """The TP 2 draft's W greedy tokens after the prompt and the target's first token."""
    return _generate_alone(
        tiny_models["draft"], [p + t[:1] for p, t in zip(prompt_ids, target_alone)], sp(WINDOW, ignore_eos=True)
    )


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
    accepted): exactly the TP 2 target's own greedy tokens."""
    import parse_vllm

    parse_vllm.reset_stats(parse_tp2)
    got = ids(
        parse_tp2.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], sp(extra_args={"parse_threshold": 0.5, "parse_guard": 1})
        )
    )
    assert got == target_alone
    stats = parse_vllm.get_stats(parse_tp2)
    assert stats["drafts"] > 0 and stats["tokens_accepted_semantic"] == 0


def test_threshold_zero_takes_the_draft_whole(parse_tp2, prompt_ids, target_alone, draft_after_first_token):
    """τ = 0: the target's first token, then the draft's W greedy tokens whole."""
    got = ids(
        parse_tp2.generate(
            [{"prompt_token_ids": p} for p in prompt_ids],
            sp(1 + WINDOW, ignore_eos=True, extra_args={"parse_threshold": 0.0}),
        )
    )
    want = [t[:1] + d for t, d in zip(target_alone, draft_after_first_token)]
    assert got == want


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
