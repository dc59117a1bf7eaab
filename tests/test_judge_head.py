"""The judge head's file, its identity checks and its read-out (parse_vllm/judge_head.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parse_vllm.judge_head import HeadIdentity, JudgeHead, JudgeHeadError, ReadOut, judgment_passes, logit_threshold

H = 8


def _identity(**changes) -> HeadIdentity:
    base = dict(
        target="tiny",
        architecture="LlamaForCausalLM",
        hidden_size=H,
        num_layers=4,
        vocab_size=100,
        suffix_ids=(5, 6, 7),
        question="Q?",
        labels=("Correct", "Incorrect"),
        label_ids=((11,), (12, 13)),
        boundaries={"mode": "sentence", "every": 32, "max_boundaries": 8},
        lm_head_fingerprint=((0.5,) * 4, (-0.25,) * 4),
    )
    base.update(changes)
    return HeadIdentity(**base)


def _head(features=("hidden",), seed=0) -> JudgeHead:
    rng = np.random.default_rng(seed)
    n = H + len(features) - 1
    return JudgeHead(
        weight=rng.normal(size=n),
        bias=0.3,
        mean=rng.normal(size=n),
        scale=rng.uniform(0.5, 2.0, size=n),
        features=features,
        identity=_identity(),
        training={"n": 10},
    )


@pytest.mark.parametrize("features", [("hidden",), ("hidden", "zero_shot_logit")])
def test_the_read_out_is_the_standardised_logistic_model(features, tmp_path):
    """Saved and loaded, folded for the device: z = w · (x - mean) / scale + b by hand."""
    head = JudgeHead.load(_head(features).save(tmp_path / "h.safetensors"))
    assert head.identity == _identity() and head.features == features and head.training == {"n": 10}
    rng = np.random.default_rng(1)
    hidden, zs = rng.normal(size=(5, H)), rng.normal(size=5)
    x = np.concatenate([hidden, zs[:, None]], axis=1)[:, : H + len(features) - 1]
    by_hand = ((x - head.mean) / head.scale) @ head.weight + head.bias
    assert np.allclose(head.logit(hidden, zs), by_hand)
    got = ReadOut(head, "cpu").logit(torch.tensor(hidden, dtype=torch.float32), torch.tensor(zs, dtype=torch.float32))
    assert np.allclose(got.numpy(), by_hand, atol=1e-4)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"hidden_size": 16}, "hidden_size=8"),
        ({"architecture": "Qwen2ForCausalLM"}, "architecture"),
        ({"suffix_ids": (5, 6, 8)}, "another verification suffix"),
        ({"label_ids": ((11,), (12,))}, "another verification suffix"),
        ({"boundaries": {"mode": "sentence", "every": 16, "max_boundaries": 8}}, "another boundary rule"),
        ({"boundaries": {"mode": "fixed", "every": 32, "max_boundaries": 8}}, "another boundary rule"),
    ],
)
def test_a_head_for_another_target_or_suffix_is_refused(change, why):
    assert _head().mismatch(_identity()) is None
    assert why in _head().mismatch(_identity(**change))


def test_weights_other_than_the_trained_ones_are_refused():
    head = _head()
    same = np.array(head.identity.lm_head_fingerprint) * (1 + 1e-3)  # the same weights in bf16
    assert head.fingerprint_mismatch(same) is None
    assert "not the ones it was trained on" in head.fingerprint_mismatch(same + 0.5)


def test_bad_files_are_refused_with_the_path(tmp_path):
    with pytest.raises(JudgeHeadError, match="no file"):
        JudgeHead.load(tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a head")
    with pytest.raises(JudgeHeadError, match="junk.safetensors.*not a judge head"):
        JudgeHead.load(tmp_path / "junk.safetensors")
    with pytest.raises(JudgeHeadError, match="shape"):
        JudgeHead(np.zeros(3), 0.0, np.zeros(H), np.ones(H), ("hidden",), _identity())


def test_judgment_passes_at_the_edges_of_z_and_tau():
    """z = log-odds of a judgment, compared with logit(τ) in float64. τ = 1 passes nothing,
    not even z = +inf (a P(yes) that rounds to 1.0); τ = 0 passes everything, even z = -inf;
    in between, z passes exactly when z >= log(τ / (1 - τ)): logit(0.5) = 0, logit(0.8) =
    log 4 = 1.3863, logit(0.2) = -log 4."""
    inf = np.inf
    F, T = False, True
    z = np.array([-inf, -200.0, -1.3863, -1.3862, 0.0, 1.3862, 1.3863, 20.0, inf])
    assert judgment_passes(z, 1.0).tolist() == [F] * 9
    assert judgment_passes(z, 1.5).tolist() == [F] * 9  # τ > 1: never drafts, never passes
    assert judgment_passes(z, 0.0).tolist() == [T] * 9
    assert judgment_passes(z, 0.5).tolist() == [F, F, F, F, T, T, T, T, T]
    assert judgment_passes(z, 0.8).tolist() == [F, F, F, F, F, F, T, T, T]
    assert judgment_passes(z, 0.2).tolist() == [F, F, F, T, T, T, T, T, T]
    assert judgment_passes(np.array([inf]), 0.999999).tolist() == [True]
    assert judgment_passes(np.array([-inf]), 1e-12).tolist() == [False]
    assert judgment_passes(np.array([]), 0.5).shape == (0,)
    # the thresholds themselves, by hand
    assert logit_threshold(0.0) == -inf and logit_threshold(1.0) == inf and logit_threshold(0.5) == 0.0
    assert logit_threshold(np.array([0.8]))[0] == pytest.approx(1.3862944, abs=1e-7)


# -- in an engine -------------------------------------------------------------------------

SURE = 50.0  # the head's bias: P(yes) rounds to 1.0 in float32 for every prefix


def _tiny_head(target, path, *, question=None, bias=SURE, fingerprint_shift=0.0):
    """A judge head for the tiny target, made as `parse-vllm train-judge` exports one:
    random small direction over the hidden state plus the zero-shot log-odds."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from parse_vllm.config import ParseConfig
    from parse_vllm.judge_head import engine_identity, lm_head_fingerprint
    from parse_vllm.templates import build_template

    cfg = json.loads((target / "config.json").read_text())
    config = ParseConfig(**({"question": question} if question else {}))
    template = build_template(AutoTokenizer.from_pretrained(target), config)
    identity = engine_identity(
        target=str(target),
        architecture=cfg["architectures"][0],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        vocab_size=cfg["vocab_size"],
        template=template,
        config=config,
    )
    lm_head = load_file(str(target / "model.safetensors"))["lm_head.weight"] + fingerprint_shift
    identity = HeadIdentity(
        **{**identity.__dict__, "lm_head_fingerprint": lm_head_fingerprint(lm_head, identity.label_ids)}
    )
    rng = np.random.default_rng(7)
    n = cfg["hidden_size"] + 1
    head = JudgeHead(
        weight=rng.normal(scale=0.1, size=n),
        bias=bias,
        mean=rng.normal(scale=0.1, size=n),
        scale=rng.uniform(0.5, 2.0, size=n),
        features=("hidden", "zero_shot_logit"),
        identity=identity,
    )
    return head.save(path)


@pytest.fixture(scope="module")
def head_path(tiny_models, tmp_path_factory):
    return _tiny_head(tiny_models["target"], tmp_path_factory.mktemp("judge") / "judge_head.safetensors")


@pytest.fixture(scope="module")
def judged(tiny_models, head_path):
    from conftest import close_llm, make_llm, parse_kwargs

    llm = make_llm(**parse_kwargs(tiny_models, judge_head=str(head_path), record_judgments=512))
    yield llm
    close_llm(llm)


def _sp(max_tokens=24, **extra):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra or None)


@pytest.mark.slow
def test_the_pass_reads_the_head_out_of_the_hidden_state_it_computes(tiny_models, judged, head_path):
    """Each recorded judgment: the hidden state at the chat suffix's end equals a plain HF
    forward's over prompt + draft[:b] + suffix, and its log-odds are the head's read-out of
    it by hand."""
    from conftest import PROMPTS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import parse_vllm
    from parse_vllm.config import ParseConfig
    from parse_vllm.templates import build_template

    parse_vllm.reset_stats(judged)
    judged.generate(PROMPTS[:3], _sp(parse_threshold=0.5))
    records = parse_vllm.get_judgments(judged)
    assert records
    target = tiny_models["target"]
    head = JudgeHead.load(head_path)
    template = build_template(AutoTokenizer.from_pretrained(target), ParseConfig())
    chat_suffix = list(template.suffix_ids[: len(template.suffix_ids) - len(template.labels.extension)])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for r in records[:12]:
        with torch.no_grad():
            out = model(torch.tensor([r["token_ids"] + chat_suffix]), output_hidden_states=True)
        want = out.hidden_states[-1][0, -1].numpy()  # after the final norm: what the LM head reads
        assert np.abs(r["hidden"] - want).max() <= 1e-4
        by_hand = head.logit(want[None], np.array([r["logprob_yes"] - r["logprob_no"]]))[0]
        assert abs(r["logit"] - by_hand) <= 1e-3 and r["p_yes"] == pytest.approx(1 / (1 + np.exp(-by_hand)))


@pytest.mark.slow
def test_tau_one_never_passes_with_a_saturated_head(judged):
    """Every judgment of this head rounds to P(yes) = 1.0: τ just below 1 takes every draft
    whole, τ = 1 (the judged reject-all setting) takes none semantically."""
    from conftest import PROMPTS

    import parse_vllm

    parse_vllm.reset_stats(judged)
    judged.generate(PROMPTS[:3], _sp(parse_threshold=0.999))
    sure = parse_vllm.get_stats(judged)
    assert sure["tokens_accepted_semantic"] > 0 and sure["rejections"] == 0
    parse_vllm.reset_stats(judged)
    judged.generate(PROMPTS[:3], _sp(parse_threshold=1.0))
    never = parse_vllm.get_stats(judged)
    assert never["copies"] > 0 and never["tokens_accepted_semantic"] == 0 and never["rejections"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t, p: _tiny_head(t, p, question="Is this right? Answer Correct or Incorrect."), "another verification"),
        (lambda t, p: (p.write_bytes(b"junk"), p)[1], "not a judge head"),
    ],
)
def test_a_head_that_does_not_fit_is_refused_at_start(tiny_models, tmp_path, make, message):
    from conftest import parse_kwargs
    from vllm import LLM

    path = make(tiny_models["target"], tmp_path / "judge_head.safetensors")
    with pytest.raises(Exception, match=message):
        LLM(**parse_kwargs(tiny_models, judge_head=str(path)))


@pytest.mark.slow
def test_a_head_trained_on_other_weights_is_refused_when_they_load(tiny_models, tmp_path):
    """Same shapes, other weights (a base model and its instruct tune): the worker compares
    the LM head's label rows with the head's fingerprint."""
    from conftest import parse_kwargs
    from vllm import LLM

    path = _tiny_head(tiny_models["target"], tmp_path / "judge_head.safetensors", fingerprint_shift=0.5)
    with pytest.raises(Exception, match="not the ones it was trained on"):
        LLM(**parse_kwargs(tiny_models, judge_head=str(path)))
