"""Windows drafted over engine steps (issue "Serving without stalls"), through
`LLM(...)` and vLLM's engine stepped one step at a time: a window advances by at
most `draft_chunk` draft tokens per step while its request is held out of the
batch, and the other requests decode every step meanwhile."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, close_llm, engine_kwargs, make_llm, parse_kwargs

import parse_vllm

pytestmark = pytest.mark.slow

WINDOW, CHUNK = 32, 4


@pytest.fixture(scope="module")
def chunked(tiny_models):
    llm = make_llm(**parse_kwargs(tiny_models, window=WINDOW, draft_chunk=CHUNK))
    yield llm
    close_llm(llm)


def _params(max_tokens, **extra_args):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra_args,
    )


def _step_all(llm, requests: dict[str, tuple[str, object]]) -> list[dict[str, int]]:
    """Add the requests, then step the engine until they finish: per step, the new
    tokens of each request that got any."""
    engine = llm.llm_engine
    for req_id, (prompt, params) in requests.items():
        engine.add_request(req_id, prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        got = {}
        for out in engine.step():
            got[out.request_id] = got.get(out.request_id, 0) + len(out.outputs[0].token_ids)
        steps.append(got)
    return steps


def test_others_decode_every_step_while_a_window_is_drafted_in_chunks(chunked):
    """A PARSE request taking whole windows (τ 0) beside PARSE-off requests: each
    PARSE-off request gets a token in every step until it is done; the PARSE request
    sits out W / draft_chunk - 1 steps per window; no window takes more than
    draft_chunk draft tokens in a step."""
    parse_vllm.reset_stats(chunked)
    steps = _step_all(
        chunked,
        {
            "parse": (PROMPTS[1], _params(3 * WINDOW, parse_threshold=0.0)),
            "off-a": (PROMPTS[0], _params(40, parse=False)),
            "off-b": (PROMPTS[4], _params(40, parse=False)),
        },
    )
    for req_id in ("off-a", "off-b"):
        active = [s.get(req_id, 0) for s in steps]
        last = max(i for i, n in enumerate(active) if n)
        assert all(n >= 1 for n in active[: last + 1]), (req_id, active)
        assert sum(active) == 40
    parse_steps = [s.get("parse", 0) for s in steps]
    assert sum(parse_steps) == 3 * WINDOW
    # whole windows taken at once, after W / CHUNK steps of drafting each
    assert max(parse_steps) >= WINDOW + 1, parse_steps
    held = max(len(run) for run in "".join("0" if n == 0 else "1" for n in parse_steps).split("1"))
    assert held >= WINDOW // CHUNK - 1, parse_steps
    st = parse_vllm.get_stats(chunked)
    assert 0 < st["window_chunk_max"] <= CHUNK, st
    assert st["window_chunks"] >= 2 * (WINDOW // CHUNK), st
    # every drafter row is a chunk of the PARSE request's windows: PARSE-off requests are in no call
    assert st["drafter_rows"] == st["window_chunks"], st


def test_windows_in_chunks_write_what_whole_windows_write(tiny_models, chunked):
    """The same requests under draft_chunk 4 and draft_chunk 0 (the whole window in
    one step): the same tokens, at τ 0 (every window taken: the drafts themselves)
    and τ 0.5; alone (steps with nothing for the target) and in a batch."""
    from vllm import SamplingParams

    whole = make_llm(**parse_kwargs(tiny_models, window=WINDOW, draft_chunk=0))
    try:
        for tau in (0.0, 0.5):
            params = SamplingParams(
                max_tokens=70, temperature=0.0, ignore_eos=True, extra_args={"parse_threshold": tau}
            )
            for prompts in (PROMPTS[:1], PROMPTS[:6]):
                a = [o.outputs[0].token_ids for o in chunked.generate(prompts, params)]
                b = [o.outputs[0].token_ids for o in whole.generate(prompts, params)]
                assert a == b, (tau, len(prompts))
        assert parse_vllm.get_stats(whole)["window_chunks"] == 0
    finally:
        close_llm(whole)


def test_preemption_mid_window_loses_nothing(tiny_models):
    """A KV cache too small for the batch: five PARSE-off requests grow every step, and
    vLLM preempts the last to arrive, a PARSE request whose window is open (held out of
    the batch); the window is dropped and drafted again once the request is resumed.
    Lossless settings (guard 1, τ 1) still give exactly the target's tokens; τ 0
    finishes every request at full length; no block stays held."""
    from vllm import SamplingParams

    prompts = [p + f" ({i})" for i, p in enumerate(PROMPTS[:6])]

    def params(parse_args: dict):
        off = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True, extra_args={"parse": False})
        return [off] * 5 + [SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True, extra_args=parse_args)]

    ref = make_llm(**engine_kwargs(tiny_models["target"]))
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params({}))]
    finally:
        close_llm(ref)
    # ~3 KiB of KV per token: ~640 tokens of KV for 6 requests of ~170
    tight = make_llm(
        **{
            **parse_kwargs(tiny_models, window=WINDOW, draft_chunk=CHUNK),
            "kv_cache_memory_bytes": 2 << 20,
            "max_model_len": 512,
            "disable_log_stats": False,
        }
    )
    try:
        got = tight.generate(prompts, params({"parse_threshold": 1.0, "parse_guard": 1}))
        assert [o.outputs[0].token_ids for o in got] == want
        parse_vllm.reset_stats(tight)
        loose = tight.generate(prompts, params({"parse_threshold": 0.0}))
        assert all(o.finished and len(o.outputs[0].token_ids) == 160 for o in loose)
        assert parse_vllm.get_stats(tight)["windows_dropped"] > 0, "no window was open at a preemption"
        assert sum(m.value for m in tight.get_metrics() if m.name == "vllm:kv_cache_usage_perc") == 0.0
    finally:
        close_llm(tight)
