"""The judge's prompt sets (parse_vllm/tools/judge/prompts.py, issue 37 item 1): MBPP's
official split, how an MBPP task becomes a prompt and how its tests run, the prompt-set
metadata a head records (name, split, sha256), τ_head's rule on a hand-made score table, and
the balance rule. A tiny synthetic MBPP file in tmp_path, never the real data set."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from parse_vllm.tools.judge import prompts

EDGES = (1, 10, 11, 510, 511, 600, 601, 974)


def _mbpp_file(path: Path, ids=EDGES) -> Path:
    rows = []
    for i in ids:
        rows.append(
            {
                "text": f"Write a function to add {i} to a number.",
                "code": f"def add_{i}(x):\n    return x + {i}",
                "task_id": i,
                "test_setup_code": "OFFSET = 0" if i == 11 else "",
                "test_list": [
                    f"assert add_{i}(1) == {i + 1}",
                    f"assert add_{i}(0) == {i}",
                    f"assert add_{i}(-1) == {i - 1} + OFFSET" if i == 11 else f"assert add_{i}(2) == {i + 2}",
                ],
                "challenge_test_list": [f"assert add_{i}(10**20) == 1"],  # would fail: never run
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_official_split_by_task_id():
    test, train = prompts.mbpp_ids("test"), prompts.mbpp_ids("train")
    val, prompt = prompts.mbpp_ids("validation"), prompts.mbpp_ids("prompt")
    assert test == set(range(11, 511)) and len(test) == 500
    assert train == set(range(601, 975)) and len(train) == 374
    assert val == set(range(511, 601)) and len(val) == 90
    assert prompt == set(range(1, 11)) and len(prompt) == 10
    assert prompts.mbpp_ids(prompts.MBPP_TRAIN) == train | val | prompt and not (train | val | prompt) & test
    assert prompts.mbpp_ids("all") == test | train | val | prompt == set(range(1, 975))
    with pytest.raises(prompts.PromptSpecError, match="each part"):
        prompts.mbpp_ids("train+dev")


def test_each_split_of_a_file_holds_its_tasks(tmp_path):
    path = _mbpp_file(tmp_path / "mbpp.jsonl")
    ids = lambda s: [int(it["id"].split("/")[1]) for it in prompts.load_mbpp(path, s).items]  # noqa: E731
    assert ids("test") == [11, 510] and ids("validation") == [511, 600] and ids("train") == [601, 974]
    assert ids("prompt") == [1, 10] and ids(prompts.MBPP_TRAIN) == [1, 10, 511, 600, 601, 974]


def test_a_task_shows_one_test_and_runs_all_of_them_with_its_setup(tmp_path):
    """The prompt: the text and the first assert; the check: the reply's code, then
    test_setup_code and every assert of test_list (not the challenge tests), through the
    eval's sandboxed checker."""
    from parse_vllm.tools.eval import checks

    pset = prompts.load_mbpp(_mbpp_file(tmp_path / "mbpp.jsonl"), "test")
    item = pset.items[0]
    assert item["id"] == "MBPP/11" and item["kind"] == "code" and item["messages"] is None
    assert "Write a function to add 11 to a number." in item["prompt"]
    assert "assert add_11(1) == 12" in item["prompt"] and "add_11(0)" not in item["prompt"]
    assert item["check"]["test"].startswith("OFFSET = 0\n") and item["check"]["test"].count("assert") == 3
    assert "10**20" not in item["check"]["test"]
    right = "```python\ndef add_11(x):\n    return x + 11\n```"
    wrong = "```python\ndef add_11(x):\n    return x + 11 if x > 0 else x\n```"
    assert checks.check(right, item["check"]) is True
    assert checks.check(wrong, item["check"]) is False


def test_specs_defaults_and_the_metadata_a_head_records(tmp_path):
    path = _mbpp_file(tmp_path / "mbpp.jsonl")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    train = prompts.load(str(path), humaneval_split="even", evaluating=False)
    held = prompts.load(str(path), humaneval_split="even", evaluating=True)
    named = prompts.load(f"{path}:validation", humaneval_split="even", evaluating=False)
    assert (train.name, train.split, held.name, held.split) == (
        "mbpp-train+validation+prompt", prompts.MBPP_TRAIN, "mbpp-test", "test")  # fmt: skip
    assert named.split == "validation" and len(named.items) == 2
    assert train.sha256 == held.sha256 == digest
    meta = held.meta("held out", 2)
    assert meta == {"name": "mbpp-test", "kind": "mbpp", "split": "test", "sha256": digest, "file": "mbpp.jsonl",
                    "tasks": 2, "role": "held out"}  # fmt: skip
    from parse_vllm.tools.judge.run import split_name

    assert split_name("mbpp-test") == "mbpp_test" and split_name("humaneval-odd") == "odd"
    assert split_name(train.name) == "mbpp_train_validation_prompt"
    # a user JSONL is not MBPP: a split suffix is refused for it
    user = tmp_path / "mine.jsonl"
    user.write_text(json.dumps({"prompt": "Say hi.", "reference": "hi"}) + "\n")
    assert prompts.load(str(user), humaneval_split="even", evaluating=False).kind == "jsonl"
    with pytest.raises(prompts.PromptSpecError, match="only known"):
        prompts.load(f"{user}:test", humaneval_split="even", evaluating=False)


def test_prompt_set_metadata_round_trips_through_the_head_file(tmp_path):
    from test_judge_features import _identity

    from parse_vllm.judge_head import JudgeHead

    sets = [
        prompts.load(str(_mbpp_file(tmp_path / "mbpp.jsonl")), humaneval_split="even", evaluating=False).meta("train", 6),
        {"name": "humaneval-even", "kind": "humaneval", "split": "even", "sha256": "ab" * 32, "file": "HumanEval.jsonl.gz",
         "tasks": 82, "role": "train"},
    ]  # fmt: skip
    head = JudgeHead(
        weight=np.ones(8), bias=0.0, mean=np.zeros(8), scale=np.ones(8), features=("hidden",),
        identity=_identity(), training={"prompt_sets": sets, "tau_head": {"tau": 0.65, "rule": "r"}},
    )  # fmt: skip
    loaded = JudgeHead.load(head.save(tmp_path / "h.safetensors"))
    assert loaded.prompt_sets == sets and loaded.tau == 0.65


def _examples(z_whole_pass, z_whole_fail, z_prefix_pass=(), z_prefix_fail=()):
    from parse_vllm.tools.judge import probe

    groups = [(z_whole_pass, True, True), (z_whole_fail, True, False), (z_prefix_pass, False, True),
              (z_prefix_fail, False, False)]  # fmt: skip
    z = np.concatenate([np.asarray(g[0], dtype=np.float64) for g in groups])
    whole = np.concatenate([[g[1]] * len(g[0]) for g in groups]).astype(bool)
    label = np.concatenate([[g[2]] * len(g[0]) for g in groups]).astype(bool)
    n = len(z)
    ex = probe.Examples(
        hidden=np.zeros((n, 2), dtype=np.float32), zero_shot=np.zeros(n), label=label, whole=whole,
        task=np.array([f"t{i}" for i in range(n)]), answer=np.zeros(n, dtype=int), length=np.zeros(n, dtype=int),
        how=["made"] * n, weight=np.ones(n),
    )  # fmt: skip
    return z, ex


def test_tau_head_is_the_most_permissive_tau_that_takes_few_failing_whole_answers():
    """20 failing whole answers judged at P = 0.05, 0.10, ..., 1.0 (log-odds), 10 passing
    ones at 0.9: at τ the failing share taken is #(P_i >= τ) / 20; <= 10% first at τ = 0.9
    (P 0.90, 0.95, 1.0 -> 3/20 = 15% at 0.875; 0.95, 1.0 -> 2/20 at 0.9)."""
    from parse_vllm.judge_head import logit_threshold
    from parse_vllm.tools.judge import probe

    p_fail = np.arange(1, 21) * 0.05
    z_fail = np.where(p_fail >= 1.0, 50.0, logit_threshold(np.minimum(p_fail, 0.999)))
    z_fail = np.where(np.isclose(p_fail, 0.9), float(logit_threshold(0.9)) - 1e-9, z_fail)  # just below 0.9
    z, ex = _examples(np.full(10, float(logit_threshold(0.91))), z_fail, [3.0, -3.0], [0.0])
    t = probe.choose_tau(z, ex)
    assert t["tau"] == 0.9 and t["met"] and t["at_tau"]["whole_wrong"] == pytest.approx(2 / 20)
    assert t["at_tau"]["whole_right"] == 1.0
    rows = {r["tau"]: r for r in t["table"]}
    assert rows[0.875]["whole_wrong"] == pytest.approx(3 / 20) and rows[0.5]["whole_wrong"] == pytest.approx(11 / 20)
    assert rows[0.9]["prefix_right"] == 0.5 and rows[0.9]["prefix_wrong"] == 0.0
    # a looser bound gives a lower τ; none met: the grid's largest
    assert probe.choose_tau(z, ex, max_wrong=0.2)["tau"] == 0.825  # 0.85, 0.9-, 0.95, 1.0: 4/20
    z2, ex2 = _examples([5.0], [50.0, 50.0])
    none = probe.choose_tau(z2, ex2)
    assert none["tau"] == max(probe.TAU_GRID) and not none["met"]


def test_tau_head_holds_the_bound_in_each_training_set_not_only_pooled():
    """Set "a": 20 failing whole answers at P 0.05 .. 1.0 as above (<= 10% first at τ 0.9);
    set "b": 80 failing ones at P 0.3, never taken at τ >= 0.5. Pooled, τ 0.525 takes the 10
    of "a" at P >= 0.55 out of 100 = 10%; set by set, "a" still takes 50% there: τ 0.9."""
    from dataclasses import replace

    from parse_vllm.judge_head import logit_threshold
    from parse_vllm.tools.judge import probe

    p_fail = np.arange(1, 21) * 0.05
    z_fail = np.where(p_fail >= 1.0, 50.0, logit_threshold(np.minimum(p_fail, 0.999)))
    z_fail = np.where(np.isclose(p_fail, 0.9), float(logit_threshold(0.9)) - 1e-9, z_fail)
    z_fail = np.concatenate([z_fail, np.full(80, float(logit_threshold(0.3)))])
    z, ex = _examples(np.full(10, float(logit_threshold(0.91))), z_fail)
    pooled = probe.choose_tau(z, ex)
    assert pooled["tau"] == 0.525 and pooled["at_tau"]["whole_wrong"] == pytest.approx(10 / 100)
    source = np.array(["a"] * 10 + ["a"] * 20 + ["b"] * 80)
    t = probe.choose_tau(z, replace(ex, source=source))
    assert t["tau"] == 0.9 and t["met"] and "each training set" in t["rule"]
    assert t["at_tau"]["whole_wrong_by_set"] == {"a": pytest.approx(2 / 20), "b": 0.0}
    rows = {r["tau"]: r for r in t["table"]}
    assert rows[0.525]["whole_wrong_by_set"]["a"] == pytest.approx(10 / 20)
    assert rows[0.525]["whole_wrong"] == pytest.approx(10 / 100)


def test_balance_picks_the_tasks_where_the_draft_rarely_fails():
    from parse_vllm.tools.judge.data import rarely_failing

    answers = [
        {"task": "a", "answer": 0, "sources": ["greedy-0"]},
        {"task": "a", "answer": 1, "sources": ["sample-0"]},
        {"task": "b", "answer": 0, "sources": ["greedy-0", "sample-1"]},
        {"task": "b", "answer": 1, "sources": ["sample-0"]},
        {"task": "c", "answer": 0, "sources": ["greedy-0"]},
        {"task": "c", "answer": 1, "sources": ["balance-0"]},  # balancing answers do not count
    ]
    passed = {("a", 0): True, ("a", 1): True, ("b", 0): True, ("b", 1): False, ("c", 0): True, ("c", 1): False}
    assert rarely_failing(answers, passed, 0.0) == ["a", "c"]
    assert rarely_failing(answers, passed, 0.5) == ["a", "b", "c"]


def test_the_report_says_which_held_out_set_has_too_few_failing_prefixes(tmp_path):
    from parse_vllm.tools.judge import report

    counts = lambda fail: {"counts": {"tasks": 5, "prefix_fail": fail}}  # noqa: E731
    summary = {
        "models": {"target": "t", "draft": "d", "question": "Q?", "labels": ["Correct", "Incorrect"],
                   "boundaries": {}, "window": 16},
        "train_split": "train", "train_sets": ["even", "mbpp_train_validation_prompt"],
        "splits": ["train", "even", "mbpp_train_validation_prompt", "odd", "mbpp_test"],
        "data": {"train": counts(300), "even": counts(80), "mbpp_train_validation_prompt": counts(220),
                 "odd": counts(79), "mbpp_test": counts(80)},
        "auc_head_whole_mbpp_test": 0.9, "auc_zero_shot_whole_mbpp_test": 0.6,
    }  # fmt: skip
    report.write(tmp_path, summary)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["failing_prefixes"] == {"odd": {"n": 79, "goal": 80, "met": False},
                                     "mbpp_test": {"n": 80, "goal": 80, "met": True}}  # fmt: skip
    md = (tmp_path / "summary.md").read_text()
    assert "odd 79; mbpp_test 80 — short on odd" in md
    assert "| head | — | — | 0.900 | — |" in md  # the held-out table: odd then MBPP test, whole / prefixes
    assert s["goals"]["auc_head_whole_mbpp_test"] == {"goal": 0.85, "value": 0.9, "met": True}


def test_the_eval_reads_an_mbpp_file_with_its_split(tmp_path):
    """`parse-vllm eval --prompts PATH:test` (tools/eval/tasks.py): the same tasks and checks
    the judge reads, named by split; the whole file without one; a bad split says why."""
    from parse_vllm.tools.eval import tasks

    path = _mbpp_file(tmp_path / "mbpp.jsonl")
    (test,) = tasks.load_sets([f"{path}:test"], checkable_n=4)
    assert test.name == "mbpp-test" and test.items == prompts.load_mbpp(path, "test").items
    assert [it["id"] for it in test.take(1)] == ["MBPP/11"] and test.checkable
    (whole,) = tasks.load_sets([str(path)], checkable_n=4)
    assert whole.name == "mbpp-all" and len(whole.items) == len(EDGES)
    with pytest.raises(tasks.PromptSetError, match="each part must be one of"):
        tasks.load_sets([f"{path}:dev"], checkable_n=4)
