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


def test_demo_tasks_shows_each_windows_judgments_and_the_totals(tiny_models, capsys):
    """`make demo`'s form (`--tasks N --compare`) on the tiny models at τ 0.01 (judged, unlike
    τ 0, which takes windows unjudged): each task's block with its windows and the totals;
    per task, the tokens the counters call semantic are at most what its printed windows
    took."""
    from parse_vllm import cli

    common = ["demo", "--pair", "smollm2", "--target", str(tiny_models["target"]), "--draft", str(tiny_models["draft"])]
    argv = common + ["--tasks", "2", "--compare", "--max-tokens", "40", "--window", "16", "--threshold", "0.01"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "tasks: the first 2 even HumanEval ids (HumanEval/0, HumanEval/2)" in text
    blocks = re.split(r"^(?=HumanEval/\d+: )", text.split("\ntotals over")[0], flags=re.M)[1:]
    assert [b.split(":")[0] for b in blocks] == ["HumanEval/0", "HumanEval/2"], text
    opened = 0
    for block in blocks:
        n = int(re.match(r"HumanEval/\d+: (\d+) window\(s\) judged", block).group(1))
        verdicts = re.findall(r"^  window at answer token \d+: P\(correct\) at boundary \S.* → (.*)$", block, re.M)
        assert len(verdicts) == n, block
        taken = sum(int(re.search(r"(\d+)(?: of \d+)? tokens$", v).group(1)) for v in verdicts)
        semantic = int(re.search(r"^  PARSE's \d+ tokens: (\d+) taken semantically", block, re.M).group(1))
        assert semantic <= taken, block
        assert re.search(r"^  tests: PARSE (pass|FAIL), target alone (pass|FAIL)$", block, re.M), block
        opened += n
    assert opened > 0, text
    assert re.search(
        rf"^totals over 2 tasks: {opened} windows judged \(\d+ taken whole, \d+ cut, \d+ rejected", text, re.M
    )
    assert re.search(r"^  time: PARSE [\d.]+ s, target alone [\d.]+ s: [\d.]+x on the same tasks", text, re.M), text


def test_demo_tasks_refuses_a_prompt_beside_it(capsys):
    from parse_vllm import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--tasks", "2", "--prompt", "hi"])
    assert (
        e.value.code == 2 and "--tasks takes a number of tasks >= 1, and not with --prompt" in capsys.readouterr().err
    )
