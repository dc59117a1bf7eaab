"""The judge on every model family a preset names, with each family's real
tokenizer and chat template (tests/fixtures/tokenizers/, ORIGIN.md there):
Qwen3 (thinking template), Llama 3.x Instruct, Gemma 3, SmolLM2 (ChatML).

Per family: the verification suffix ends exactly where the judge's answer
starts (reasoning off for Qwen3), it tokenizes as it does inside a whole
conversation, the labels are the tokens the judge reads next, and a τ sweep
on a tiny random model of the family's architecture and vocabulary runs end
to end through `LLM(...)`.
"""

from __future__ import annotations

import pytest
from conftest import close_llm, engine_kwargs, make_llm
from fixtures.families import FAMILIES, load_tokenizer, make_tiny_family_model

from parse_vllm.config import ParseConfig, ParseConfigError
from parse_vllm.templates import CHAT_TEMPLATE_KWARGS, build_template

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris. It is on the Seine."


def _render(tok, messages, gen, **kw):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, load_tokenizer(request.param)


def test_sentence_ends_read_through_the_backend_are_batch_decodes(family):
    """The engine's sentence-end mask (boundaries.sentence_end_mask) decodes every token once
    through the tokenizer's Rust backend (Llama 3, which asks for a space clean-up, through
    batch_decode): the same texts, so the same mask, as the tokenizer's own batch_decode gives."""
    import numpy as np

    from parse_vllm import boundaries

    name, tok = family
    n = len(tok)
    assert (tok.clean_up_tokenization_spaces is True) == (name == "llama3")  # the path each family takes
    assert boundaries._decode_each(tok, n) == tok.batch_decode([[i] for i in range(n)])
    special = set(tok.all_special_ids)
    by_hand = np.array([i not in special and boundaries.is_sentence_end(tok.decode([i])) for i in range(n)])
    assert np.array_equal(boundaries.sentence_end_mask(tok, n), by_hand)


def test_suffix_ends_where_the_answer_starts(family):
    """The suffix's tail is exactly what the template renders to open a reply
    with reasoning off; for Qwen3 that is an empty think block, and with
    thinking on (the template's default) it would not be."""
    name, tok = family
    t = build_template(tok, ParseConfig())
    user = [{"role": "user", "content": ParseConfig().question}]
    opening = _render(tok, user, True, **CHAT_TEMPLATE_KWARGS)[len(_render(tok, user, False, **CHAT_TEMPLATE_KWARGS)) :]
    assert opening and t.suffix_text.endswith(opening)
    if name == "qwen3":
        assert opening.endswith("<think>\n\n</think>\n\n")
        thinking = _render(tok, user, True)[len(_render(tok, user, False)) :]
        assert thinking == "<|im_start|>assistant\n"  # what the judge must not be given
    else:
        assert "<think>" not in t.suffix_text


def test_suffix_tokens_are_those_of_a_whole_conversation(family):
    """Appended after an answer's tokens, the suffix's tokens are the tokens
    the template gives the same text inside a whole conversation."""
    _, tok = family
    t = build_template(tok, ParseConfig())
    chat_ids = t.suffix_ids[: len(t.suffix_ids) - len(t.labels.extension)]
    convo = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": ParseConfig().question},
    ]
    text = _render(tok, convo, True, **CHAT_TEMPLATE_KWARGS)
    assert text.endswith(t.suffix_text)
    whole = tok.encode(text, add_special_tokens=False)
    assert tuple(whole[-len(chat_ids) :]) == chat_ids
    assert tok.decode(whole[: len(whole) - len(chat_ids)]).endswith(ANSWER)


def test_labels_are_what_the_judge_reads_next(family):
    """Each label's tokens are what follows the suffix when the judge answers
    with it, and decode to the label."""
    _, tok = family
    cfg = ParseConfig()
    t = build_template(tok, cfg)
    chat_ids = t.suffix_ids[: len(t.suffix_ids) - len(t.labels.extension)]
    for label, ids in zip(cfg.labels, (t.labels.yes_ids, t.labels.no_ids)):
        assert tuple(tok.encode(t.suffix_text + label, add_special_tokens=False)) == chat_ids + ids
        assert tok.decode(ids) == label
    assert t.labels.yes_ids[0] != t.labels.no_ids[0]
    # the longer label's leading tokens ride on the suffix
    longer = max((t.labels.yes_ids, t.labels.no_ids), key=len)
    assert t.labels.extension == longer[:-1] and t.suffix_ids[len(chat_ids) :] == longer[:-1]


def test_two_long_labels_are_refused_naming_tokens(family):
    _, tok = family
    with pytest.raises(ParseConfigError, match="at most one label may be more than one token"):
        build_template(tok, ParseConfig(labels=("Absolutely correct indeed", "Regrettably incorrect here")))


# The τ sweep through LLM(...): one engine per family (SmolLM2's is the rest of
# the suite's tiny_models), a tiny random model of the family's architecture
# as target and as draft.
@pytest.mark.slow
@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "smollm2"])
def test_tau_sweep_end_to_end(name, tmp_path):
    from vllm import SamplingParams

    import parse_vllm

    target = make_tiny_family_model(name, tmp_path / "target", num_layers=2, seed=0)
    draft = make_tiny_family_model(name, tmp_path / "draft", num_layers=1, seed=1)
    llm = make_llm(
        **engine_kwargs(
            target,
            max_model_len=512,
            max_num_seqs=4,
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 12},
            additional_config={"parse": {"record_judgments": 256}},
        )
    )
    try:
        tok = llm.get_tokenizer()
        prompts = [
            {
                "prompt_token_ids": tok.encode(
                    _render(tok, [{"role": "user", "content": q}], True, **CHAT_TEMPLATE_KWARGS),
                    add_special_tokens=False,
                )
            }
            for q in (QUESTION, "Write two sentences about rivers.", "List three colours.")
        ]

        def run(**extra):
            parse_vllm.reset_stats(llm)
            out = llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, extra_args=extra), use_tqdm=False
            )
            return [list(o.outputs[0].token_ids) for o in out], parse_vllm.get_stats(llm)

        own, _ = run(parse=False)  # the target's own output
        for tau in (0.0, 0.5, 1.0, 1.5):
            got, st = run(parse_threshold=tau)
            assert all(len(o) == 24 for o in got)
            # P(yes) in [0, 1]: only 0 < τ <= 1 needs the judge's pass; τ > 1 no draft at all
            assert (st["drafts"] > 0) == (tau <= 1) and (st["copies"] > 0) == (0 < tau <= 1)
            if tau > 1:
                assert got == own and st["tokens_accepted_semantic"] == 0
            if tau == 0.0:
                assert st["tokens_accepted_semantic"] > 0 and st["rejections"] == 0
        judged = parse_vllm.get_judgments(llm)
        assert judged and all(0.0 <= j["p_yes"] <= 1.0 for j in judged)
        assert all(j["logprob_yes"] < 0 and j["logprob_no"] < 0 for j in judged)
    finally:
        close_llm(llm)
