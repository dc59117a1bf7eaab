"""The judge head: a regularised logistic read-out of the target's hidden state (scikit-learn).

StandardScaler then LogisticRegression (L2, ``class_weight="balanced"``), C chosen by
cross-validation with folds grouped by task (GroupKFold: the answers and prefixes of one task
are correlated, so a task is never on both sides of a split). The figures reported for the
tuning set are nested: each outer fold's C is chosen on the other folds alone, so the
out-of-fold scores never saw their own fold. The head is trained on whole answers and
prefixes together: the runtime judges both with one head, and both labels ask one question
(does accepting this text keep the final answer correct?).

Prefixes are a stratified sample of the runtime's boundaries (data.py: more of them from
failing answers), so every prefix carries a weight; AUCs, Brier scores, pass rates and the
fit use them, so the prefix figures stand for all boundaries of all answers. Prefix weights
are scaled to a mean of 1 (whole answers weigh 1): the two kinds keep their numbers of rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

C_GRID = tuple(float(c) for c in np.logspace(-4, 0, 9))
OUTER_FOLDS = 5
INNER_FOLDS = 4
# zero_shot_logit is kept only when it raises the cross-validated AUC (the mean of the whole
# and prefix AUCs) by at least this much
MIN_FEATURE_GAIN = 0.01
BOOTSTRAP = 1000
CURVE_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)
CURVE_REPEATS = 3


_ARRAYS = ("hidden", "zero_shot", "label", "whole", "task", "answer", "length", "weight")


@dataclass
class Examples:
    """One prompt set's labelled examples (data.stage_features' files)."""

    hidden: np.ndarray  # [N, H] float32
    zero_shot: np.ndarray  # [N] log P(Correct) - log P(Incorrect)
    label: np.ndarray  # [N] bool: passes
    whole: np.ndarray  # [N] bool: a whole answer (else a prefix)
    task: np.ndarray  # [N] task ids (the CV groups)
    answer: np.ndarray  # [N] answer index within its task
    length: np.ndarray  # [N] prefix length in tokens
    how: list[str]  # [N] where the label came from
    weight: np.ndarray  # [N] sampling weight (whole answers 1; prefixes scaled to a mean of 1)

    @classmethod
    def load(cls, folder: Path) -> Examples:
        index = [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines()]
        return cls(
            hidden=np.load(folder / "features.npy"),
            zero_shot=np.load(folder / "zero_shot.npy").astype(np.float64),
            label=np.array([bool(r["label"]) for r in index]),
            whole=np.array([r["kind"] == "whole" for r in index]),
            task=np.array([r["task"] for r in index]),
            answer=np.array([r["answer"] for r in index]),
            length=np.array([r["length"] for r in index]),
            how=[r["how"] for r in index],
            weight=_scaled_weights(index),
        )

    def __len__(self) -> int:
        return len(self.label)

    def features(self, names: tuple[str, ...]) -> np.ndarray:
        cols = [self.hidden.astype(np.float64)]
        if "zero_shot_logit" in names:
            cols.append(self.zero_shot[:, None])
        return np.concatenate(cols, axis=1)

    def subset(self, mask: np.ndarray) -> Examples:
        return Examples(
            **{k: getattr(self, k)[mask] for k in _ARRAYS},
            how=[h for h, m in zip(self.how, mask) if m],
        )

    def counts(self) -> dict[str, int]:
        return {
            "tasks": len(set(self.task)),
            "whole_pass": int((self.whole & self.label).sum()),
            "whole_fail": int((self.whole & ~self.label).sum()),
            "prefix_pass": int((~self.whole & self.label).sum()),
            "prefix_fail": int((~self.whole & ~self.label).sum()),
        }


def _scaled_weights(index: list[dict]) -> np.ndarray:
    w = np.array([float(r.get("weight", 1.0)) for r in index])
    prefix = np.array([r["kind"] == "prefix" for r in index])
    if prefix.any():
        w[prefix] = w[prefix] / w[prefix].mean()
    w[~prefix] = 1.0
    return w


def model(C: float):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(C=C, class_weight="balanced", max_iter=5000))


def fit(C: float, X: np.ndarray, y: np.ndarray, w: np.ndarray):
    return model(C).fit(X, y, logisticregression__sample_weight=w)


def fit_score(C: float, X_train, y_train, w_train, X_test) -> np.ndarray:
    """Decision values of the model fitted on the training rows (a training set of one class
    -- a small share of the tasks -- says nothing: zeros)."""
    if y_train.all() or not y_train.any():
        return np.zeros(len(X_test))
    return fit(C, X_train, y_train, w_train).decision_function(X_test)


def auc(scores: np.ndarray, labels: np.ndarray, weight: np.ndarray | None = None) -> float | None:
    from sklearn.metrics import roc_auc_score

    if labels.all() or not labels.any():
        return None
    return float(roc_auc_score(labels, scores, sample_weight=weight))


def kind_aucs(scores: np.ndarray, ex: Examples) -> tuple[float | None, float | None]:
    w, p = ex.whole, ~ex.whole
    return auc(scores[w], ex.label[w], ex.weight[w]), auc(scores[p], ex.label[p], ex.weight[p])


def _mean(values) -> float:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else float("nan")


def oof(X: np.ndarray, ex: Examples, C: float, folds: int) -> np.ndarray:
    """Out-of-fold decision values [N] of the model with C, folds grouped by task."""
    from sklearn.model_selection import GroupKFold

    out = np.zeros(len(ex))
    for train, test in GroupKFold(n_splits=min(folds, len(set(ex.task)))).split(X, ex.label, ex.task):
        out[test] = fit_score(C, X[train], ex.label[train], ex.weight[train], X[test])
    return out


def choose_c(X: np.ndarray, ex: Examples, folds: int = INNER_FOLDS, grid=C_GRID) -> tuple[float, list[dict]]:
    """C of the best grouped-CV AUC (the mean of the whole-answer and prefix AUCs), and the grid's scores."""
    table = []
    for C in grid:
        w, p = kind_aucs(oof(X, ex, C, folds), ex)
        table.append({"C": C, "auc_whole": w, "auc_prefix": p, "score": _mean([w, p])})
    best = max(table, key=lambda r: (r["score"], -r["C"]))
    return best["C"], table


def nested_oof(X: np.ndarray, ex: Examples, grid=C_GRID) -> tuple[np.ndarray, list[float]]:
    """Out-of-fold decision values [N] where each outer fold's C was chosen on the other folds."""
    from sklearn.model_selection import GroupKFold

    out, chosen = np.zeros(len(ex)), []
    for train, test in GroupKFold(n_splits=OUTER_FOLDS).split(X, ex.label, ex.task):
        inner = ex.subset(np.isin(np.arange(len(ex)), train))
        C, _ = choose_c(X[train], inner, grid=grid)
        chosen.append(C)
        out[test] = fit_score(C, X[train], ex.label[train], ex.weight[train], X[test])
    return out, chosen


def bootstrap_auc(scores, labels, weight, task, seed: int = 0) -> list[float] | None:
    """95% interval of the AUC, resampling tasks (with all their rows) with replacement."""
    if auc(scores, labels) is None:
        return None
    tasks = np.unique(task)
    rows = {t: np.flatnonzero(task == t) for t in tasks}
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(BOOTSTRAP):
        idx = np.concatenate([rows[t] for t in rng.choice(tasks, size=len(tasks), replace=True)])
        a = auc(scores[idx], labels[idx], weight[idx])
        if a is not None:
            vals.append(a)
    return [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))]


def brier(p: np.ndarray, labels: np.ndarray, weight: np.ndarray) -> float | None:
    from sklearn.metrics import brier_score_loss

    return float(brier_score_loss(labels, p, sample_weight=weight)) if len(labels) else None


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))


def scores_report(z_head: np.ndarray, ex: Examples, split: str) -> dict[str, Any]:
    """AUCs with task-bootstrap intervals and Brier scores of the zero-shot judge and the
    head, whole answers and prefixes, counts; keys suffixed with the split."""
    out: dict[str, Any] = {}
    for kind, mask in (("whole", ex.whole), ("prefix", ~ex.whole)):
        y, t, w = ex.label[mask], ex.task[mask], ex.weight[mask]
        for name, z in (("zero_shot", ex.zero_shot), ("head", z_head)):
            out[f"auc_{name}_{kind}_{split}"] = auc(z[mask], y, w)
            out[f"auc_{name}_{kind}_{split}_ci"] = bootstrap_auc(z[mask], y, w, t)
            out[f"brier_{name}_{kind}_{split}"] = brier(sigmoid(z[mask]), y, w)
        out[f"n_{kind}_pass_{split}"] = int(y.sum())
        out[f"n_{kind}_fail_{split}"] = int((~y).sum())
    return out


def pass_rates(z: np.ndarray, ex: Examples, taus=(0.5, 0.7, 0.8, 0.9, 0.95)) -> dict[str, dict]:
    """What a threshold τ on a judgment would do: the share of passing and failing
    examples it accepts, whole answers and prefixes."""
    from parse_vllm.judge_head import logit_threshold

    out = {}
    for tau in taus:
        zt = float(logit_threshold(tau))
        row = {}
        for kind, mask in (("whole", ex.whole), ("prefix", ~ex.whole)):
            y, w = ex.label[mask], ex.weight[mask]
            acc = z[mask] >= zt
            row[kind] = {
                "right": float(np.average(acc[y], weights=w[y])) if y.any() else None,
                "wrong": float(np.average(acc[~y], weights=w[~y])) if (~y).any() else None,
            }
        out[f"{tau:g}"] = row
    return out


def data_size_curve(X: np.ndarray, ex: Examples, seed: int = 0, log=print) -> list[dict]:
    """AUC against the number of training examples: in each outer fold, the model (C chosen
    by 3-fold grouped CV on the subset) is trained on a random share of that fold's training
    tasks and scored on the held-out fold; the out-of-fold scores of all folds give one AUC
    per kind; averaged over CURVE_REPEATS draws (one at the full share)."""
    from sklearn.model_selection import GroupKFold

    rng = np.random.default_rng(seed)
    folds = list(GroupKFold(n_splits=OUTER_FOLDS).split(X, ex.label, ex.task))
    curve = []
    for frac in CURVE_FRACTIONS:
        reps = []
        for _ in range(1 if frac == 1.0 else CURVE_REPEATS):
            out, n_train, skipped = np.zeros(len(ex)), [], False
            for train, test in folds:
                tasks = np.unique(ex.task[train])
                keep = rng.choice(tasks, size=max(3, round(frac * len(tasks))), replace=False)
                tr = train[np.isin(ex.task[train], keep)]
                sub = ex.subset(np.isin(np.arange(len(ex)), tr))
                if sub.label.all() or not sub.label.any():
                    skipped = True
                    break
                C, _ = choose_c(X[tr], sub, folds=3, grid=C_GRID[::2])
                out[test] = fit_score(C, X[tr], ex.label[tr], ex.weight[tr], X[test])
                n_train.append(len(tr))
            if skipped:
                continue
            w, p = kind_aucs(out, ex)
            reps.append({"n_train": float(np.mean(n_train)), "auc_whole": w, "auc_prefix": p})
        if reps:
            point = {
                "fraction": frac,
                "n_train": round(float(np.mean([r["n_train"] for r in reps])), 1),
                "auc_whole": _mean(r["auc_whole"] for r in reps),
                "auc_prefix": _mean(r["auc_prefix"] for r in reps),
                "repeats": len(reps),
            }
            curve.append(point)
            log(
                f"data-size curve: {point['n_train']:.0f} training examples: AUC whole "
                f"{point['auc_whole']:.3f}, prefixes {point['auc_prefix']:.3f}"
            )
    return curve


def export(pipe, features: tuple[str, ...], identity, training: dict[str, Any]):
    """The fitted pipeline as a JudgeHead: mean/scale from the scaler, weight/bias from the
    logistic model over the standardised features."""
    from parse_vllm.judge_head import JudgeHead

    scaler, lr = pipe[0], pipe[-1]
    return JudgeHead(
        weight=np.asarray(lr.coef_[0], dtype=np.float64),
        bias=float(lr.intercept_[0]),
        mean=np.asarray(scaler.mean_, dtype=np.float64),
        scale=np.asarray(scaler.scale_, dtype=np.float64),
        features=tuple(features),
        identity=identity,
        training=training,
    )


def head_logits(head, ex: Examples) -> np.ndarray:
    return head.logit(ex.hidden, ex.zero_shot if "zero_shot_logit" in head.features else None)


def train(ex: Examples, split: str, features: str = "auto", log=print) -> dict[str, Any]:
    """Cross-validate, choose the features and C, fit the head on every example of the set.
    Returns the report's numbers and the fitted pipeline (``"pipe"``)."""
    candidates = {
        "auto": [("hidden",), ("hidden", "zero_shot_logit")],
        "hidden": [("hidden",)],
        "hidden,zero_shot_logit": [("hidden", "zero_shot_logit")],
    }[features]
    compared = {}
    for names in candidates:
        z, chosen = nested_oof(ex.features(names), ex)
        w, p = kind_aucs(z, ex)
        compared[",".join(names)] = {"auc_whole": w, "auc_prefix": p, "score": _mean([w, p]), "C_per_fold": chosen}
        compared[",".join(names)]["_oof"] = z
        log(f"train: features {','.join(names)}: nested-CV AUC whole {w}, prefixes {p} (C per fold {chosen})")
    keep = candidates[0]
    if len(candidates) > 1:
        a, b = (compared[",".join(n)]["score"] for n in candidates)
        keep = candidates[1] if b - a >= MIN_FEATURE_GAIN else candidates[0]
    z_oof = compared[",".join(keep)].pop("_oof")
    for v in compared.values():
        v.pop("_oof", None)
    X = ex.features(keep)
    C, grid = choose_c(X, ex)
    pipe = fit(C, X, ex.label, ex.weight)
    log(f"train: features kept {','.join(keep)}, C {C:g} (grouped {INNER_FOLDS}-fold CV on all {len(ex)} examples)")

    # which labels to train on: whole answers only, prefixes only, both (nested CV, features kept)
    by_labels = {}
    for name, mask in (("whole", ex.whole), ("prefix", ~ex.whole)):
        sub = ex.subset(mask)
        if sub.label.all() or not sub.label.any() or len(set(sub.task)) < OUTER_FOLDS:
            continue
        z_sub = _train_on_predict_all(X, ex, mask)
        w, p = kind_aucs(z_sub, ex)
        by_labels[f"{name} only"] = {"auc_whole": w, "auc_prefix": p}
    by_labels["both"] = dict(zip(("auc_whole", "auc_prefix"), kind_aucs(z_oof, ex)))
    log(f"train: by training labels {by_labels}")

    curve = data_size_curve(X, ex, log=log)
    return {
        "pipe": pipe,
        "features": keep,
        "C": C,
        "oof": z_oof,
        "C_grid": grid,
        "feature_comparison": compared,
        "training_labels_comparison": by_labels,
        "data_size_curve": curve,
        "scores": scores_report(z_oof, ex, split),
        "pass_rates_head": pass_rates(z_oof, ex),
        "pass_rates_zero_shot": pass_rates(ex.zero_shot, ex),
    }


def _train_on_predict_all(X: np.ndarray, ex: Examples, train_mask: np.ndarray) -> np.ndarray:
    """Nested-CV scores of every example from models trained on the ``train_mask`` rows of the
    other folds only."""
    from sklearn.model_selection import GroupKFold

    out = np.zeros(len(ex))
    for train, test in GroupKFold(n_splits=OUTER_FOLDS).split(X, ex.label, ex.task):
        tr = train[train_mask[train]]
        sub = ex.subset(np.isin(np.arange(len(ex)), tr))
        C, _ = choose_c(X[tr], sub, grid=C_GRID[::2])
        out[test] = fit_score(C, X[tr], ex.label[tr], ex.weight[tr], X[test])
    return out
