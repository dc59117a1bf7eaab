"""`parse-vllm demo --compare`, as `make demo` runs it (there on the Qwen2.5-Coder pair), on the tiny models:
both answers side by side with speed and quality figures that are the
target's own (NLL from its prompt logprobs, ROUGE-L against its answer)."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow


def test_demo_compare_prints_both_answers_with_quality(tiny_models, capsys):
    from parse_vllm import cli

    argv = [
        "demo",
        "--pair",
        "smollm2",
        "--compare",
        "--target",
        str(tiny_models["target"]),
        "--draft",
        str(tiny_models["draft"]),
        "--max-tokens",
        "24",
        "--window",
        "8",
        "--prompt",
        "Tell me about the sea.",
    ]
    # τ > 1: PARSE's answer is the target's own, so its figures must equal the target's.
    assert cli.main(argv + ["--threshold", "1.5"]) == 0
    text = capsys.readouterr().out
    rows = {
        m.group(1).strip(): m.groups()[1:]
        for m in re.finditer(
            r"^(target alone|PARSE \(.*?\))\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+(\S+)$",
            text,
            re.M,
        )
    }
    assert set(rows) == {"target alone", "PARSE (τ = 1.5, guard off)"}, text
    target, parse = rows["target alone"], rows["PARSE (τ = 1.5, guard off)"]
    assert target[0] == parse[0] == "24"
    assert target[3] == parse[3]  # NLL/token of the same text
    assert target[4] == parse[4] == "1.00"  # ROUGE-L against the target's answer
    assert "identical to the target's own" in text


def test_demo_runs_the_bundled_pair_under_parse(capsys):
    """`parse-vllm demo --pair smollm2`: the bundled pair (SmolLM2-135M-Instruct
    judging and verifying the shipped head-pruned draft; `make demo` runs the
    Qwen2.5-Coder pair, too big for every test run):
    the draft loads through its own model class, the judge's pass runs on the
    real chat template, and token-level acceptance takes some of the trained
    draft's tokens."""
    from parse_vllm import cli

    assert cli.main(["demo", "--pair", "smollm2", "--max-tokens", "32", "--threshold", "0.5"]) == 0
    text = capsys.readouterr().out
    stats = {k: int(v) for k, v in re.findall(r"^  (\w+): (\d+)$", text, re.M)}
    assert "with an output head of the" in text  # the head-pruned draft
    assert stats["drafts"] > 0 and stats["copies"] > 0 and stats["verification_passes"] > 0, text
    assert stats["tokens_accepted_token_level"] + stats["tokens_accepted_semantic"] > 0, text
    assert re.search(r"PARSE answer \(W = 48, τ = 0\.5, guard off; \d+ tokens", text), text
