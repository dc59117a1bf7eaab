"""`parse-vllm train-judge` (parse_vllm/tools/judge/) through the command line, on the tiny
random models and a small fake prompt set of Python functions with asserts.

The draft's answers and the target's continuations are scripted (the answers are code that
passes or fails its asserts; the target continues a prefix with the rest of the answer it
came from): the labels are then known, and the stages, the shortcuts, the resumption and the
training run in seconds. The features come from a real vLLM pooling engine over the tiny
target and are checked against an HF forward; one more test runs the real vLLM writers
(draft answers, the target's answers and continuations) against HF greedy decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")

from parse_vllm import cli  # noqa: E402
from parse_vllm.tools.judge import data as jdata  # noqa: E402

NUM_TASKS = 12
FAILED_BY_TARGET = {3, 8}  # tasks whose target answer is wrong: no prefix of theirs is labelled
WINDOW = 16  # answers are ~30 tokens: two or three windows each
# The trainings here draw the data-size curve at two shares of the training tasks, not probe.CURVE_FRACTIONS'
# five: the same fits (C by grouped CV on a share of the tasks, scored out of fold; repeated draws below the
# full share), about a third as many; the curve was over half of a training's fits, and no test reads its
# points beyond the last (the full share).
CURVE_FRACTIONS = (0.5, 1.0)
# and choose C from three values, not probe.C_GRID's nine (every other one where a grid is halved): a
# third as many fits in each grouped CV; no test here reads which C was chosen
C_GRID = (1e-4, 1e-2, 1.0)


def _answer(k: int, op: str) -> str:
    return f"```python\ndef f(x):\n    y = x {op}\n    return y\n```"


def _answers_of(k: int) -> dict[str, list[str]]:
    """The draft's scripted answers of task k: greedy (right on even k), then three samples
    (one a duplicate of the greedy answer)."""
    right, wrong, other = _answer(k, f"+ {k + 1}"), _answer(k, f"- {k + 1}"), _answer(k, f"* {k + 3}")
    greedy = right if k % 2 == 0 else wrong
    return {"greedy": [greedy], "sample": [greedy, other, right if k % 3 else wrong]}


def _prompt_file(path: Path, ids: range, prefix: str) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"{prefix}{k}",
                    "prompt": f"Write f(x) returning x + {k + 1}.",
                    "test": f"assert f(1) == {k + 2}",
                }
            )
            + "\n"
            for k in ids
        )
    )
    return path


class Script:
    """Scripted writers: the draft writes `_answers_of`; the target's own answer is right but
    on FAILED_BY_TARGET, and it continues a prefix with the rest of the first draft answer
    that starts with it (its own answer where the prefix is one of its prefixes)."""

    def __init__(self, tok, models: dict[str, Path]):
        self.tok, self.models = tok, models
        self.eos = tok.eos_token_id
        self.calls: list[tuple[str, list[jdata.Request]]] = []
        self.prompts: dict[tuple[int, ...], int] = {}  # rendered prompt -> k

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def register(self, prompt_ids: list[int], k: int) -> None:
        self.prompts[tuple(prompt_ids)] = k

    def split(self, ids: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        for p, k in self.prompts.items():
            if ids[: len(p)] == p:
                return k, ids[len(p) :]
        raise AssertionError("a request whose prompt is not one of the set's")

    def target_answer(self, k: int) -> list[int]:
        return self.ids(_answer(k, f"- {k + 1}" if k in FAILED_BY_TARGET else f"+ {k + 1}"))

    def writer(self, engine: dict):
        role = "draft" if engine["model"] == str(self.models["draft"]) else "target"
        assert engine["model"] == str(self.models[role])

        class _W:
            def __call__(_, requests):
                self.calls.append((role, requests))
                return [self.write(role, r) for r in requests]

            def close(_):
                pass

        return _W()

    def write(self, role: str, r: jdata.Request) -> list[list[int]]:
        k, prefix = self.split(r.prompt_ids)
        if role == "draft":
            assert not prefix and r.max_tokens == 40
            texts = _answers_of(k)["greedy" if r.n == 1 else "sample"]
            assert len(texts) == r.n and (r.temperature == 0) == (r.n == 1)
            return [self.ids(t) + [self.eos] for t in texts]
        own = self.target_answer(k)
        if tuple(own[: len(prefix)]) == prefix:
            rest = own[len(prefix) :]
        else:
            source = next(a for t in _answers_of(k)["sample"] if tuple((a := self.ids(t))[: len(prefix)]) == prefix)
            rest = source[len(prefix) :]
        assert r.max_tokens == 40 - len(prefix) and r.temperature == 0 and r.n == 1
        return [rest + [self.eos]]


def _passes(text: str, k: int) -> bool:
    return f"+ {k + 1}" in text


def _pair_auc(scores, labels, weight=None) -> float:
    """ROC AUC by counting pairs (the weighted Mann-Whitney statistic): over every passing
    example i and failing one j, w_i w_j for s_i > s_j, half of it for a tie, over
    Σ w_pass · Σ w_fail. Independent of the code under test (probe.auc: sorts and sums)."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    w = np.ones(len(s)) if weight is None else np.asarray(weight, dtype=np.float64)
    num = 0.0
    for i in np.flatnonzero(y):
        for j in np.flatnonzero(~y):
            num += w[i] * w[j] * (1.0 if s[i] > s[j] else 0.5 if s[i] == s[j] else 0.0)
    return num / (w[y].sum() * w[~y].sum())


def _weights_by_hand(index: list[dict]) -> np.ndarray:
    """Whole answers weigh 1; prefixes their sampling weight over the prefixes' mean weight."""
    w = np.array([float(r.get("weight", 1.0)) if r["kind"] == "prefix" else 1.0 for r in index])
    prefix = np.array([r["kind"] == "prefix" for r in index])
    if prefix.any():
        w[prefix] /= w[prefix].mean()
    return w


# -- the probe's figures on made-up data (no engine) ----------------------------------------


def test_auc_and_brier_against_hand_computed_values():
    from parse_vllm.tools.judge import probe

    s, y = np.array([0.1, 0.4, 0.35, 0.8]), np.array([False, False, True, True])
    # pairs (pass, fail): 0.35 > 0.1, 0.35 < 0.4, 0.8 > 0.1, 0.8 > 0.4: 3 of 4
    assert probe.auc(s, y) == 0.75 == _pair_auc(s, y)
    # weights 1, 2, 1, 3: (1·1 + 3·1 + 3·2) / ((1 + 3)(1 + 2)) = 10 / 12
    w = np.array([1.0, 2.0, 1.0, 3.0])
    assert probe.auc(s, y, w) == pytest.approx(10 / 12, abs=1e-12) and _pair_auc(s, y, w) == pytest.approx(10 / 12)
    assert probe.auc(np.array([0.5, 0.5]), np.array([True, False])) == 0.5  # a tie counts half
    assert probe.auc(np.array([0.1, 0.9]), np.array([True, False])) == 0.0
    assert probe.auc(np.array([0.1, 0.9]), np.array([True, True])) is None  # one class: no AUC
    # P = sigmoid(0, ln 3, -ln 3) = 0.5, 0.75, 0.25 against pass, pass, fail:
    # (0.25 + 0.0625 + 0.0625) / 3 = 0.125; weighted 2, 1, 1: (0.5 + 0.0625 + 0.0625) / 4 = 0.15625
    p, lab = probe.sigmoid(np.array([0.0, np.log(3), -np.log(3)])), np.array([True, True, False])
    assert p == pytest.approx([0.5, 0.75, 0.25], abs=1e-12)
    assert probe.brier(p, lab, np.ones(3)) == pytest.approx(0.125, abs=1e-12)
    assert probe.brier(p, lab, np.array([2.0, 1.0, 1.0])) == pytest.approx(0.15625, abs=1e-12)


def test_auc_equals_sklearns_with_ties_and_weights():
    """probe.auc (one sort) against sklearn's roc_auc_score and the pair loop, on random
    scores rounded to make ties, weighted and not."""
    from sklearn.metrics import roc_auc_score

    from parse_vllm.tools.judge import probe

    rng = np.random.default_rng(3)
    for i in range(200):
        n = int(rng.integers(2, 60))
        y = rng.random(n) < 0.4
        y[0], y[1] = True, False
        s, w = np.round(rng.normal(size=n), i % 3), (rng.random(n) * 3 if i % 2 else None)
        got = probe.auc(s, y, w)
        assert got == pytest.approx(roc_auc_score(y, s, sample_weight=w), abs=1e-12)
        assert got == pytest.approx(_pair_auc(s, y, w), abs=1e-12)


def test_paired_auc_difference_against_hand_computed_values():
    """Two tasks, each one failing and one passing row. Judge a ranks 3 of the 4 pairs right
    (AUC 0.75), judge b all (1.0): difference -0.25. The bootstrap draws the two tasks: t1 t1
    or t2 t2 (probability 1/4 each; within a task both judges rank right: difference 0), or
    one of each (1/2: -0.25). So the 2.5th percentile is -0.25 and the 97.5th 0.0."""
    from parse_vllm.tools.judge import probe

    a, b = np.array([0.1, 0.4, 0.35, 0.8]), np.array([0.0, 0.1, 0.9, 1.0])
    y, task = np.array([False, False, True, True]), np.array(["t1", "t2", "t1", "t2"])
    diff, ci = probe.paired_auc_difference(a, b, y, np.ones(4), task)
    assert diff == -0.25 and ci == [-0.25, 0.0]
    diff, ci = probe.paired_auc_difference(b, a, y, np.ones(4), task)
    assert diff == 0.25 and ci == [0.0, 0.25]
    assert probe.paired_auc_difference(a, b, np.ones(4, dtype=bool), np.ones(4), task) is None  # one class


def _made_up(seed: int, tasks: int, per_task: int, dim: int, task_column: bool = False):
    """Examples with random features and labels drawn at random, independent of them: a
    whole answer and per_task - 1 prefixes per task. With task_column, feature 0 is the
    task's number (for a spy on the folds)."""
    from parse_vllm.tools.judge import probe

    rng = np.random.default_rng(seed)
    n = tasks * per_task
    hidden = rng.normal(size=(n, dim))
    if task_column:
        hidden[:, 0] = np.repeat(np.arange(tasks), per_task)
    return probe.Examples(
        hidden=hidden.astype(np.float32),
        zero_shot=rng.normal(size=n),
        label=rng.random(n) < 0.5,
        whole=np.tile([True] + [False] * (per_task - 1), tasks),
        task=np.repeat([f"t{i}" for i in range(tasks)], per_task),
        answer=np.zeros(n, dtype=int),
        length=np.zeros(n, dtype=int),
        how=["made up"] * n,
        weight=np.ones(n),
    )


def test_random_labels_give_an_out_of_fold_auc_near_one_half():
    """Labels independent of the features: the nested out-of-fold AUC must lie near 0.5 (600
    examples: its spread is about ±0.04), while the same model scored on its own training
    rows finds a pattern (AUC > 0.6): scoring a task with a model that saw it would show."""
    from parse_vllm.tools.judge import probe

    ex = _made_up(seed=0, tasks=150, per_task=4, dim=48)
    X = ex.features(("hidden",))
    z, _ = probe.nested_oof(X, ex)
    assert abs(_pair_auc(z, ex.label) - 0.5) < 0.08
    in_sample = probe.fit(1.0, X, ex.label, ex.weight).decision_function(X)
    assert _pair_auc(in_sample, ex.label) > 0.6


def test_no_task_is_scored_by_a_model_that_saw_it(monkeypatch):
    """Every fit of the whole training (feature choice, nested CV, C, the training-label
    comparison, the data-size curve): the tasks it trained on and the tasks it scored never
    overlap (feature 0 carries the task's number to a spy on probe.fit_score)."""
    from parse_vllm.tools.judge import probe

    calls = []
    real = probe.fit_score

    def spy(C, X_train, y_train, w_train, X_test):
        calls.append((set(X_train[:, 0].tolist()), set(X_test[:, 0].tolist())))
        return real(C, X_train, y_train, w_train, X_test)

    monkeypatch.setattr(probe, "fit_score", spy)
    monkeypatch.setattr(probe, "CURVE_FRACTIONS", CURVE_FRACTIONS)
    ex = _made_up(seed=1, tasks=20, per_task=3, dim=4, task_column=True)
    probe.train(ex, "made-up", log=lambda *a: None)
    assert len(calls) > 100
    for trained_on, scored in calls:
        assert trained_on and scored and not trained_on & scored


@pytest.fixture(scope="module")
def tok(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["target"])


@pytest.fixture(scope="module")
def script(tiny_models, tok):
    from parse_vllm.tools.eval.run import _render

    s = Script(tok, tiny_models)
    for k in range(NUM_TASKS + 6):
        s.register(_render(tok, {"prompt": f"Write f(x) returning x + {k + 1}.", "messages": None}), k)
    return s


def _argv(tiny_models, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train-judge",
        "--target", str(tiny_models["target"]),
        "--draft", str(tiny_models["draft"]),
        "--window", str(WINDOW),
        "--prompts", str(prompts),
        "--samples", "3",
        "--prefixes-passing", "2",
        "--prefixes-failing", "3",
        "--max-tokens", "40",
        "--engine", json.dumps({"kv_cache_memory_bytes": 64 << 20, "max_model_len": 512}),
        "--out", str(out),
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tiny_models, script, tmp_path_factory):
    """One whole run through the CLI on the fake tuning set (scripted writers, real features)."""
    from parse_vllm.tools.judge import probe

    mp = pytest.MonkeyPatch()
    mp.setattr(jdata, "open_writer", script.writer)
    mp.setattr(probe, "CURVE_FRACTIONS", CURVE_FRACTIONS)
    mp.setattr(probe, "C_GRID", C_GRID)
    root = tmp_path_factory.mktemp("judge")
    prompts = _prompt_file(root / "tune.jsonl", range(NUM_TASKS), "t")
    out = root / "out"
    try:
        assert cli.main(_argv(tiny_models, prompts, out)) == 0
    finally:
        mp.undo()
    return {"root": root, "prompts": prompts, "out": out, "data": out / "data" / "tune", "calls": list(script.calls)}


def _examples(n: int, seed: int = 0):
    from parse_vllm.tools.judge import probe

    rng = np.random.default_rng(seed)
    whole = np.arange(n) % 3 == 0
    return probe.Examples(
        hidden=np.zeros((n, 0), dtype=np.float32), zero_shot=rng.normal(size=n), label=rng.random(n) < 0.5,
        whole=whole, task=np.array([f"t{i // 3}" for i in range(n)]), answer=np.zeros(n, dtype=int),
        length=np.where(whole, 30, 10), how=[""] * n, weight=np.where(whole, 1.0, rng.uniform(0.5, 1.5, n)),
        source=np.array(["held"] * n),
    )  # fmt: skip


def test_score_tables_read_back_exactly_and_refuse_what_they_cannot_read(tmp_path):
    from parse_vllm.tools.judge import scores

    ex, z = _examples(30), np.random.default_rng(1).normal(size=30) / 3
    path = scores.write(tmp_path / "held.csv", ex, z, old_head=z + 1e-17 + 1 / 3)
    t = scores.read(path)
    assert np.array_equal(t.head, z) and np.array_equal(t.old_head, z + 1e-17 + 1 / 3)
    for k in ("zero_shot", "label", "whole", "weight", "length", "task"):
        assert np.array_equal(getattr(t.ex, k), getattr(ex, k)), k
    text = path.read_text().splitlines()
    for lines, needle in (
        ([*text[:3], text[3].rsplit(",", 1)[0], *text[4:]], "line 4 has"),  # a field short
        ([*text[:2], text[2].replace(",whole,", ",hole,").replace(",prefix,", ",prefx,"), *text[3:]], "column kind"),
        ([text[0], text[1].replace(",0,", ",x,", 1), *text[2:]], "held.csv"),  # answer not a number
    ):
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(scores.ScoresError, match=needle):
            scores.read(path)


def test_evaluating_again_without_the_older_head_drops_its_figures(tmp_path):
    from parse_vllm.tools.judge import scores

    ex, z = _examples(30), np.random.default_rng(2).normal(size=30)
    scores.write(scores.path_of(tmp_path, "held"), ex, z, old_head=-z)
    summary = {"train_split": "tune", "score_files": {"held": "scores/held.csv"}}
    first = scores.rescore(tmp_path, summary)
    assert first["auc_old_head_whole_held"] is not None and "brier_old_head_prefix_held" in first
    assert "auc_old_head_whole_held_ci" in first
    scores.write(scores.path_of(tmp_path, "held"), ex, z)  # the same split scored again, no older head
    again = scores.rescore(tmp_path, first)
    assert not [k for k in again if "old_head" in k] and again["auc_head_whole_held"] == first["auc_head_whole_held"]


def test_the_report_is_recomputed_from_its_score_tables(trained, tmp_path, capsys):
    """--report-only: every score figure from scores/<split>.csv; an edited table moves the
    figures by the hand computation, a broken one is refused with its path."""
    import csv

    out = tmp_path / "out"
    shutil.copytree(trained["out"], out, ignore=shutil.ignore_patterns("data"))
    before = json.loads((out / "summary.json").read_text())
    assert before["score_files"] == {"tune": "scores/tune.csv"}
    (out / "summary.md").unlink()
    assert cli.main(["train-judge", "--out", str(out), "--report-only"]) == 0  # the training report, unchanged
    for name in ("summary.json", "summary.md"):
        assert (out / name).read_bytes() == (trained["out"] / name).read_bytes(), name
    rows = list(csv.DictReader(open(out / "scores" / "tune.csv")))
    whole = [r for r in rows if r["kind"] == "whole"]
    z, y = [float(r["head"]) for r in whole], [r["label"] == "1" for r in whole]
    assert before["auc_head_whole_tune"] == pytest.approx(_pair_auc(z, y), abs=1e-12)
    # the worst-scored failing whole answer relabelled passing: now ranked below every failing one
    flip = min((i for i, r in enumerate(rows) if r["kind"] == "whole" and r["label"] == "0"),
               key=lambda i: float(rows[i]["head"]))  # fmt: skip
    rows[flip]["label"] = "1"
    with open(out / "scores" / "tune.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    assert cli.main(["train-judge", "--out", str(out), "--report-only"]) == 0
    after = json.loads((out / "summary.json").read_text())
    y2 = [r["label"] == "1" for r in rows if r["kind"] == "whole"]
    assert after["auc_head_whole_tune"] == pytest.approx(_pair_auc(z, y2), abs=1e-12)
    assert after["auc_head_whole_tune"] != before["auc_head_whole_tune"]
    assert after["n_whole_pass_tune"] == before["n_whole_pass_tune"] + 1
    assert {k: after[k] for k in ("C", "data_size_curve", "features_kept")} == {
        k: before[k] for k in ("C", "data_size_curve", "features_kept")}  # fmt: skip
    # what it cannot read is refused, saying where, and the report is left as it was
    kept = (out / "summary.json").read_bytes()
    (out / "scores" / "tune.csv").write_text("task,label\nt0,1\n")
    capsys.readouterr()
    assert cli.main(["train-judge", "--out", str(out), "--report-only"]) == 2
    assert "scores/tune.csv: not a score table" in capsys.readouterr().err
    (out / "scores" / "tune.csv").unlink()
    assert cli.main(["train-judge", "--out", str(out), "--report-only"]) == 2
    assert "no such score table" in capsys.readouterr().err
    assert (out / "summary.json").read_bytes() == kept
    assert cli.main(["train-judge", "--out", str(tmp_path / "none"), "--report-only"]) == 2
    assert "no report here" in capsys.readouterr().err
    (tmp_path / "older").mkdir()  # a report from before the score tables: nothing to recompute it from
    (tmp_path / "older" / "summary.json").write_text(
        json.dumps({k: v for k, v in before.items() if k != "score_files"})
    )
    assert cli.main(["train-judge", "--out", str(tmp_path / "older"), "--report-only"]) == 2
    assert "no score table of its training split" in capsys.readouterr().err
    assert cli.main(["train-judge", "--out", str(out), "--report-only", "--ship"]) == 2
    assert "only with --retau" in capsys.readouterr().err


def test_retau_writes_the_rules_tau_into_the_head_and_keeps_its_weights(trained, tmp_path, monkeypatch, capsys):
    """--report-only --retau: the failing whole answers' scores raised to log-odds 3 (P 0.95)
    leave no τ below 0.95 that takes <= 10% of them: the rule's τ_head becomes 0.95, written
    into OUT's head (and, with --ship, the shipped copy) with the weights untouched."""
    import csv

    from parse_vllm.judge_head import JudgeHead
    from parse_vllm.tools.judge import run as judge_run

    out = tmp_path / "out"
    shutil.copytree(trained["out"], out, ignore=shutil.ignore_patterns("data"))
    before = JudgeHead.load(out / "judge_head.safetensors")
    assert before.tau is not None and before.tau < 0.95
    rows = list(csv.DictReader(open(out / "scores" / "tune.csv")))
    for r in rows:
        if r["kind"] == "whole" and r["label"] == "0":
            r["head"] = "3.0"
    with open(out / "scores" / "tune.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    shipped = tmp_path / "judges"
    monkeypatch.setattr(judge_run, "SHIPPED", shipped)
    target = Path(json.loads((out / "summary.json").read_text())["models"]["target"]).name
    assert cli.main(["train-judge", "--out", str(out), "--report-only", "--retau", "--ship"]) == 2
    assert "no shipped head to update" in capsys.readouterr().err
    (shipped / target).mkdir(parents=True)
    shutil.copy(out / "judge_head.safetensors", shipped / target / "judge_head.safetensors")
    assert cli.main(["train-judge", "--out", str(out), "--report-only", "--retau", "--ship"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["tau_head"] == 0.95 and not s["tau_head_rule"]["met"]
    for path in (out / "judge_head.safetensors", shipped / target / "judge_head.safetensors"):
        after = JudgeHead.load(path)
        assert after.tau == 0.95 and "table" not in after.training["tau_head"]
        assert np.array_equal(after.weight, before.weight) and after.bias == before.bias
        assert after.features == before.features
        assert {k: v for k, v in after.training.items() if k != "tau_head"} == {
            k: v for k, v in before.training.items() if k != "tau_head"}  # fmt: skip
    assert cli.main(["train-judge", "--out", str(out), "--retau"]) == 2
    assert "--retau goes with --report-only" in capsys.readouterr().err


def test_the_committed_report_comes_from_the_committed_score_tables(tmp_path):
    """`make judge-coder`: bench/judge-coder/summary.json and summary.md, byte for byte, from
    the committed summary and scores/*.csv, without models."""
    src = Path(__file__).resolve().parents[1] / "bench" / "judge-coder"
    out = tmp_path / "judge-coder"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("data", "e2e-*", "*.png", "*.safetensors"))
    (out / "summary.md").unlink()
    assert cli.main(["train-judge", "--out", str(out), "--report-only"]) == 0
    for name in ("summary.json", "summary.md"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    # the shipped head is the report's head, at the τ its rule gives on the committed scores
    from parse_vllm.judge_head import JudgeHead

    shipped = JudgeHead.load(Path(__file__).resolve().parents[1] / "parse_vllm" / "judges"
                             / "qwen2.5-coder-1.5b-instruct" / "judge_head.safetensors")  # fmt: skip
    reported = JudgeHead.load(src / "judge_head.safetensors")
    summary = json.loads((src / "summary.json").read_text())
    assert shipped.tau == reported.tau == summary["tau_head"]
    assert np.array_equal(shipped.weight, reported.weight) and shipped.training == reported.training


def test_training_writes_the_report_and_a_head_for_the_target(trained, tiny_models):
    from parse_vllm.judge_head import JudgeHead

    out = trained["out"]
    s = json.loads((out / "summary.json").read_text())
    # the zero-shot figures, recomputed here from the data files without the code under test
    # (pairs counted, weights scaled by hand); the head's are out-of-fold (tested below on
    # made-up data: hand-computed cases, random labels, no task in its own fold)
    index = [json.loads(x) for x in (trained["data"] / "index.jsonl").read_text().splitlines()]
    z = np.load(trained["data"] / "zero_shot.npy").astype(np.float64)
    y = np.array([bool(r["label"]) for r in index])
    w = _weights_by_hand(index)
    for kind in ("whole", "prefix"):
        m = np.array([r["kind"] == kind for r in index])
        assert s[f"auc_zero_shot_{kind}_tune"] == pytest.approx(_pair_auc(z[m], y[m], w[m]), abs=1e-12)
        brier = float(np.sum(w[m] * (1 / (1 + np.exp(-z[m])) - y[m]) ** 2) / np.sum(w[m]))
        assert s[f"brier_zero_shot_{kind}_tune"] == pytest.approx(brier, abs=1e-12)
        assert (s[f"n_{kind}_pass_tune"], s[f"n_{kind}_fail_tune"]) == (int(y[m].sum()), int((~y[m]).sum()))
        for name in ("zero_shot", "head"):
            lo, hi = s[f"auc_{name}_{kind}_tune_ci"]
            assert lo <= s[f"auc_{name}_{kind}_tune"] <= hi
    labels = [json.loads(x) for x in (trained["data"] / "labels.jsonl").read_text().splitlines()]
    assert s["n_train"] == sum(r["label"] is not None for r in labels)
    assert s["n_whole_pass_tune"] + s["n_whole_fail_tune"] == sum(r["kind"] == "whole" for r in labels)
    assert s["features_kept"][0] == "hidden" and set(s["feature_comparison"]) == {"hidden", "hidden,zero_shot_logit"}
    assert [p["fraction"] for p in s["data_size_curve"]][-1] == 1.0
    assert all(p["n_train"] > 0 for p in s["data_size_curve"])
    assert s["data"]["tune"]["stage_seconds"]["features"] > 0
    pos = s["prefix_position"]["tune"]
    assert [r["position"] for r in pos] == ["first third", "middle third", "last third"]
    assert sum(r["pass"] + r["fail"] for r in pos) == s["n_prefix_pass_tune"] + s["n_prefix_fail_tune"]
    for name in ("summary.md", "roc.png", "reliability.png", "data_size.png"):
        assert (out / name).is_file()
    head = JudgeHead.load(out / "judge_head.safetensors")
    cfg = json.loads((tiny_models["target"] / "config.json").read_text())
    assert head.identity.hidden_size == cfg["hidden_size"] == 128
    assert head.identity.architecture == "LlamaForCausalLM" and head.identity.boundaries["mode"] == "sentence"
    assert head.features == tuple(s["features_kept"]) and head.training["examples"] == s["n_train"]
    # its fingerprint is the target's LM head at the labels' first tokens
    w = jdata.lm_head_rows(tiny_models["target"], [ids[0] for ids in head.identity.label_ids])
    assert head.fingerprint_mismatch(w[:, :16]) is None
    assert head.fingerprint_mismatch(w[:, :16] + 1.0) is not None


def test_labels_follow_the_scripted_continuations_and_take_the_shortcuts(trained, script, tok):
    rows = [json.loads(x) for x in (trained["data"] / "labels.jsonl").read_text().splitlines()]
    answers = {(a["task"], a["answer"]): a for a in map(json.loads, (trained["data"] / "boundaries.jsonl").open())}
    # greedy + 3 samples, one a duplicate of the greedy answer, another sometimes
    assert all(
        len([a for a in answers if a[0] == f"t{k}"]) == len(set(sum(_answers_of(k).values(), [])))
        for k in range(NUM_TASKS)
    )
    how = set()
    for r in rows:
        k = int(r["task"][1:])
        a = answers[(r["task"], r["answer"])]
        assert a["token_ids"][-1] != tok.eos_token_id  # stop token dropped, as drafts hold answers
        text = tok.decode(a["token_ids"])
        if r["kind"] == "whole":
            assert r["label"] == _passes(text, k) and r["how"] == "tests"
            continue
        if k in FAILED_BY_TARGET:
            assert r["label"] is None
            continue
        prefix = tuple(a["token_ids"][: r["length"]])
        own = script.target_answer(k)
        if tuple(own[: len(prefix)]) == prefix:
            assert r["how"] == "target answer" and r["label"] is True
        else:  # the script continues with the rest of the first draft answer that starts with it
            source = next(s for s in _answers_of(k)["sample"] if tuple(script.ids(s)[: len(prefix)]) == prefix)
            assert r["label"] == _passes(source, k) and r["how"] in ("own continuation", "shared continuation")
        how.add(r["how"])
    assert how == {"target answer", "own continuation", "shared continuation"}
    # continuations are asked only for prefixes no text of the target covers, each once
    asked = [r for role, reqs in trained["calls"] if role == "target" for r in reqs if r.max_tokens < 40]
    assert len(asked) == len({r.prompt_ids for r in asked}) == sum(r["how"] == "own continuation" for r in rows)
    # every boundary is a runtime boundary: rule.select within each W-token window (a window's
    # end, or a sentence end inside it), at most max_boundaries (8) per window
    from parse_vllm.boundaries import is_sentence_end

    for a in answers.values():
        n, bounds = len(a["token_ids"]), a["boundaries"]
        # stratified: 2 prefixes of a passing answer, 3 of a failing one, each weighing its share
        assert bounds[-1] == n and set(a["selected"]) <= set(bounds[:-1])
        assert len(a["selected"]) == min(2 if a["passed"] else 3, len(bounds) - 1)
        assert a["prefix_weight"] == (len(bounds) - 1) / len(a["selected"])
        assert all(b % WINDOW == 0 or b == n or is_sentence_end(tok.decode(a["token_ids"][b - 1 : b])) for b in bounds)
        assert set(range(WINDOW, n, WINDOW)) <= set(bounds) and len(bounds) <= 8 * -(-n // WINDOW)


def test_features_equal_an_hf_forward(trained, tiny_models, tok):
    import torch
    from transformers import AutoModelForCausalLM

    from parse_vllm.config import ParseConfig
    from parse_vllm.templates import build_template
    from parse_vllm.tools.eval.run import _render

    d = trained["data"]
    index = [json.loads(x) for x in (d / "index.jsonl").read_text().splitlines()]
    hidden, zs = np.load(d / "features.npy"), np.load(d / "zero_shot.npy")
    assert hidden.dtype == np.float32 and hidden.shape == (len(index), 128) and zs.shape == (len(index),)
    answers = {(a["task"], a["answer"]): a["token_ids"] for a in map(json.loads, (d / "boundaries.jsonl").open())}
    template = build_template(tok, ParseConfig())
    ext = template.labels.extension
    assert len(ext) == 1  # SmolLM2's "Incorrect" is two tokens: the general zero-shot path
    chat = list(template.suffix_ids[: -len(ext)])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).eval()
    picked = [r for r in index if r["kind"] == "whole"][:3] + [r for r in index if r["kind"] == "prefix"][:5]
    for r in picked:
        k = int(r["task"][1:])
        prompt = _render(tok, {"prompt": f"Write f(x) returning x + {k + 1}.", "messages": None})
        seq = prompt + answers[(r["task"], r["answer"])][: r["length"]] + chat + list(ext)
        with torch.no_grad():
            out = model(torch.tensor([seq]), output_hidden_states=True)
        h = out.hidden_states[-1][0, -1 - len(ext)].numpy()  # after the final norm: what the LM head reads
        assert np.abs(hidden[r["row"]] - h).max() <= 1e-4
        lp = torch.log_softmax(out.logits[0, -1 - len(ext) :], -1)
        yes = sum(float(lp[j, t]) for j, t in enumerate(template.labels.yes_ids))
        no = sum(float(lp[j, t]) for j, t in enumerate(template.labels.no_ids))
        assert abs(float(zs[r["row"]]) - (yes - no)) <= 1e-4


def test_the_exported_head_reproduces_the_probe_on_held_out_rows(trained, tiny_models, tok, tmp_path):
    from parse_vllm.config import ParseConfig
    from parse_vllm.judge_head import JudgeHead
    from parse_vllm.templates import build_template
    from parse_vllm.tools.judge import probe, run

    ex = probe.Examples.load(trained["data"])
    held = np.isin(ex.task, ["t0", "t1", "t2"])
    train = ex.subset(~held)
    for names in (("hidden",), ("hidden", "zero_shot_logit")):
        pipe = probe.model(0.05).fit(train.features(names), train.label)
        ident = run.identity(tiny_models["target"], tok, build_template(tok, ParseConfig()), ParseConfig())
        path = probe.export(pipe, names, ident, {"C": 0.05}).save(tmp_path / "h.safetensors")
        head = JudgeHead.load(path)
        test = ex.subset(held)
        want = pipe.decision_function(test.features(names))
        assert np.abs(probe.head_logits(head, test) - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
        assert head.mismatch(ident) is None


def test_a_rerun_skips_every_stage_and_a_cut_run_resumes_to_the_same_data(trained, tiny_models, script):
    from parse_vllm.judge_head import JudgeHead
    from parse_vllm.tools.judge import probe

    mp = pytest.MonkeyPatch()

    def no_engine(engine):
        raise AssertionError("a done stage started an engine")

    # the same command again: every stage is skipped, the head is trained again to the same bytes
    mp.setattr(jdata, "open_writer", no_engine)
    mp.setattr(jdata, "open_reader", no_engine)
    mp.setattr(probe, "CURVE_FRACTIONS", CURVE_FRACTIONS)  # as `trained` ran
    mp.setattr(probe, "C_GRID", C_GRID)
    before = JudgeHead.load(trained["out"] / "judge_head.safetensors")
    try:
        assert cli.main(_argv(tiny_models, trained["prompts"], trained["out"])) == 0
    finally:
        mp.undo()
    after = JudgeHead.load(trained["out"] / "judge_head.safetensors")
    assert np.array_equal(after.weight, before.weight) and after.bias == before.bias
    assert after.training == before.training and after.identity == before.identity

    # a fresh folder, every run stopped at the time bound after one batch: it gets there in steps
    mp.setattr(jdata, "open_writer", script.writer)
    out = trained["root"] / "cut"
    runs = 0
    try:
        while True:
            rc = cli.main(
                _argv(tiny_models, trained["prompts"], out, "--batch", "4", "--max-minutes", "0", "--data-only")
            )
            runs += 1
            assert rc in (0, 3) and runs < 40
            if rc == 0:
                break
    finally:
        mp.undo()
    assert runs > 5
    a, b = trained["data"], out / "data" / "tune"
    for name in ("answers.jsonl", "boundaries.jsonl", "labels.jsonl", "index.jsonl"):
        rows_a = sorted(map(json.dumps, map(json.loads, (a / name).open())))
        rows_b = sorted(map(json.dumps, map(json.loads, (b / name).open())))
        assert rows_a == rows_b, name
    ia = {
        (r["task"], r["answer"], r["length"], r["kind"]): r["row"] for r in map(json.loads, (a / "index.jsonl").open())
    }
    ib = {
        (r["task"], r["answer"], r["length"], r["kind"]): r["row"] for r in map(json.loads, (b / "index.jsonl").open())
    }
    fa, fb = np.load(a / "features.npy"), np.load(b / "features.npy")
    assert max(np.abs(fa[ia[key]] - fb[ib[key]]).max() for key in ia) <= 1e-5

    # a run killed while it wrote the answers: the line cut short and its task are written again
    killed = trained["root"] / "killed"
    (killed / "data" / "tune").mkdir(parents=True)
    for name in ("answers.jsonl", "answers.settings.json"):
        shutil.copy(b / name, killed / "data" / "tune" / name)
    text = (b / "answers.jsonl").read_text()
    (killed / "data" / "tune" / "answers.jsonl").write_text(text[: len(text) - 40])
    mp.setattr(jdata, "open_writer", script.writer)
    mp.setattr(jdata, "open_reader", _no_features)  # its labels are compared below, not its features
    try:
        assert cli.main(_argv(tiny_models, trained["prompts"], killed, "--data-only")) == 0
    finally:
        mp.undo()
    rows_k = sorted(map(json.dumps, map(json.loads, (killed / "data" / "tune" / "labels.jsonl").open())))
    assert rows_k == sorted(map(json.dumps, map(json.loads, (a / "labels.jsonl").open())))

    # other settings on a folder built with these are refused
    rc = cli.main(_argv(tiny_models, trained["prompts"], out, "--samples", "1", "--data-only"))
    assert rc == 2


class _ZeroFeatures:
    """The features stage's reader where a test reads no feature (zeros, the tiny target's width):
    no pooling engine started."""

    def __call__(self, sequences):
        return np.zeros((len(sequences), 128), dtype=np.float32)

    def close(self):
        pass


def _no_features(engine):
    return _ZeroFeatures()


def test_evaluate_scores_a_held_out_set_with_the_head_without_training(trained, tiny_models, script, capsys):
    from parse_vllm.judge_head import JudgeHead
    from parse_vllm.tools.judge import probe

    prompts = _prompt_file(trained["root"] / "held.jsonl", range(NUM_TASKS, NUM_TASKS + 6), "h")
    for k in range(NUM_TASKS, NUM_TASKS + 6):
        FAILED_BY_TARGET.discard(k)
    out = trained["root"] / "eval-out"
    shutil.copytree(trained["out"], out, ignore=shutil.ignore_patterns("data"))
    head_path = out / "judge_head.safetensors"
    before = JudgeHead.load(head_path)
    mp = pytest.MonkeyPatch()
    mp.setattr(jdata, "open_writer", script.writer)
    try:
        assert cli.main(_argv(tiny_models, prompts, out, "--evaluate", str(head_path))) == 0
    finally:
        mp.undo()
    assert np.array_equal(JudgeHead.load(head_path).weight, before.weight)  # no training
    s = json.loads((out / "summary.json").read_text())
    ex = probe.Examples.load(out / "data" / "held")
    # the head's log-odds by hand (w · (x - mean) / scale + b) and the AUCs by counting pairs
    head = JudgeHead.load(head_path)
    x = np.asarray(ex.hidden, dtype=np.float64)
    if "zero_shot_logit" in head.features:
        x = np.concatenate([x, ex.zero_shot[:, None]], axis=1)
    z = ((x - head.mean) / head.scale) @ head.weight + head.bias
    index = [json.loads(x) for x in (out / "data" / "held" / "index.jsonl").read_text().splitlines()]
    w = _weights_by_hand(index)
    assert np.allclose(w, ex.weight)
    assert s["auc_head_whole_held"] == pytest.approx(_pair_auc(z[ex.whole], ex.label[ex.whole]), abs=1e-9)
    p = ~ex.whole
    assert s["auc_zero_shot_prefix_held"] == pytest.approx(_pair_auc(ex.zero_shot[p], ex.label[p], w[p]), abs=1e-12)
    assert not np.allclose(ex.weight[p], 1.0)  # prefixes carry their sampling weights
    assert (
        s["held_n"] == len(ex)
        and s["auc_head_whole_tune"] == json.loads((trained["out"] / "summary.json").read_text())["auc_head_whole_tune"]
    )
    assert s["splits"] == ["tune", "held"] and "held" in (out / "summary.md").read_text()
    # the report, both splits, regenerated byte for byte from its score tables without models
    again = trained["root"] / "eval-again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("data", "*.png", "summary.md"))
    assert cli.main(["train-judge", "--out", str(again), "--report-only"]) == 0
    for name in ("summary.json", "summary.md"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    assert s["score_files"] == {"tune": "scores/tune.csv", "held": "scores/held.csv"}

    # a head for another target is refused, saying why
    other = JudgeHead.load(head_path)
    import dataclasses

    bad = dataclasses.replace(other, identity=dataclasses.replace(other.identity, hidden_size=64), weight=other.weight[:64],
                              mean=other.mean[:64], scale=other.scale[:64])  # fmt: skip
    if "zero_shot_logit" in other.features:
        bad = dataclasses.replace(bad, weight=other.weight[:65], mean=other.mean[:65], scale=other.scale[:65])
    bad.save(out / "bad.safetensors")
    capsys.readouterr()
    assert cli.main(_argv(tiny_models, prompts, out, "--evaluate", str(out / "bad.safetensors"))) == 2
    assert "hidden_size" in capsys.readouterr().err


def test_real_engines_write_the_answers_and_continuations_hf_greedy_writes(tiny_models, tmp_path, monkeypatch):
    """The vLLM writers (draft answers: greedy and seeded samples; the target's answers and
    continuations) against HF greedy decoding. Every text passes here (a scripted checker), so
    every task's prefixes are continued."""
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(jdata.Job, "check_texts", lambda self, texts: [True] * len(texts))
    monkeypatch.setattr(jdata, "open_reader", _no_features)  # the writers are tested here; features: above
    prompts = _prompt_file(tmp_path / "real.jsonl", range(2), "r")
    argv = _argv(tiny_models, prompts, tmp_path / "out", "--data-only", "--samples", "2")
    argv[argv.index("--max-tokens") + 1] = "12"
    assert cli.main(argv) == 0
    d = tmp_path / "out" / "data" / "real"
    answers = list(map(json.loads, (d / "answers.jsonl").open()))
    assert sorted((a["task"], a["source"]) for a in answers) == sorted(
        [(t, "greedy") for t in ("r0", "r1")] + [(t, "sample") for t in ("r0", "r1") for _ in range(2)]
    )
    from parse_vllm.tools.eval.run import _render

    tok_prompts = {}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["target"])
    for k in range(2):
        tok_prompts[f"r{k}"] = _render(tok, {"prompt": f"Write f(x) returning x + {k + 1}.", "messages": None})

    loaded = {}

    def hf_greedy(model_dir, ids, n):
        if model_dir not in loaded:  # each model loaded once
            loaded[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        m = loaded[model_dir]
        with torch.no_grad():
            out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(ids) :].tolist()

    for a in answers:
        if a["source"] == "greedy":
            assert a["token_ids"] == hf_greedy(tiny_models["draft"], tok_prompts[a["task"]], 12)[: len(a["token_ids"])]
    target = {r["task"]: r for r in map(json.loads, (d / "target.jsonl").open())}
    for t, r in target.items():
        assert r["token_ids"] == hf_greedy(tiny_models["target"], tok_prompts[t], 12)[: len(r["token_ids"])]
    conts = list(map(json.loads, (d / "continuations.jsonl").open()))
    assert conts, "no prefix needed a continuation"
    for c in conts[:3]:
        start = tok_prompts[c["task"]] + c["token_ids"][: c["start"]]
        rest = hf_greedy(tiny_models["target"], start, 12 - c["start"])
        assert c["token_ids"][c["start"] :] == rest[: len(c["token_ids"]) - c["start"]]
