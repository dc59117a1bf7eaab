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

from parse_vllm.train_prompts import make_prompts, mtbench_questions

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
    assert {p["category"] for p in a} >= {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                          "stem", "humanities"}


def test_rouge_l():
    from parse_vllm.benchmarks.e2e import rouge_l

    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([1, 2, 3], [4, 5]) == 0.0
    # LCS of (1 2 3 4) and (1 3 4 5) is (1 3 4): p = r = 3/4
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)
    assert rouge_l([], []) == 1.0


def test_flops_ratio_of_the_shipped_draft(smollm2_dir):
    from parse_vllm import models
    from parse_vllm.train_draft import flops_per_token

    shipped = models.SHIPPED_DRAFTS / models.DEMO_DRAFT_NAME
    dcfg = json.loads((shipped / "config.json").read_text())
    tcfg = json.loads((smollm2_dir / "config.json").read_text())
    assert flops_per_token(tcfg, 0) / flops_per_token(dcfg, 0) >= 4.0  # weights alone
    meta = json.loads((shipped / "training.json").read_text())
    assert meta["target"] == models.DEMO_TARGET_NAME and meta["data_answer_tokens"] > 100_000
    # the shipped file is the small delta: no embedding
    assert (shipped / "draft_delta.safetensors").stat().st_size < 40 << 20


@pytest.mark.slow
def test_train_draft_end_to_end_on_a_tiny_target(tiny_models, tmp_path):
    """`parse-vllm train-draft` from answers to an assembled draft that vLLM runs as a draft,
    interrupted by its time bound and resumed from the checkpoint."""
    work = tmp_path / "work"
    exe = [sys.executable, "-m", "parse_vllm.cli", "train-draft", "--target", str(tiny_models["target"]),
           "--work", str(work), "--num-prompts", "24", "--max-tokens", "24", "--batch-tokens", "512",
           "--layers", "1", "--intermediate-size", "128", "--threads", "2"]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    first = subprocess.run([*exe, "--token-budget", "3000", "--max-minutes", "0.002"], env=env,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [json.loads(x) for x in (work / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and all(r["answer_ids"] for r in rows)
    assert (work / "ckpt.pt").exists()
    meta1 = json.loads((work / "draft" / "training.json").read_text())
    second = subprocess.run([*exe, "--token-budget", "3000", "--max-minutes", "5"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming at step" in second.stdout
    meta2 = json.loads((work / "draft" / "training.json").read_text())
    assert meta2["steps"] > meta1["steps"] and meta2["tokens_seen"] >= 3000
    # the distillation learned the target's answers (held-out agreement went up)
    hist = meta2["history"]
    assert hist[-1]["eval_agreement"] > hist[0]["eval_agreement"]

    from parse_vllm.train_draft import assemble_draft

    draft = assemble_draft(work / "draft", tiny_models["target"], tmp_path / "assembled")
    from conftest import close_llm, engine_kwargs, make_llm
    from vllm import SamplingParams

    llm = make_llm(**engine_kwargs(tiny_models["target"], speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}))
    try:
        out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        close_llm(llm)
