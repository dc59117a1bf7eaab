"""The draft trainer (`parse-vllm train-draft`) and the shipped draft it made.

The full pipeline runs once on the tiny random target (answers from a real vLLM engine,
distillation, resume, export, assembly, loading the result in vLLM as a draft); the shipped
SmolLM2 draft is checked for shape, cost and provenance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parse_vllm.tools.prompts import make_prompts, mtbench_questions

ROOT = Path(__file__).resolve().parents[1]


def test_prompts_are_deterministic_and_never_the_evaluation_questions():
    questions = [q["prompt"] for q in mtbench_questions()]
    assert len(questions) == 80
    a = make_prompts(300, seed=3, exclude=questions)
    assert a == make_prompts(300, seed=3, exclude=questions)
    assert a != make_prompts(300, seed=4, exclude=questions)
    assert len({p["prompt"] for p in a}) == 300
    assert not {p["prompt"] for p in a} & set(questions)
    # an excluded text really removes every candidate sharing a long n-gram with it
    victim = a[0]["prompt"]
    b = make_prompts(300, seed=3, exclude=[victim], ngram=4)
    assert victim not in {p["prompt"] for p in b}
    assert {p["category"] for p in a} >= {
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
    }


def test_long_prompts_follow_the_short_ones_unchanged():
    from parse_vllm.tools.prompts import SHORT_PROMPTS

    questions = [q["prompt"] for q in mtbench_questions()]
    short = make_prompts(SHORT_PROMPTS, seed=0, exclude=questions)
    both = make_prompts(SHORT_PROMPTS + 400, seed=0, exclude=questions)
    # the data the first draft was trained on stays a prefix of every later, larger set
    assert both[:SHORT_PROMPTS] == short
    long = both[SHORT_PROMPTS:]
    assert len({p["prompt"] for p in both}) == len(both)
    assert not {p["prompt"] for p in long} & set(questions)
    words = lambda ps: sum(len(p["prompt"].split()) for p in ps) / len(ps)  # noqa: E731
    assert words(long) > 2 * words(short)
    assert {p["category"] for p in long} == {
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
    }


def test_self_instruct_requests_are_filtered_and_never_the_evaluation_questions():
    import random

    from parse_vllm.tools.prompts import EXAMPLE_REQUESTS, accept_written_request, banned_ngrams, self_instruct_text

    questions = [q["prompt"] for q in mtbench_questions()]
    banned = banned_ngrams(questions)
    # the examples shown to the target are not evaluation questions, nor pieces of them
    assert len(set(EXAMPLE_REQUESTS)) == len(EXAMPLE_REQUESTS) >= 20
    assert all(accept_written_request(e, set(), banned) == e for e in [e + " Please." for e in EXAMPLE_REQUESTS])
    text = self_instruct_text(random.Random(0))
    assert text == self_instruct_text(random.Random(0)) != self_instruct_text(random.Random(1))
    assert text.endswith("\n5.") and sum(e in text for e in EXAMPLE_REQUESTS) == 4
    seen: set[str] = set()
    # the first line only, whitespace folded
    assert (
        accept_written_request("  Write a  poem about   rain.\n6. Something else", seen, banned)
        == "Write a poem about rain."
    )
    assert accept_written_request("Write a poem about rain.", seen, banned) is None  # repeat
    assert accept_written_request("Hello there", seen, banned) is None  # too short
    assert accept_written_request("word " * 200, seen, banned) is None  # too long
    assert accept_written_request(EXAMPLE_REQUESTS[3], seen, banned) is None  # an example copied
    # an evaluation question, or a request quoting 8 words of one, is refused
    q = questions[0]
    assert accept_written_request(q, seen, banned) is None
    assert accept_written_request("Please do this: " + " ".join(q.split()[:8]) + " and more.", seen, banned) is None
    assert seen == {"Write a poem about rain."}


def test_soft_targets_line_up_with_the_answer_positions():
    """Rows with the target's top-k get a soft loss at exactly their answer positions; the
    loss equals a hand computation, and with weight 0 it is plain cross-entropy."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from parse_vllm.tools.train_draft import _collate, _loss_and_hits

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )
    rows = [
        ([1, 2, 3], [4, 5], [[4, 9, 7], [5, 8]], [[-0.1, -2.5, -3.0], [-0.2, -1.9]]),  # 2nd position lists 2 of 3
        ([1, 6], [7, 8, 9], None, None),  # no top-k: hard loss only
        ([2], [10], [[10, 11, 12]], [[-0.5, -1.0, -4.0]]),
    ]
    inputs, labels, soft = _collate(rows, [0, 1, 2], pad_id=0, topk=3)
    mask = labels != -100
    assert labels[mask].tolist() == [4, 5, 7, 8, 9, 10]
    assert soft.rows.tolist() == [0, 1, 5]
    assert soft.ids.tolist() == [[4, 9, 7], [5, 8, 8], [10, 11, 12]]
    assert soft.probs[1, 2] == 0 and torch.allclose(soft.probs.sum(-1), torch.ones(3))
    assert _collate(rows, [1], pad_id=0, topk=3)[2] is None and _collate(rows, [0], pad_id=0, topk=0)[2] is None

    w = 0.3
    loss, hits, n = _loss_and_hits(model, inputs, labels, soft, w)
    hidden = model.model(input_ids=inputs, attention_mask=(inputs >= 0).long()).last_hidden_state[mask]
    logp = F.linear(hidden, model.model.embed_tokens.weight).log_softmax(-1)
    y = labels[mask]
    hard = -logp[torch.arange(len(y)), y].mean()
    p0 = torch.tensor([-0.1, -2.5, -3.0]).softmax(-1)
    p1 = torch.tensor([-0.2, -1.9]).softmax(-1)
    p2 = torch.tensor([-0.5, -1.0, -4.0]).softmax(-1)
    soft_ref = (
        -((p0 * logp[0, [4, 9, 7]]).sum() + (p1 * logp[1, [5, 8]]).sum() + (p2 * logp[5, [10, 11, 12]]).sum()) / 3
    )
    assert loss.item() == pytest.approx(((1 - w) * hard + w * soft_ref).item(), rel=1e-5)
    assert n == 6 and hits == int((logp.argmax(-1) == y).sum())
    assert _loss_and_hits(model, inputs, labels, soft, 0.0)[0].item() == pytest.approx(hard.item(), rel=1e-5)


def test_rouge_l():
    from parse_vllm.tools.benchmarks.common import rouge_l

    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([1, 2, 3], [4, 5]) == 0.0
    # LCS of (1 2 3 4) and (1 3 4 5) is (1 3 4): p = r = 3/4
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)
    assert rouge_l([], []) == 1.0


def test_flops_ratio_of_the_shipped_draft(smollm2_dir):
    from parse_vllm.tools import prepare_models as models
    from parse_vllm.tools.train_draft import flops_per_token

    shipped = models.SHIPPED_DRAFTS / models.DEMO_DRAFT_NAME
    dcfg = json.loads((shipped / "config.json").read_text())
    tcfg = json.loads((smollm2_dir / "config.json").read_text())
    assert flops_per_token(tcfg, 0) / flops_per_token(dcfg, 0) >= 4.0  # weights alone
    meta = json.loads((shipped / "training.json").read_text())
    assert meta["target"] == models.DEMO_TARGET_NAME and meta["data_answer_tokens"] > 100_000
    # the shipped file is the small delta: no embedding
    assert (shipped / "draft_delta.safetensors").stat().st_size < 64 << 20


@pytest.mark.slow
def test_train_draft_end_to_end_on_a_tiny_target(tiny_models, tmp_path, capsys):
    """`parse-vllm train-draft` from answers to an assembled draft that vLLM runs as a draft,
    interrupted by its time bound and resumed from the checkpoint."""
    work = tmp_path / "work"
    exe = [
        sys.executable,
        "-m",
        "parse_vllm.cli",
        "train-draft",
        "--target",
        str(tiny_models["target"]),
        "--work",
        str(work),
        "--num-prompts",
        "20",
        "--self-instruct",
        "4",
        "--max-tokens",
        "24",
        "--batch-tokens",
        "512",
        "--layers",
        "1",
        "--init-layers",
        "3",
        "--intermediate-size",
        "128",
        "--threads",
        "1",  # the worker's one core (conftest): two threads would take turns on it
        "--head-vocab",
        "1024",  # a head-pruned draft (draft_vocab.py), as shipped
        # A random target's top-k is nearly flat: nothing a 3000-token run can learn from.
        # Its greedy tokens are, so this run checks learning on those (the top-k are still
        # generated and checked below; the soft loss has its own test above).
        "--soft-weight",
        "0",
    ]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    first = subprocess.run(
        [*exe, "--token-budget", "3000", "--max-minutes", "0.002"], env=env, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [json.loads(x) for x in (work / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and all(r["answer_ids"] for r in rows)
    # the last 4 prompts were written by the (random) target, and kept for the resumed run
    written = [json.loads(x)["prompt"] for x in (work / "prompts_self_instruct.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows[20:]] == written[:4] and all(r["category"] == "self-instruct" for r in rows[20:])
    # the target's top-k came with every answer token, greedy token first (float32 engine)
    for r in rows:
        assert len(r["topk_ids"]) == len(r["answer_ids"]) == len(r["topk_logprobs"])
        assert all(len(ids) == 8 for ids in r["topk_ids"])
        assert [ids[0] for ids in r["topk_ids"]] == r["answer_ids"]
        assert all(lp == sorted(lp, reverse=True) for lp in r["topk_logprobs"])
    assert (work / "ckpt.pt").exists()
    meta1 = json.loads((work / "draft" / "training.json").read_text())
    # The resumed run through the same CLI entry in this process (the first run above is the
    # command as users run it): its answers are all written, so it starts no vLLM, and it
    # resumes from what the first run left on disk alone. No new interpreter importing torch and
    # transformers again; its --threads is undone after it.
    import torch

    from parse_vllm.cli import main as cli_main

    threads = torch.get_num_threads()
    capsys.readouterr()
    try:
        assert cli_main([*exe[3:], "--token-budget", "3000", "--max-minutes", "5"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "resuming at step" in capsys.readouterr().out
    meta2 = json.loads((work / "draft" / "training.json").read_text())
    assert meta2["steps"] > meta1["steps"] and meta2["tokens_seen"] >= 3000
    assert meta2["data_soft_tokens"] == meta2["data_answer_tokens"] > 0
    # the distillation learned the target's answers (held-out agreement went up)
    hist = meta2["history"]
    assert hist[-1]["eval_agreement"] > hist[0]["eval_agreement"]

    from parse_vllm.tools.draft_delta import assemble_draft

    draft = assemble_draft(work / "draft", tiny_models["target"], tmp_path / "assembled")
    from safetensors import safe_open

    from parse_vllm.draft_vocab import ARCHITECTURE, HEAD_IDS_KEY, HEAD_VOCAB_KEY

    dcfg = json.loads((draft / "config.json").read_text())
    assert dcfg["architectures"] == [ARCHITECTURE] and dcfg[HEAD_VOCAB_KEY] == 1024
    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        ids, head, embed = (f.get_tensor(k) for k in (HEAD_IDS_KEY, "lm_head.weight", "model.embed_tokens.weight"))
    # the training answers say fewer than 1024 distinct tokens: all have a row; the rows
    # are the target embedding's
    assert meta2["head"]["rows"] == 1024 and meta2["head"]["coverage_train"] == 1.0
    assert ids.numel() == 1024 and head.equal(embed[ids])
    assert meta2["flops_per_token_draft"] < meta1["flops_per_token_target"]
    from conftest import close_llm, engine_kwargs, make_llm
    from vllm import SamplingParams

    llm = make_llm(
        **engine_kwargs(
            tiny_models["target"],
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
        )
    )
    try:
        out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        close_llm(llm)


@pytest.mark.slow
def test_measure_acceptance_counts_what_vllm_accepts(tiny_models):
    """The draft-quality figure: the target as its own draft is accepted (almost) always; the
    figures are consistent with the counters they come from."""
    from parse_vllm.tools.train_draft import measure_acceptance

    got = measure_acceptance(tiny_models["target"], tiny_models["target"], k=4, max_tokens=16, limit=6, dtype="float32")
    assert got["prompts"] == 6 and 0 < got["output_tokens"] <= 6 * 16
    assert got["draft_tokens"] == 4 * got["drafts"] > 0
    assert got["acceptance_rate"] > 0.95
    assert got["mean_acceptance_length"] == pytest.approx(1 + got["accepted"] / got["drafts"])
