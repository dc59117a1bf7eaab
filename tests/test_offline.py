"""PARSE through `LLM(...).generate`, the way users run it offline.

Engines (module-scoped, float32 so outputs compare token for token):
  ref    the target alone (plugin installed, PARSE not named)
  draft  the draft alone (to know what the draft writes)
  parse  target + draft with PARSE (`continue` after rejections), recording
         its judgments for white-box checks
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import (
    PROMPTS,
    WINDOW,
    assert_judgments_match_target_forwards,
    close_llm,
    engine_kwargs,
    make_llm,
    parse_kwargs,
)

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def draft(tiny_models):
    llm = make_llm(**engine_kwargs(tiny_models["draft"]))
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def parse(tiny_models):
    llm = make_llm(**parse_kwargs(tiny_models, record_judgments=4096, audit_transfers=True), disable_log_stats=False)
    yield llm
    close_llm(llm)


def sp(max_tokens=40, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, **{**GREEDY, **kw})


def ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def prompt_ids(llm, prompts):
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in prompts]


# -- the invariants ----------------------------------------------------------------


def test_lossless_when_threshold_above_one(ref, parse):
    """τ > 1: no prefix can pass, so the request never drafts (it starts as
    if past a rejection) and its output is exactly the target's own."""
    import parse_vllm

    want = ids(ref.generate(PROMPTS, sp(48)))
    before = parse_vllm.get_stats(parse)
    got = ids(parse.generate(PROMPTS, sp(48, extra_args={"parse_threshold": 1.5})))
    assert got == want
    after = parse_vllm.get_stats(parse)
    for key in ("drafts", "drafter_passes", "drafter_rows", "copies", "verification_passes"):
        assert after[key] == before[key], key


def _accept_all_expected(ref, draft, prompt, max_tokens):
    """What τ = 0 must produce: the target's first token (prefill), then
    repeatedly W draft tokens accepted whole plus one target token after
    them, until max_tokens or a stop."""
    eos = ref.get_tokenizer().eos_token_id
    out: list[int] = []
    while len(out) < max_tokens:
        t = ids(ref.generate([{"prompt_token_ids": prompt + out}], sp(1)))[0]
        out += t
        if t[-1] == eos or len(out) >= max_tokens:
            break
        d = ids(draft.generate([{"prompt_token_ids": prompt + out}], sp(min(WINDOW, max_tokens - len(out)))))[0]
        out += d
        if d and d[-1] == eos:
            break
    return out[:max_tokens]


def test_accept_all_when_threshold_zero(ref, draft, parse):
    """τ = 0: every draft is accepted whole; the target writes only the token
    after each window."""
    prompts = prompt_ids(parse, PROMPTS[:4])
    max_tokens = 2 * WINDOW + 6
    want = [_accept_all_expected(ref, draft, p, max_tokens) for p in prompts]
    got = ids(
        parse.generate([{"prompt_token_ids": p} for p in prompts], sp(max_tokens, extra_args={"parse_threshold": 0.0}))
    )
    assert got == want
    # One window of W draft tokens, then the target's token:
    first = ids(draft.generate([{"prompt_token_ids": prompts[0] + got[0][:1]}], sp(WINDOW)))[0]
    assert got[0][1 : 1 + WINDOW] == first


def test_token_guard_identities(ref, parse):
    """The token guard (`parse_guard`, top-k) through LLM.generate: off and a k
    beyond the vocabulary change nothing; the strictest guard (1) on greedy
    requests is plain lossless token-level acceptance (the target's own
    output even at τ = 0); a middle k accepts less than no guard."""
    import parse_vllm

    vocab = parse.get_tokenizer().vocab_size + 1000

    def run(**extra):
        parse_vllm.reset_stats(parse)
        out = ids(parse.generate(PROMPTS, sp(48, extra_args={"parse_threshold": 0.0, **extra})))
        return out, parse_vllm.get_stats(parse)["tokens_accepted_semantic"]

    loose, sem_off = run()
    assert run(parse_guard=0) == (loose, sem_off)
    assert run(parse_guard=vocab) == (loose, sem_off)
    strict, sem_strict = run(parse_guard=1)
    assert strict == ids(ref.generate(PROMPTS, sp(48)))
    assert loose != strict and sem_off > 0
    _, sem_mid = run(parse_guard=50)
    assert sem_strict <= sem_mid < sem_off
    # Sampled requests under the strictest guard: token-level acceptance only.
    parse_vllm.reset_stats(parse)
    parse.generate(PROMPTS[:4], sp(24, temperature=0.9, seed=3, extra_args={"parse_threshold": 0.0, "parse_guard": 1}))
    assert parse_vllm.get_stats(parse)["tokens_accepted_semantic"] == 0


def test_judgments_equal_separate_target_forwards(parse, tiny_models):
    """Each log P(label) from the one-pass verification, the label's tokens
    summed, equals a plain target forward over prompt + draft[:b] + suffix
    (HF transformers, float32)."""
    import parse_vllm

    parse.generate(PROMPTS, sp(40, extra_args={"parse_threshold": 0.5}))
    records = parse_vllm.get_judgments(parse)
    assert len(records) >= 10
    # Judgments of one request at several boundaries share its prefix: check a
    # spread of requests and boundaries.
    rng = np.random.default_rng(0)
    picked = [records[i] for i in sorted(rng.choice(len(records), size=min(40, len(records)), replace=False))]
    assert len({(r["req_id"]) for r in picked}) > 1
    assert_judgments_match_target_forwards(tiny_models["target"], picked)
    # The pass never wrote into the requests' own KV blocks.
    assert all(r["requests_kv_unchanged"] is True for r in records)


def test_partial_acceptance_is_the_maximal_valid_prefix(ref, parse_long):
    """τ = 0.5, greedy, one-token labels (so P(yes) spreads around τ), two-stage
    judging: for every judged draft (recorded judgments grouped by
    request and step), the answer holds the draft up to the maximal valid
    prefix that the recorded P(yes) and τ imply; where a boundary failed, the
    next token is either more draft (token-level acceptance took it) or the
    target's own greedy token after that prefix."""
    import parse_vllm

    tau = 0.5
    prompts = prompt_ids(parse_long, PROMPTS[:6])
    res = parse_long.generate([{"prompt_token_ids": p} for p in prompts], sp(40, extra_args={"parse_threshold": tau}))
    # the engine's request ids are the user's plus "-<8 characters>"
    full = {o.request_id: p + list(o.outputs[0].token_ids) for p, o in zip(prompts, res)}
    steps: dict[tuple, list[dict]] = {}
    for r in parse_vllm.get_judgments(parse_long):
        req = r["req_id"].rsplit("-", 1)[0]
        if req in full:
            steps.setdefault((req, len(r["token_ids"]) - r["boundary"]), []).append(r)
    assert len(steps) >= 6
    partial = []
    for (req, committed), recs in steps.items():
        recs.sort(key=lambda r: r["boundary"])
        ok = [r["p_yes"] >= tau for r in recs]
        k = ok.index(False) if False in ok else len(recs)  # boundaries [0, k) passed
        prefix = recs[k - 1]["token_ids"] if k else recs[0]["token_ids"][:committed]
        seq = full[req]
        assert seq[: len(prefix)] == prefix, "the accepted text is not the maximal valid prefix"
        if k < len(recs) and len(seq) > len(prefix):
            partial.append((prefix, seq[len(prefix)], recs[k]["token_ids"][len(prefix)]))
    assert partial, "no draft was cut by the judge"
    target = ids(ref.generate([{"prompt_token_ids": p} for p, _, _ in partial], sp(1)))
    for (_, nxt, drafted), (t,) in zip(partial, target):
        assert nxt in (drafted, t), (nxt, drafted, t)


def test_mixed_batch_equals_each_request_alone(ref, parse):
    """PARSE on and off per request, in one batch, at different phases (some
    requests already continuing after a rejection): each output equals the
    same request run alone; PARSE-off requests equal the target's own."""
    prompts = PROMPTS[:6]
    extra = [{}, {"parse": False}, {"parse_threshold": 0.0}, {"parse": "off"}, {"parse_threshold": 0.3}, {}]
    params = [sp(40, extra_args=e) for e in extra]
    together = ids(parse.generate(prompts, params))
    alone = [ids(parse.generate([p], [q]))[0] for p, q in zip(prompts, params)]
    assert together == alone
    want_off = ids(ref.generate([prompts[1], prompts[3]], sp(40)))
    assert [together[1], together[3]] == want_off


def test_a_neighbour_at_the_context_limit_changes_nothing(parse):
    """A request that runs to max_model_len (1024) beside a short one: the
    short request drafts as it does alone, at τ = 0 (every draft taken) and
    τ = 0.5 (judged). vLLM skips its drafter for the whole batch once the
    longest request plus W no longer fits and fills every draft with token
    0; here each request is bounded by its own room, and no judged draft is
    such a placeholder."""
    import parse_vllm

    tok = parse.get_tokenizer()
    short = tok.encode(PROMPTS[1])
    long = (tok.encode(PROMPTS[4]) * 200)[: 1024 - 24]  # 24 < W + the short request's 40 tokens
    for tau in (0.0, 0.5):
        params = sp(40, ignore_eos=True, extra_args={"parse_threshold": tau})
        alone = ids(parse.generate([{"prompt_token_ids": short}], params))[0]
        parse_vllm.reset_stats(parse)
        both = ids(
            parse.generate(
                [{"prompt_token_ids": long}, {"prompt_token_ids": short}],
                [sp(100, ignore_eos=True, extra_args={"parse_threshold": tau}), params],
            )
        )
        assert len(long) + len(both[0]) == 1024  # the neighbour ran to the limit
        assert both[1] == alone, tau
        st = parse_vllm.get_stats(parse)
        assert st["drafts"] > 0
        if tau == 0.5:
            judged = [
                j for j in parse_vllm.get_judgments(parse)[-st["copies"] :] if j["token_ids"][: len(short)] == short
            ]
            assert judged and all(set(j["token_ids"][len(short) :]) != {0} for j in judged if j["boundary"] > 1)


def test_host_transfers_per_step_do_not_grow_with_the_batch(parse, parse_long):
    """Device-to-host copies per engine step (counted by the worker, the
    most in any step): the step's inputs once, each verification call, the
    resampled tokens; the same at 2 and at 20 requests, and at most
    transfers.MAX_PER_STEP. Drafter calls per step: one per draft length
    bucket (and catch-up pass), at most log2(W) + 2 here; the windows drafted
    over steps read their chunks back once a step."""
    from parse_vllm.transfers import MAX_PER_STEP

    def audit(llm, n, **extra):
        llm.collective_rpc("parse_step_audit")
        llm.generate((PROMPTS * 4)[:n], sp(32, ignore_eos=True, extra_args={"parse_threshold": 0.5, **extra}))
        return llm.collective_rpc("parse_step_audit")[0]

    small, large = audit(parse, 2), audit(parse, 20)
    assert small["host_copies_max"] == large["host_copies_max"] == MAX_PER_STEP - 1, (small, large)  # one judge call
    assert 1 <= large["drafter_calls_max"] <= int(np.log2(WINDOW)) + 2
    two_stage = audit(parse_long, 8)  # holistic copies, then earlier boundaries: up to two judge calls
    assert 3 <= two_stage["host_copies_max"] <= MAX_PER_STEP, two_stage
    # Windows longer than draft_chunk are drafted over steps, their chunks read back once a
    # step (a draft of more than drafting.TOKENS_PER_DRAFTER_CALL in one step adds a read per extra call)
    assert large["drafter_reads_max"] == 1  # W = 16 in two steps of 8 (TEST_DRAFT_CHUNK): one call each
    # W = 256 in steps of 8 < drafting.TOKENS_PER_DRAFTER_CALL: one call per draft length a step, one read
    assert two_stage["drafter_reads_max"] == 1 and two_stage["drafter_calls_max"] <= int(np.log2(LONG_WINDOW)) + 2, (
        two_stage
    )
    # Host-to-device: every copy staged (pinned, not waited for on a GPU), none from
    # pageable memory, whatever the step did: judging, resampling, windows over steps,
    # token-level drafts, drafts past the rejection sampler's 128 tokens.
    for audited in (small, large, two_stage):
        assert audited["pageable_copies_max"] == 0, audited["pageable_sites"]
    assert small["host_to_device_max"] == large["host_to_device_max"] <= 8, (small, large)  # 7 here
    assert two_stage["host_to_device_max"] <= 8, two_stage


def test_the_verifier_is_chosen_once_at_start(parse):
    """`verifier: auto` is resolved in process 0 and written back, so the
    scheduler and the runner read the same choice: forked on the CPU, with
    its scratch blocks held back."""
    assert parse.llm_engine.vllm_config.additional_config["parse"]["verifier"] == "forked"
    assert len(parse.collective_rpc("parse_scratch_ids")[0]) > 0


def test_limits_hold_inside_accepted_drafts(parse):
    """max_tokens, stop token ids, min_tokens and stop strings hold when whole
    drafts are accepted (τ = 0)."""
    accept = {"parse_threshold": 0.0}
    base = ids(parse.generate(PROMPTS[:3], sp(30, extra_args=accept)))
    assert all(len(o) == 30 for o in base if parse.get_tokenizer().eos_token_id not in o)
    # max_tokens inside a window
    short = ids(parse.generate(PROMPTS[:3], sp(7, extra_args=accept)))
    assert [o[:7] for o in base] == short
    # a stop token that the draft writes mid-window: output ends at its first use
    out0 = base[0]
    stop_tok = out0[5]
    first = out0.index(stop_tok)
    stopped = ids(parse.generate([PROMPTS[0]], sp(30, extra_args=accept, stop_token_ids=[stop_tok])))[0]
    assert stopped == out0[: first + 1]
    # min_tokens: the stop token may not come before min_tokens outputs
    held = ids(
        parse.generate([PROMPTS[0]], sp(30, extra_args=accept, stop_token_ids=[stop_tok], min_tokens=first + 4))
    )[0]
    assert stop_tok not in held[: first + 4]
    assert len(held) >= first + 4
    # stop strings (detokenized) still cut the text: a stop string taken from the
    # middle of the answer (the first 3 visible characters of its second half)
    text = parse.generate([PROMPTS[0]], sp(30, extra_args=accept))[0].outputs[0].text
    half = text[len(text) // 2 :].lstrip()
    assert len(half) >= 3, text
    cut = half[:3]
    stopped = parse.generate([PROMPTS[0]], sp(30, extra_args=accept, stop=[cut]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and cut not in stopped.text
    assert text.startswith(stopped.text) and len(stopped.text) < len(text)


def test_random_sampling_and_logprobs(ref, parse):
    """Sampled (temperature > 0) requests go through PARSE too; requests that
    ask for logprobs get token-level speculation only (lossless, with
    logprobs for every token)."""
    params = sp(24, temperature=0.9, top_p=0.95, seed=7, extra_args={"parse_threshold": 0.0})
    outs = parse.generate(PROMPTS[:4], params)
    assert all(0 < len(o.outputs[0].token_ids) <= 24 for o in outs)
    # seeded: the same tokens again; and they are samples, not the greedy answer
    assert ids(parse.generate(PROMPTS[:4], params)) == ids(outs)
    assert ids(outs) != ids(parse.generate(PROMPTS[:4], sp(24, extra_args={"parse_threshold": 0.0})))
    with_lp = parse.generate(PROMPTS[:3], sp(24, logprobs=2))
    assert ids(with_lp) == ids(ref.generate(PROMPTS[:3], sp(24)))
    for o in with_lp:
        c = o.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs))


def test_bad_request_options_are_refused_and_engine_survives(parse):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    for bad in (
        {"parse_threshold": "high"},
        {"parse_tau": 0.2},
        {"parse": "maybe"},
        {"parse_threshold": -1},
        {"parse_guard": -2},
        {"parse_guard": "top5"},
    ):
        with pytest.raises(VLLMValidationError, match="parse"):
            parse.generate(["hi"], SamplingParams(max_tokens=4, extra_args=bad))
    assert len(ids(parse.generate(["hi"], sp(4)))[0]) == 4


def test_no_kv_block_leak_after_100_requests(parse):
    """100 PARSE requests of mixed lengths; afterwards no KV block is held."""
    prompts = [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(100)]
    params = [sp(4 + (i * 7) % 30, extra_args={"parse_threshold": [0.0, 0.5, 1.5][i % 3]}) for i in range(100)]
    outs = parse.generate(prompts, params)
    assert len(outs) == 100 and all(o.finished for o in outs)
    usage = [m for m in parse.get_metrics() if m.name == "vllm:kv_cache_usage_perc"]
    assert usage and usage[0].value == 0.0


def test_spec_decode_metrics_and_parse_stats(parse):
    import parse_vllm

    parse_vllm.reset_stats(parse)
    parse.generate(PROMPTS, sp(40, extra_args={"parse_threshold": 0.5}))
    stats = parse_vllm.get_stats(parse)
    assert stats["drafts"] > 0 and stats["copies"] > 0 and stats["verification_passes"] > 0
    assert stats["suffix_tokens"] % stats["copies"] == 0  # L tokens per copy
    assert stats["tokens_accepted_semantic"] > 0
    metrics = {m.name: m for m in parse.get_metrics()}
    assert metrics["vllm:spec_decode_num_drafts"].value > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value > 0


def test_request_stats_add_up_to_the_engines_and_go_by_the_callers_ids(parse):
    """parse_vllm.get_request_stats: per request, under the id the caller gave it (vLLM's
    suffix taken off), counters whose sums over a mixed batch (judged at τ 0.5, lossless
    τ > 1, PARSE off, accept-all τ 0) are the engine's."""
    import parse_vllm

    parse_vllm.reset_stats(parse)
    kinds = [{"parse_threshold": 0.5}, {"parse_threshold": 1.5}, {"parse": False}, {"parse_threshold": 0.0}]
    outs = parse.generate(PROMPTS[:4], [sp(40, extra_args=k) for k in kinds])
    stats, per = parse_vllm.get_stats(parse), parse_vllm.get_request_stats(parse)
    mine = [per[o.request_id] for o in outs]  # the ids LLM.generate gave them
    assert sum(r["semantic"] for r in per.values()) == stats["tokens_accepted_semantic"] > 0
    token_level = stats["tokens_accepted_token_level"] + sum(stats["token_level_accepted_tokens"].values())
    assert sum(r["token_level"] for r in per.values()) == token_level
    assert sum(r["drafts_judged"] for r in per.values()) <= stats["drafts"]
    assert mine[0]["drafts_judged"] > 0 and mine[3]["semantic"] > 0
    assert mine[1]["drafts_judged"] == mine[1]["semantic"] == 0  # τ > 1: never judged
    assert mine[2] == {
        "drafts_judged": 0,
        "rejections": 0,
        "draft_tokens": 0,
        "semantic": 0,
        "token_level": mine[2]["token_level"],
        "policy": {},  # no adaptive policy here
    }
    for o, r in zip(outs, mine):
        assert r["semantic"] + r["token_level"] <= len(o.outputs[0].token_ids)


def test_plugin_installed_but_not_named_changes_nothing(ref, tiny_models, tmp_path):
    """The same target-only run with vLLM's plugins disabled (VLLM_PLUGINS='')
    gives the same tokens as with parse-vllm installed (the `ref` engine)."""
    want = ids(ref.generate(PROMPTS, sp(32)))
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import PROMPTS, engine_kwargs
        from pathlib import Path
        def main():
            from vllm import LLM, SamplingParams
            import vllm.platforms as p
            llm = LLM(**engine_kwargs(Path({str(tiny_models["target"])!r})))
            out = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
            print("PLATFORM", type(p.current_platform).__name__)
            print("RESULT", json.dumps([list(o.outputs[0].token_ids) for o in out]))
        if __name__ == "__main__":
            main()
    """)
    )
    env = {**os.environ, "VLLM_PLUGINS": ""}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    lines = {
        l.split(" ", 1)[0]: l.split(" ", 1)[1] for l in res.stdout.splitlines() if l.startswith(("RESULT", "PLATFORM"))
    }
    assert "RESULT" in lines, res.stderr[-3000:]
    assert lines["PLATFORM"] == "CpuPlatform"  # truly without the plugin
    assert json.loads(lines["RESULT"]) == want


# -- a long window (W > the stock sampler's 128), redraft mode, two-stage ----------

LONG_WINDOW = 256


@pytest.fixture(scope="module")
def parse_long(tiny_models):
    llm = make_llm(
        **parse_kwargs(
            tiny_models,
            window=LONG_WINDOW,
            on_reject="redraft",
            redraft_tokens=8,
            max_rounds=3,
            two_stage=True,
            boundaries="both",
            every=16,
            spec_tokens=3,
            # one-token labels: on random weights a two-token label is ~e^-10 less
            # likely, so P(yes) would be ~1 everywhere and no draft would fail
            labels=["Yes", "No"],
            record_judgments=4096,
            audit_transfers=True,
        )
    )
    yield llm
    close_llm(llm)


def test_long_window_redraft_lossless(ref, parse_long):
    """Redraft mode judging W = 256 windows at τ = 1 (every judged prefix
    fails, P(yes) < 1): greedy output is the target's own, through
    rejections, rewrites and redrafts."""
    import parse_vllm

    parse_vllm.reset_stats(parse_long)  # counters of this test's requests only
    params = [sp(300 if i < 2 else 48, extra_args={"parse_threshold": 1.0}) for i in range(len(PROMPTS))]
    want = ids(ref.generate(PROMPTS, [sp(q.max_tokens) for q in params]))
    assert ids(parse_long.generate(PROMPTS, params)) == want
    stats = parse_vllm.get_stats(parse_long)
    assert stats["rounds"] > 0 and stats["copies"] > 0  # drafts were judged, rejected and redrafted
    # two-stage: holistic copies first, then the earlier boundaries of those
    # that failed, i.e. more copies than judged drafts
    parse_vllm.reset_stats(parse_long)
    parse_long.generate(PROMPTS, [sp(48, extra_args={"parse_threshold": 0.5}) for _ in PROMPTS])
    stats = parse_vllm.get_stats(parse_long)
    assert stats["rejections"] > 0 and stats["copies"] > stats["drafts"] - stats["drafts_accepted_whole"]
    # per request (get_request_stats), the token-level drafts of the rewrites (k 3) included
    per = parse_vllm.get_request_stats(parse_long).values()
    token_level = stats["tokens_accepted_token_level"] + sum(stats["token_level_accepted_tokens"].values())
    assert sum(stats["token_level_drafts"].values()) > 0 and sum(r["token_level"] for r in per) == token_level
    assert sum(r["rejections"] for r in per) == stats["rejections"]
    assert sum(r["semantic"] for r in per) == stats["tokens_accepted_semantic"]


def test_long_window_accept_all(ref, draft, parse_long):
    prompts = prompt_ids(parse_long, PROMPTS[:2])
    got = ids(
        parse_long.generate(
            [{"prompt_token_ids": p} for p in prompts], sp(200, extra_args={"parse_threshold": 0.0}, ignore_eos=True)
        )
    )
    for p, g in zip(prompts, got):
        t0 = ids(ref.generate([{"prompt_token_ids": p}], sp(1)))[0]
        d = ids(draft.generate([{"prompt_token_ids": p + t0}], sp(199, ignore_eos=True)))[0]
        assert g == t0 + d


def test_long_windows_stop_drafting_at_a_stop_token(ref, draft, parse_long):
    """W = 256 is drafted draft_chunk tokens per engine step (one drafter call each); a
    window whose draft reaches a stop token ends there instead of drafting the rest (τ = 0:
    the answer is the target's first token, then the draft's own text up to and with the
    stop token)."""
    from conftest import TEST_DRAFT_CHUNK as DRAFT_CHUNK

    import parse_vllm

    prompt = prompt_ids(parse_long, PROMPTS[1:2])[0]
    t0 = ids(ref.generate([{"prompt_token_ids": prompt}], sp(1)))[0]
    d = ids(draft.generate([{"prompt_token_ids": prompt + t0}], sp(3 * DRAFT_CHUNK, ignore_eos=True)))[0]
    at = next(i for i in range(DRAFT_CHUNK + 2, 3 * DRAFT_CHUNK) if d[i] not in d[:i])  # in the second chunk or later
    parse_vllm.reset_stats(parse_long)
    got = ids(
        parse_long.generate(
            [{"prompt_token_ids": prompt}], sp(200, stop_token_ids=[d[at]], extra_args={"parse_threshold": 0.0})
        )
    )[0]
    assert got == t0 + d[: at + 1]
    st = parse_vllm.get_stats(parse_long)
    # not LONG_WINDOW / DRAFT_CHUNK calls, and no window drafted after the answer ended
    assert st["drafter_passes"] == st["window_chunks"] == -(-(at + 1) // DRAFT_CHUNK), st


# -- a draft that agrees, tight scratch, prefix caching --------------------------------


def test_lossless_with_a_draft_that_agrees(ref, tiny_models):
    """The target as its own draft, judged under the strictest guard: the
    output is exactly the target's, and the drafter, run only over the
    requests that draft and catching each up from where its draft KV ends,
    drafts what the target writes (token-level acceptance takes almost every
    draft token; a drafter reading wrong KV would not)."""
    import parse_vllm

    kw = parse_kwargs(tiny_models)
    kw["speculative_config"]["model"] = str(tiny_models["target"])
    llm = make_llm(**kw)
    try:
        params = sp(40, extra_args={"parse_threshold": 0.5, "parse_guard": 1})
        assert ids(llm.generate(PROMPTS, params)) == ids(ref.generate(PROMPTS, sp(40)))
        st = parse_vllm.get_stats(llm)
        assert st["tokens_accepted_token_level"] >= 0.9 * st["draft_tokens"] > 0, st
        assert st["tokens_accepted_semantic"] == 0
    finally:
        close_llm(llm)


# -- the drafter only over the requests that draft --------------------------------------


@pytest.fixture(scope="module")
def parse_rows(tiny_models):
    """Redraft mode without token-level speculation (a request the target is
    rewriting is not drafted for), and passes of at most 64 tokens (long
    prompts are prefilled in chunks, and their draft KV caught up in chunks).
    Whole windows (draft_chunk 0): one drafter row per draft."""
    llm = make_llm(
        **parse_kwargs(
            tiny_models,
            draft_chunk=0,
            on_reject="redraft",
            redraft_tokens=8,
            max_rounds=3,
            labels=["Yes", "No"],
            record_judgments=4096,
        ),
        max_num_batched_tokens=64,
    )
    yield llm
    close_llm(llm)


def test_drafter_runs_only_over_requests_that_draft(ref, parse_rows):
    """A batch mixing requests that never draft (τ > 1, PARSE off), one that
    drafts every step (τ = 0) and ones rejected at every judgment (τ = 1):
    the drafter's calls hold exactly the requests that draft (counted: one
    row per draft offered; before, every request of the batch was a row of
    every call), and the requests that never draft write the target's text."""
    import parse_vllm

    prompts = PROMPTS[:3] + PROMPTS[4:7]
    t = "parse_threshold"
    extra = [{t: 1.5}, {"parse": False}, {t: 0.0}, {t: 1.0}, {t: 1.0}, {t: 1.5}]
    parse_vllm.reset_stats(parse_rows)
    got = ids(parse_rows.generate(prompts, [sp(40, extra_args=e, ignore_eos=True) for e in extra]))
    st = parse_vllm.get_stats(parse_rows)
    assert st["rounds"] > 0 and st["drafts"] > st["rounds"]
    assert st["drafter_rows"] == st["drafts"], st
    want = ids(ref.generate([prompts[i] for i in (0, 1, 5)], sp(40, ignore_eos=True)))
    assert [got[i] for i in (0, 1, 5)] == want


def _assert_redrafts_are_the_drafts_own(llm, draft):
    """τ = 1 in redraft mode: every judged draft is rejected and the target
    rewrites a few tokens, then the request drafts again. Every recorded
    draft after a rewrite must be the draft model's own greedy continuation
    of its prefix (a drafter reading stale KV writes something else)."""
    import parse_vllm

    parse_vllm.reset_stats(llm)
    llm.generate(PROMPTS[:4], sp(60, extra_args={"parse_threshold": 1.0}, ignore_eos=True))
    assert parse_vllm.get_stats(llm)["rounds"] >= 4
    drafts: dict[tuple, list[int]] = {}  # (request, committed length) -> longest judged draft prefix
    for r in parse_vllm.get_judgments(llm)[-200:]:
        committed = len(r["token_ids"]) - r["boundary"]
        key = (r["req_id"], committed)
        if len(r["token_ids"]) > len(drafts.get(key, [])):
            drafts[key] = r["token_ids"]
    later = {k: v for k, v in drafts.items() if k[1] > min(c for (q, c) in drafts if q == k[0])}
    assert len(later) >= 4, "no request drafted again after a rewrite"
    for (_, committed), seq in later.items():
        want = ids(draft.generate([{"prompt_token_ids": seq[:committed]}], sp(len(seq) - committed, ignore_eos=True)))
        assert seq[committed:] == want[0]


def test_redrafts_catch_the_draft_kv_up(draft, parse_rows):
    """The drafter skips a request while the target rewrites, then catches
    its draft KV up over what it missed when it drafts again."""
    _assert_redrafts_are_the_drafts_own(parse_rows, draft)


def test_a_lone_request_redrafts_after_each_rewrite(parse_rows):
    """Redraft mode without token-level speculation, one request: while the
    target rewrites, no draft is scheduled (steps without spec-decode
    metadata); the rewrite still counts its tokens and ends, and the request
    drafts again, max_rounds times."""
    import parse_vllm

    parse_vllm.reset_stats(parse_rows)
    parse_rows.generate(PROMPTS[:1], sp(120, ignore_eos=True, extra_args={"parse_threshold": 1.0}))
    st = parse_vllm.get_stats(parse_rows)
    assert st["rounds"] == 3 and st["drafts"] == 4 and st["rejections"] == 4, st


def test_whole_batch_drafter_keeps_rewriting_requests_in_sync(ref, draft, tiny_models):
    """Where the drafter cannot run over chosen rows (here probabilistic draft
    sampling), vLLM's whole-batch proposer runs every step while some request
    will draft again, so a request that rewrote without drafting still drafts
    from a draft KV in sync; and, with prefix caching on, also while none
    will, so the blocks a later request finds in the cache hold draft KV."""
    kw = parse_kwargs(tiny_models, on_reject="redraft", redraft_tokens=8, max_rounds=3, labels=["Yes", "No"])
    kw["additional_config"]["parse"]["record_judgments"] = 4096
    kw["speculative_config"]["draft_sample_method"] = "probabilistic"
    llm = make_llm(**kw, enable_prefix_caching=True)
    try:
        _assert_redrafts_are_the_drafts_own(llm, draft)
        _assert_cached_blocks_hold_draft_kv(llm, ref, draft, PROMPTS[3])
    finally:
        close_llm(llm)


def test_long_prompt_draft_kv_caught_up_in_chunks(ref, draft, parse_rows):
    """A prompt longer than a pass (64 tokens) is prefilled in chunks; the
    drafter catches its KV up in passes of at most 64 tokens when it first
    drafts, then drafts exactly what the draft model alone writes (τ = 0)."""
    import parse_vllm

    prompt = prompt_ids(parse_rows, [PROMPTS[4] * 12])[0]
    assert len(prompt) > 3 * 64
    parse_vllm.reset_stats(parse_rows)
    max_tokens = 2 * WINDOW + 6
    got = ids(parse_rows.generate([{"prompt_token_ids": prompt}], sp(max_tokens, extra_args={"parse_threshold": 0.0})))
    assert got[0] == _accept_all_expected(ref, draft, prompt, max_tokens)
    st = parse_vllm.get_stats(parse_rows)
    assert st["drafter_passes"] > st["drafts"]  # catch-up passes before the first draft
    assert st["drafter_tokens"] >= len(prompt)


SHARED = "You are a careful assistant. Answer briefly and plainly. " * 4


@pytest.fixture(scope="module")
def parse_cached(tiny_models):
    """Two scratch blocks (one copy per verification pass), prefix caching on."""
    llm = make_llm(**parse_kwargs(tiny_models, scratch_blocks=2), enable_prefix_caching=True)
    yield llm
    close_llm(llm)


def test_tight_scratch_and_prefix_caching_judge_the_same(parse, parse_cached):
    """Two scratch blocks and prefix caching on: the same judgments and the
    same text as the roomy engine, in more passes."""
    import parse_vllm

    prompts = [SHARED + q for q in PROMPTS[:4]]
    params = sp(32, extra_args={"parse_threshold": 0.5})
    parse_vllm.reset_stats(parse)
    want = ids(parse.generate(prompts, params))
    roomy = parse_vllm.get_stats(parse)
    parse_vllm.reset_stats(parse_cached)
    got = ids(parse_cached.generate(prompts, params))
    tight = parse_vllm.get_stats(parse_cached)
    assert got == want
    assert tight["copies"] == roomy["copies"] > 0
    assert tight["verification_passes"] > roomy["verification_passes"], (tight, roomy)


def _assert_cached_blocks_hold_draft_kv(llm, ref, draft, question):
    """Request A never drafts (τ > 1); B, with A's prompt, takes every draft
    (τ = 0) over A's blocks from the prefix cache: its drafts must be the
    draft model's own, so those blocks must hold the draft's KV."""
    prompt = prompt_ids(llm, [SHARED * 3 + question])[0]
    assert len(prompt) >= 3 * 32  # whole blocks to share
    llm.generate([{"prompt_token_ids": prompt}], sp(8, extra_args={"parse_threshold": 1.5}))
    got = ids(llm.generate([{"prompt_token_ids": prompt}], sp(40, extra_args={"parse_threshold": 0.0})))[0]
    assert got == _accept_all_expected(ref, draft, prompt, 40)


def test_prefix_cached_blocks_hold_draft_kv(ref, draft, parse_cached):
    _assert_cached_blocks_hold_draft_kv(parse_cached, ref, draft, PROMPTS[2])


def test_context_limit_judges_only_copies_that_fit(tiny_models):
    """At the model's own limit (max_model_len = max_position_embeddings =
    2048): a prompt that leaves room for the draft but not for every suffix
    copy. Only copies that fit are judged (positions stay inside the rotary
    table), the answer runs to the limit, and τ = 0 takes drafts without
    rejecting any."""
    from transformers import AutoConfig

    import parse_vllm
    from parse_vllm.config import ParseConfig
    from parse_vllm.templates import build_template

    limit = AutoConfig.from_pretrained(tiny_models["target"]).max_position_embeddings
    # boundaries every 2 tokens, so that short prefixes can be judged near the limit
    kw = parse_kwargs(tiny_models, record_judgments=4096, boundaries="tokens", every=2)
    llm = make_llm(**{**kw, "max_model_len": limit})
    try:
        tok = llm.get_tokenizer()
        suffix_len = build_template(tok, ParseConfig()).suffix_len
        prompt = (tok.encode("a " * limit) * 2)[: limit - suffix_len - 12]
        for tau in (0.5, 0.0):
            parse_vllm.reset_stats(llm)
            (out,) = llm.generate(
                [{"prompt_token_ids": prompt}], sp(100, ignore_eos=True, extra_args={"parse_threshold": tau})
            )
            assert len(prompt) + len(out.outputs[0].token_ids) == limit  # ran to the limit
            st = parse_vllm.get_stats(llm)
            assert st["drafts"] > 0
            if tau == 0.0:
                assert st["rejections"] == 0 and st["tokens_accepted_semantic"] > 0, st
        judged = [j for j in parse_vllm.get_judgments(llm) if j["token_ids"][: len(prompt)] == prompt]
        assert judged and all(len(j["token_ids"]) + suffix_len <= limit for j in judged)
    finally:
        close_llm(llm)


# -- refusals at start-up (process 0, before any engine starts) ---------------------


def _swap_two_tokens(src, dst):
    import shutil

    shutil.copytree(src, dst)
    path = dst / "tokenizer.json"
    tj = json.loads(path.read_text())
    vocab = tj["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tj))
    return dst


def test_a_draft_with_the_targets_tokenizer_files_is_not_loaded_to_compare(tiny_models, tmp_path):
    """The start-up check's shortcut: byte-identical fast-tokenizer files are one tokenizer;
    a swapped token, a file only one folder has, a folder without tokenizer.json or a hub
    name is left to loading both and comparing vocabularies."""
    import shutil

    from parse_vllm.plugin import same_fast_tokenizer_files

    target, draft = str(tiny_models["target"]), str(tiny_models["draft"])
    assert same_fast_tokenizer_files(target, draft)
    swapped = _swap_two_tokens(tiny_models["draft"], tmp_path / "swapped")
    assert not same_fast_tokenizer_files(target, str(swapped))
    extra = shutil.copytree(tiny_models["draft"], tmp_path / "extra")
    (extra / "added_tokens.json").write_text('{"<extra>": 49152}')
    assert not same_fast_tokenizer_files(target, str(extra))
    bare = shutil.copytree(tiny_models["draft"], tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    assert not same_fast_tokenizer_files(str(bare), str(bare))
    assert not same_fast_tokenizer_files("HuggingFaceTB/SmolLM2-135M-Instruct", draft)


def test_refusals_at_start(tiny_models, tmp_path):
    # vLLM's config (a pydantic dataclass) wraps the ParseConfigError raised by
    # the platform hook in its ValidationError, a ValueError with our message.
    ParseConfigError = ValueError

    other = _swap_two_tokens(tiny_models["draft"], tmp_path / "draft-other-tokenizer")
    kw = parse_kwargs(tiny_models)
    kw["speculative_config"] = {**kw["speculative_config"], "model": str(other)}
    with pytest.raises(ParseConfigError, match="different tokenizer"):
        make_llm(**kw)
    with pytest.raises(ParseConfigError, match="needs a draft model"):
        make_llm(**engine_kwargs(tiny_models["target"], additional_config={"parse": {}}))
    with pytest.raises(ParseConfigError, match="unknown PARSE option"):
        make_llm(**parse_kwargs(tiny_models, tau=0.3))
    with pytest.raises(ParseConfigError, match="parse.verifier=.kernel. cannot run here"):
        make_llm(**parse_kwargs(tiny_models, verifier="kernel"))


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def _unreadable_draft(tiny_models, tmp_path):
    import shutil

    bad = tmp_path / "draft-unreadable"
    shutil.copytree(tiny_models["draft"], bad)
    (bad / "config.json").write_text("{ not json")
    return bad


@pytest.mark.parametrize(
    "case, want",
    [
        ("draft_missing", "no-such-draft"),
        ("draft_unreadable", "draft-unreadable"),
        ("threshold", r"parse\.threshold"),
        ("boundaries", r"parse\.boundaries"),
        ("labels", r"parse\.labels.*start with the same token"),
        ("window", r"num_speculative_tokens=2048.*max_model_len=1024"),
        ("rejection_sampler", r"rejection_sample_method='block' is not supported"),
        ("heterogeneous_vocab", r"use_heterogeneous_vocab is not supported"),
        ("pipeline_parallel", r"does not support pipeline parallelism"),
        ("worker_cls", r"installs its own worker .* drop --worker-cls"),
        ("scheduler_cls", r"installs its own scheduler .* drop --scheduler-cls"),
        ("hybrid_kv_cache", r"one KV-cache group"),
        ("batched_tokens", r"max_num_batched_tokens=8 cannot hold one verification of a 16-token window"),
        ("spec_tokens", r"parse\.spec_tokens=17 is longer than the PARSE window W=16"),
        ("data_parallel", r"does not support data parallelism \(data_parallel_size=2\)"),
    ],
)
def test_bad_configuration_refused_at_start(tiny_models, tmp_path, case, want):
    """Each bad start-up setting: an error naming the field, raised before any
    engine process is left running."""
    kw = parse_kwargs(tiny_models)
    spec = kw["speculative_config"]
    if case == "draft_missing":
        spec["model"] = str(tmp_path / "no-such-draft")
    elif case == "draft_unreadable":
        spec["model"] = str(_unreadable_draft(tiny_models, tmp_path))
    elif case == "threshold":
        kw["additional_config"] = {"parse": {"threshold": -0.1}}
    elif case == "boundaries":
        kw["additional_config"] = {"parse": {"boundaries": "paragraph"}}
    elif case == "labels":
        kw["additional_config"] = {"parse": {"labels": ["Correct", "Correctly"]}}
    elif case == "window":
        spec["num_speculative_tokens"] = 2048
    elif case == "rejection_sampler":
        spec["rejection_sample_method"] = "block"
    elif case == "heterogeneous_vocab":
        spec["use_heterogeneous_vocab"] = True
    elif case == "pipeline_parallel":
        kw["pipeline_parallel_size"] = 2
    elif case == "worker_cls":
        kw["worker_cls"] = "vllm.v1.worker.cpu_worker.CPUWorker"
    elif case == "scheduler_cls":
        kw["scheduler_cls"] = "vllm.v1.core.sched.scheduler.Scheduler"
    elif case == "hybrid_kv_cache":
        kw["disable_hybrid_kv_cache_manager"] = False
    elif case == "batched_tokens":
        kw.update(max_num_batched_tokens=8, max_num_seqs=8, enable_chunked_prefill=True)
    elif case == "spec_tokens":
        kw["additional_config"] = {"parse": {"spec_tokens": 17}}
    elif case == "data_parallel":
        kw["data_parallel_size"] = 2
    before = _children()
    with pytest.raises(Exception, match=want):
        if case == "data_parallel":
            # LLM(...) refuses data parallelism itself; a server builds its
            # config as EngineArgs does, where PARSE's check runs.
            from vllm.engine.arg_utils import EngineArgs

            EngineArgs(**kw).create_engine_config()
        else:
            make_llm(**kw)
    assert _children() <= before
