"""Edges of PARSE through `LLM(...).generate`: KV-cache pressure (preemption and
recomputation mid-PARSE), prompts near max_model_len, EOS inside a draft, an
empty draft (a draft that says EOS at once), `allowed_token_ids`.

Drafts with EOS are the tiny draft with its lm_head's EOS row edited:
  eos-first  EOS is the argmax everywhere: every draft is empty.
  eos-mid    EOS logit = 16·<u, h> for a fixed random unit u: EOS is the argmax
             at roughly one position in six, so drafts often end mid-window.

Engines (module-scoped, float32, max_model_len 384):
  ref    the target alone
  tight  PARSE with the eos-mid draft and a KV cache of ~30 blocks of 32 tokens
  first  PARSE with the eos-first draft
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import PROMPTS, WINDOW, close_llm, engine_kwargs, make_llm, parse_kwargs

pytestmark = pytest.mark.slow

MAX_LEN = 384
ACCEPT_ALL = {"parse_threshold": 0.0}
# Judged, yet exactly the target's greedy output: the guard keeps only the
# target's argmax tokens (τ > 1 would not draft at all).
LOSSLESS = {"parse_threshold": 1.0, "parse_guard": 1}


def _edit_eos_row(src, dst, mode: str):
    """Copy of the draft at `src` whose lm_head row for EOS makes EOS the argmax
    everywhere ("first") or at some positions ("mid")."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    shutil.copytree(src, dst)
    eos = AutoConfig.from_pretrained(src).eos_token_id
    path = dst / "model.safetensors"
    w = load_file(path)
    head = w["lm_head.weight"]
    if mode == "first":
        # A constant feature in the embeddings (dimension 0 = 10, far above the
        # layers' O(1) contributions) survives to the final norm with a
        # positive sign; EOS reads only it, with a huge weight.
        w["model.embed_tokens.weight"][:, 0] = 10.0
        head[eos] = 0.0
        head[eos, 0] = 1e3
    else:
        u = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(0))
        head[eos] = 16.0 * u / u.norm()
    save_file(w, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("eos-drafts")
    return {
        "first": _edit_eos_row(tiny_models["draft"], root / "eos-first", "first"),
        "mid": _edit_eos_row(tiny_models["draft"], root / "eos-mid", "mid"),
    }


def _parse_engine(tiny_models, draft, **extra):
    kw = parse_kwargs({**tiny_models, "draft": draft})
    kw.update(max_model_len=MAX_LEN, **extra)
    return make_llm(**kw)


@pytest.fixture(scope="module")
def ref(tiny_models):
    llm = make_llm(**engine_kwargs(tiny_models["target"], max_model_len=MAX_LEN))
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def tight(tiny_models, drafts):
    # ~3 KiB of KV per token (4 target + 2 draft layers): ~21 blocks of 32
    # tokens, 2 held as PARSE scratch; 6 requests of ~190 tokens need ~36.
    llm = _parse_engine(tiny_models, drafts["mid"], kv_cache_memory_bytes=2 << 20, disable_log_stats=False)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def first(tiny_models, drafts):
    llm = _parse_engine(tiny_models, drafts["first"])
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def hf(tiny_models, drafts):
    from transformers import AutoModelForCausalLM

    def load(p):
        return AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()

    return {"target": load(tiny_models["target"]), "mid": load(drafts["mid"])}


def sp(max_tokens, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def _metric(llm, name):
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _greedy_next(model, tokens) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([tokens])).logits[0, -1].argmax())


def _accept_all_hf(hf, prompt, max_tokens, eos):
    """τ = 0 with HF forwards: a target token, then the draft's window (up to
    W tokens, through its EOS) accepted whole, repeatedly. A draft that starts
    with EOS is empty: the target's next token instead."""
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(_greedy_next(hf["target"], prompt + out))
        if out[-1] == eos:
            break
        d: list[int] = []
        while len(d) < WINDOW and len(out) + len(d) < max_tokens:
            d.append(_greedy_next(hf["mid"], prompt + out + d))
            if d[-1] == eos:
                break
        if d == [eos]:
            continue
        out += d
        if d and d[-1] == eos:
            break
    return out[:max_tokens]


# -- EOS inside drafts, empty drafts ---------------------------------------------------


def test_eos_inside_drafts_ends_the_answer(tight, hf):
    """τ = 0 with a draft that often writes EOS mid-window: the accepted draft
    ends with its EOS and the request stops there (finish reason "stop"); the
    whole output is what an HF simulation of accept-all gives."""
    eos = tight.get_tokenizer().eos_token_id
    tok = tight.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:6]]
    max_tokens = 3 * WINDOW + 5
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], sp(max_tokens, extra_args=ACCEPT_ALL))
    got = ids(outs)
    want = [_accept_all_hf(hf, p, max_tokens, eos) for p in prompts]
    assert got == want
    ended = [o.outputs[0] for o in outs if o.outputs[0].token_ids[-1] == eos]
    assert ended, "no draft wrote EOS; the edited draft no longer tests this"
    assert all(c.finish_reason == "stop" for c in ended)
    # Some of those EOS were inside a draft (not the target's own token).
    assert any(
        len(g) > 1 and g[-1] == eos and _greedy_next(hf["target"], p + g[:-1]) != eos for p, g in zip(prompts, got)
    )


def test_empty_drafts_give_the_targets_output(first, ref):
    """A draft that says EOS at once offers nothing to judge: every τ gives
    exactly the target's greedy output, and nothing is judged."""
    import parse_vllm

    want = ids(ref.generate(PROMPTS, sp(40)))
    for tau in (0.0, 0.5, 1.5):
        assert ids(first.generate(PROMPTS, sp(40, extra_args={"parse_threshold": tau}))) == want
    assert parse_vllm.get_stats(first)["drafts"] == 0


# -- KV pressure and max_model_len ---------------------------------------------------


def test_preemption_mid_parse_stays_lossless(tight, ref):
    """More requests than the KV cache holds: vLLM preempts and recomputes
    requests in the middle of PARSE; guard 1 still gives exactly the target's
    output, τ = 0 finishes everything, and no block stays held."""
    prompts = [p + f" ({i})" for i, p in enumerate(PROMPTS[:6])]
    before = _metric(tight, "vllm:num_preemptions")
    got = tight.generate(prompts, sp(160, extra_args=LOSSLESS, ignore_eos=True))
    assert _metric(tight, "vllm:num_preemptions") > before, "the cache was not small enough to preempt"
    assert ids(got) == ids(ref.generate(prompts, sp(160, ignore_eos=True)))
    before = _metric(tight, "vllm:num_preemptions")
    loose = tight.generate(prompts, sp(160, extra_args=ACCEPT_ALL, ignore_eos=True))
    assert _metric(tight, "vllm:num_preemptions") > before
    assert all(o.finished and len(o.outputs[0].token_ids) == 160 for o in loose)
    assert _metric(tight, "vllm:kv_cache_usage_perc") == 0.0


def test_prompt_near_max_model_len(tight, ref):
    """A prompt a few tokens short of max_model_len: drafts would cross it.
    The request ends at max_model_len with exactly the target's tokens
    (guard 1), and with τ = 0 also at max_model_len, without error."""
    tok = tight.get_tokenizer()
    prompt = (tok.encode(" ".join(PROMPTS)) * 20)[: MAX_LEN - 7]
    room = MAX_LEN - len(prompt)
    want = ids(ref.generate([{"prompt_token_ids": prompt}], sp(50)))[0]
    assert len(want) == room
    got = tight.generate([{"prompt_token_ids": prompt}], sp(50, extra_args=LOSSLESS))[0].outputs[0]
    assert list(got.token_ids) == want and got.finish_reason == "length"
    loose = tight.generate(
        [{"prompt_token_ids": prompt}] * 2,
        [sp(50, extra_args=ACCEPT_ALL), sp(50, extra_args=ACCEPT_ALL, ignore_eos=True)],
    )
    for o in loose:
        assert len(o.outputs[0].token_ids) <= room and o.outputs[0].finish_reason in ("length", "stop")
    assert len(loose[1].outputs[0].token_ids) == room
    assert _metric(tight, "vllm:kv_cache_usage_perc") == 0.0


# -- constraints on accepted draft tokens ------------------------------------------------


def test_allowed_token_ids_hold_for_accepted_drafts(tight):
    """τ = 0 accepts whole drafts, but never a draft token outside the
    request's `allowed_token_ids` (the draft model does not know them)."""
    import parse_vllm

    eos = tight.get_tokenizer().eos_token_id
    free = ids(tight.generate(PROMPTS[:4], sp(40, extra_args=ACCEPT_ALL)))
    allowed = sorted({t for o in free for t in o[::3]} - {eos})  # a third of what it writes
    before = parse_vllm.get_stats(tight)["drafts"]
    outs = ids(tight.generate(PROMPTS[:4], sp(40, extra_args=ACCEPT_ALL, allowed_token_ids=allowed)))
    assert parse_vllm.get_stats(tight)["drafts"] > before  # PARSE judged (and would accept) drafts
    assert all(t in set(allowed) for o in outs for t in o)
    assert all(len(o) == 40 for o in outs)


# -- seeded requests whose prompt is prefilled in chunks ------------------------------------


@pytest.fixture(scope="module")
def chunked(tiny_models, drafts):
    llm = _parse_engine(
        tiny_models,
        drafts["mid"],
        kv_cache_memory_bytes=2 << 20,
        max_num_batched_tokens=64,
        disable_log_stats=False,
        max_num_seqs=4,
    )
    yield llm
    close_llm(llm)


def test_seeded_requests_with_chunked_prompts(chunked, tight):
    """A seeded random request whose prompt is prefilled in chunks used to
    kill vLLM's CPU engine (it rewinds the thrown-away sample's generator with
    an offset a CPU generator lacks). Such requests run to the end, PARSE on
    or off, beside others, and free their blocks. The thrown-away samples
    draw nothing from the request's generator: its first token is the one
    the same request gets when its prompt is prefilled in one go (`tight`:
    same models, a larger token budget). (Later tokens of seeded requests
    are not compared: with speculation, a request's draws also depend on how
    many draft tokens each step verifies, which depends on the schedule.)"""
    from vllm import SamplingParams

    tok = chunked.get_tokenizer()
    prompt = {"prompt_token_ids": (tok.encode(" ".join(PROMPTS)) * 4)[:200]}
    budget = chunked.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert (
        budget < len(prompt["prompt_token_ids"]) <= tight.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    )
    first = [SamplingParams(temperature=1.0, seed=s, max_tokens=1) for s in range(8)]
    got = ids(chunked.generate([prompt] * 8, first))
    assert got == ids(tight.generate([prompt] * 8, first))
    assert len({o[0] for o in got}) > 1  # the seeds matter (the check could fail)
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True, extra_args=x)
        for x in ({"parse": False}, LOSSLESS, ACCEPT_ALL)
    ]
    outs = ids(chunked.generate([prompt] * 3 + PROMPTS[:2], params + [sp(24)] * 2))
    assert all(len(o) == 24 for o in outs[:3])
    assert _metric(chunked, "vllm:kv_cache_usage_perc") == 0.0
