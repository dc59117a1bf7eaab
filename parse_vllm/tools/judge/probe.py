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

Scalar features beside h (the zero-shot log-odds, the evidence of parse_vllm/evidence.py):
after standardisation each is multiplied by SCALAR_BOOST inside the fit, so that the L2
penalty that keeps the 1,536 hidden weights small (C ~ 1e-3) does not shrink a single
informative number to nothing (its penalty is SCALAR_BOOST² times weaker); the export folds
the factor into the head's scale. A scalar feature is kept only when the nested-CV score
(the mean of the whole-answer and prefix AUCs) rises by at least MIN_FEATURE_GAIN
(forward selection in a fixed order, `choose_feature_set`).

τ_head (`choose_tau`): the smallest τ on TAU_GRID whose out-of-fold rate of accepting
failing whole answers (weighted share judged >= τ) is at most TAU_MAX_WRONG on each training
set: as permissive as the training data allows while at most one failing answer in ten passes,
on every kind of task trained on. Pooled, the largest set would set τ for all: on the
committed data MBPP's 883 answers met the bound at τ 0.55 where HumanEval's 239 still let 20%
of their failing answers through.
"""

from __future__ import annotations

import contextvars
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parse_vllm.evidence import EVIDENCE_FEATURES

from .baselines import KL_FEATURES

C_GRID = tuple(float(c) for c in np.logspace(-4, 0, 9))
OUTER_FOLDS = 5
INNER_FOLDS = 4
# zero_shot_logit is kept only when it raises the cross-validated AUC (the mean of the whole
# and prefix AUCs) by at least this much
MIN_FEATURE_GAIN = 0.01
BOOTSTRAP = 1000
CURVE_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)
CURVE_REPEATS = 3
SCALAR_BOOST = 30.0  # scalar features' factor after standardisation (module docstring)
SCALARS = ("zero_shot_logit", *EVIDENCE_FEATURES)  # in the order forward selection tries them
TAU_GRID = tuple(round(0.5 + 0.025 * i, 3) for i in range(19))  # 0.5 .. 0.95
TAU_MAX_WRONG = 0.10
FEATURE_MODES = ("auto", "select", "hidden", "hidden,zero_shot_logit")

# the column from which the features are scalars (boosted), while train() runs; None: none
_SCALAR_FROM: contextvars.ContextVar[int | None] = contextvars.ContextVar("scalar_from", default=None)

_ARRAYS = ("hidden", "zero_shot", "label", "whole", "task", "answer", "length", "weight")
_OPTIONAL = ("evidence", "source", "kl", "hidden_at_prefix")
MATRICES = ("hidden", "hidden_at_prefix")  # features of H columns each; every other name is one column


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
    evidence: np.ndarray | None = None  # [N, 4] EVIDENCE_FEATURES (data.stage_evidence), if built
    source: np.ndarray | None = None  # [N] the prompt set's split name of each row (several sets)
    kl: np.ndarray | None = None  # [N, 6] baselines.KL_FEATURES (the baselines stage), if built
    hidden_at_prefix: np.ndarray | None = None  # [N, H] the target's hidden state at the prefix itself, if built

    @classmethod
    def load(cls, folder: Path, source: str | None = None) -> Examples:
        index = [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines()]
        ev, kl, at_prefix = folder / "evidence.npy", folder / "kl.npy", folder / "hidden_at_prefix.npy"
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
            evidence=np.load(ev).astype(np.float64) if ev.is_file() else None,
            source=None if source is None else np.array([source] * len(index)),
            kl=np.load(kl).astype(np.float64) if kl.is_file() else None,
            hidden_at_prefix=np.load(at_prefix) if at_prefix.is_file() else None,
        )

    @classmethod
    def concat(cls, parts: list[Examples]) -> Examples:
        """Several prompt sets' examples as one (each part with its `source`); task ids that
        two sets share are prefixed with the set's name."""
        if len(parts) == 1:
            return parts[0]
        seen: dict[str, str] = {}
        clash = False
        for p in parts:
            for t in set(p.task.tolist()):
                clash |= t in seen and seen[t] != p.source[0]
                seen.setdefault(t, p.source[0])

        def joined(name: str) -> np.ndarray | None:  # an optional array, where every part has it
            arrays = [getattr(p, name) for p in parts]
            return None if any(a is None for a in arrays) else np.concatenate(arrays)

        return cls(
            **{k: np.concatenate([getattr(p, k) for p in parts]) for k in _ARRAYS if k != "task"},
            task=np.concatenate(
                [np.char.add(f"{p.source[0]}:", p.task.astype(str)) if clash else p.task for p in parts]
            ),
            how=sum((p.how for p in parts), []),
            evidence=joined("evidence"),
            source=np.concatenate([p.source for p in parts]),
            kl=joined("kl"),
            hidden_at_prefix=joined("hidden_at_prefix"),
        )

    def __len__(self) -> int:
        return len(self.label)

    @property
    def scalars_available(self) -> tuple[str, ...]:
        return ("zero_shot_logit", *(EVIDENCE_FEATURES if self.evidence is not None else ()))

    def scalar(self, name: str) -> np.ndarray:
        if name == "zero_shot_logit":
            return self.zero_shot
        if name in KL_FEATURES:
            if self.kl is None:
                raise ValueError(f"feature {name!r}: no KL statistics in this data (build it with --baselines)")
            return self.kl[:, KL_FEATURES.index(name)]
        if self.evidence is None:
            raise ValueError(f"feature {name!r}: no evidence in this data (build it with --evidence)")
        return self.evidence[:, EVIDENCE_FEATURES.index(name)]

    def matrix(self, name: str) -> np.ndarray:
        m = getattr(self, name)
        if m is None:
            raise ValueError(f"feature {name!r}: not in this data (build it with --baselines)")
        return m.astype(np.float64)

    def features(self, names: tuple[str, ...]) -> np.ndarray:
        """[N, F] the named features, the H-column ones (MATRICES) first, in `names` order."""
        cols = [self.matrix(n) for n in names if n in MATRICES]
        cols += [self.scalar(n)[:, None] for n in names if n not in MATRICES]
        return np.concatenate(cols, axis=1)

    def subset(self, mask: np.ndarray) -> Examples:
        return Examples(
            **{k: getattr(self, k)[mask] for k in _ARRAYS},
            how=[h for h, m in zip(self.how, mask) if m],
            **{k: None if getattr(self, k) is None else getattr(self, k)[mask] for k in _OPTIONAL},
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


class BoostedScaler:
    """StandardScaler, then the columns from `start` on multiplied by `boost` (scikit-learn
    transformer; mean_ and scale_ as StandardScaler's with the boost folded into scale_)."""

    def __init__(self, start: int | None = None, boost: float = SCALAR_BOOST):
        self.start, self.boost = start, boost

    def get_params(self, deep: bool = True) -> dict:
        return {"start": self.start, "boost": self.boost}

    def set_params(self, **params):
        for k, v in params.items():
            setattr(self, k, v)
        return self

    def fit(self, X, y=None, sample_weight=None):
        from sklearn.preprocessing import StandardScaler

        sc = StandardScaler().fit(X)
        self.mean_ = sc.mean_
        self.scale_ = np.array(sc.scale_, dtype=np.float64)
        if self.start is not None and self.start < X.shape[1]:
            self.scale_[self.start :] = self.scale_[self.start :] / self.boost
        return self

    def transform(self, X):
        return (np.asarray(X, dtype=np.float64) - self.mean_) / self.scale_

    def fit_transform(self, X, y=None, **kw):
        return self.fit(X, y).transform(X)


def model(C: float):
    """The probe: standardisation (scalar features boosted while `train` runs) and an L2
    logistic regression."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    start = _SCALAR_FROM.get()
    scaler = StandardScaler() if start is None else BoostedScaler(start)
    return make_pipeline(scaler, LogisticRegression(C=C, class_weight="balanced", max_iter=5000))


def fit(C: float, X: np.ndarray, y: np.ndarray, w: np.ndarray):
    return model(C).fit(X, y, logisticregression__sample_weight=w)


def fit_score(C: float, X_train, y_train, w_train, X_test) -> np.ndarray:
    """Decision values of the model fitted on the training rows (a training set of one class
    -- a small share of the tasks -- says nothing: zeros)."""
    if y_train.all() or not y_train.any():
        return np.zeros(len(X_test))
    return fit(C, X_train, y_train, w_train).decision_function(X_test)


def auc(scores: np.ndarray, labels: np.ndarray, weight: np.ndarray | None = None) -> float | None:
    """Weighted ROC AUC: the weight share of (passing, failing) pairs the scores rank right, a
    tie counting half -- what sklearn's roc_auc_score gives (tests compare them), by one sort
    and cumulative sums, since the bootstraps call it tens of thousands of times."""
    labels = np.asarray(labels, dtype=bool)
    if labels.all() or not labels.any():
        return None
    w = np.ones(len(labels)) if weight is None else np.asarray(weight, dtype=np.float64)
    _, level = np.unique(np.asarray(scores, dtype=np.float64), return_inverse=True)
    pos = np.bincount(level, weights=w * labels)  # passing weight at each distinct score, ascending
    neg = np.bincount(level, weights=w * ~labels)
    below = np.cumsum(neg) - neg  # failing weight strictly below each score
    return float(np.dot(pos, below + 0.5 * neg) / (pos.sum() * neg.sum()))


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


def choose_c(X: np.ndarray, ex: Examples, folds: int = INNER_FOLDS, grid=None) -> tuple[float, list[dict]]:
    """C of the best grouped-CV AUC (the mean of the whole-answer and prefix AUCs), and the
    grid's scores (grid: default C_GRID, read at the call, as every grid here is)."""
    table = []
    for C in C_GRID if grid is None else grid:
        w, p = kind_aucs(oof(X, ex, C, folds), ex)
        table.append({"C": C, "auc_whole": w, "auc_prefix": p, "score": _mean([w, p])})
    best = max(table, key=lambda r: (r["score"], -r["C"]))
    return best["C"], table


def nested_oof(X: np.ndarray, ex: Examples, grid=None) -> tuple[np.ndarray, list[float]]:
    """Out-of-fold decision values [N] where each outer fold's C was chosen on the other folds."""
    from sklearn.model_selection import GroupKFold

    out, chosen = np.zeros(len(ex)), []
    for train, test in GroupKFold(n_splits=OUTER_FOLDS).split(X, ex.label, ex.task):
        inner = ex.subset(np.isin(np.arange(len(ex)), train))
        C, _ = choose_c(X[train], inner, grid=grid)
        chosen.append(C)
        out[test] = fit_score(C, X[train], ex.label[train], ex.weight[train], X[test])
    return out, chosen


def task_resamples(task: np.ndarray, seed: int = 0):
    """BOOTSTRAP row-index arrays, each the rows of len(tasks) tasks drawn with replacement
    (a task with all its rows), from one seeded generator: the same draws for every caller
    with the same tasks and seed."""
    tasks = np.unique(task)
    rows = {t: np.flatnonzero(task == t) for t in tasks}
    rng = np.random.default_rng(seed)
    for _ in range(BOOTSTRAP):
        yield np.concatenate([rows[t] for t in rng.choice(tasks, size=len(tasks), replace=True)])


def bootstrap_auc(scores, labels, weight, task, seed: int = 0) -> list[float] | None:
    """95% interval of the AUC, resampling tasks (with all their rows) with replacement."""
    if auc(scores, labels) is None:
        return None
    vals = []
    for idx in task_resamples(task, seed):
        a = auc(scores[idx], labels[idx], weight[idx])
        if a is not None:
            vals.append(a)
    return [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))]


def paired_auc_difference(a, b, labels, weight, task, seed: int = 0) -> tuple[float, list[float]] | None:
    """AUC(a) - AUC(b) of two judges scored on the same rows, with the 95% interval of a
    task bootstrap that draws the same tasks for both (paired: the judges' shared
    task-to-task spread cancels, which two separate intervals cannot show)."""
    base_a, base_b = auc(a, labels, weight), auc(b, labels, weight)
    if base_a is None or base_b is None:
        return None
    diffs = []
    for idx in task_resamples(task, seed):
        da, db = auc(a[idx], labels[idx], weight[idx]), auc(b[idx], labels[idx], weight[idx])
        if da is not None and db is not None:
            diffs.append(da - db)
    return base_a - base_b, [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))]


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
        y = ex.label[mask]
        for name, z in (("zero_shot", ex.zero_shot), ("head", z_head)):
            out.update(judge_figures(name, kind, split, z, ex, mask))
        out[f"n_{kind}_pass_{split}"] = int(y.sum())
        out[f"n_{kind}_fail_{split}"] = int((~y).sum())
    return out


def judge_figures(name: str, kind: str, split: str, z: np.ndarray, ex: Examples, mask: np.ndarray) -> dict[str, Any]:
    """One judge's AUC (with its task-bootstrap interval) and Brier score over the `mask` rows."""
    y, t, w = ex.label[mask], ex.task[mask], ex.weight[mask]
    return {
        f"auc_{name}_{kind}_{split}": auc(z[mask], y, w),
        f"auc_{name}_{kind}_{split}_ci": bootstrap_auc(z[mask], y, w, t),
        f"brier_{name}_{kind}_{split}": brier(sigmoid(z[mask]), y, w),
    }


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


def data_size_curve(
    X: np.ndarray, ex: Examples, seed: int = 0, log=print, pool: np.ndarray | None = None, name: str = ""
) -> list[dict]:
    """AUC against the number of training examples: in each outer fold, the model (C chosen
    by 3-fold grouped CV on the subset) is trained on a random share of that fold's training
    tasks and scored on the held-out fold; the out-of-fold scores of all folds give one AUC
    per kind; averaged over CURVE_REPEATS draws (one at the full share). `pool` [N] bool:
    only these rows are ever trained on (e.g. one prompt set's), every row is scored; with
    several sources each point has the AUCs per source too."""
    from sklearn.model_selection import GroupKFold

    rng = np.random.default_rng(seed)
    pool = np.ones(len(ex), dtype=bool) if pool is None else pool
    folds = list(GroupKFold(n_splits=OUTER_FOLDS).split(X, ex.label, ex.task))
    sources = [] if ex.source is None else list(dict.fromkeys(ex.source.tolist()))
    curve = []
    for frac in CURVE_FRACTIONS:
        reps = []
        for _ in range(1 if frac == 1.0 else CURVE_REPEATS):
            out, n_train, skipped = np.zeros(len(ex)), [], False
            for train, test in folds:
                train = train[pool[train]]
                tasks = np.unique(ex.task[train])
                if len(tasks) == 0:
                    skipped = True
                    break
                keep = rng.choice(tasks, size=min(len(tasks), max(3, round(frac * len(tasks)))), replace=False)
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
            rep = {"n_train": float(np.mean(n_train)), "auc_whole": w, "auc_prefix": p}
            if len(sources) > 1:
                rep["by_source"] = {sp: kind_aucs(out[ex.source == sp], ex.subset(ex.source == sp)) for sp in sources}
            reps.append(rep)
        if reps:
            point = {
                "fraction": frac,
                "n_train": round(float(np.mean([r["n_train"] for r in reps])), 1),
                "auc_whole": _mean(r["auc_whole"] for r in reps),
                "auc_prefix": _mean(r["auc_prefix"] for r in reps),
                "repeats": len(reps),
            }
            if len(sources) > 1:
                point["by_source"] = {
                    sp: {
                        "auc_whole": _mean(r["by_source"][sp][0] for r in reps),
                        "auc_prefix": _mean(r["by_source"][sp][1] for r in reps),
                    }
                    for sp in sources
                }
            curve.append(point)
            log(
                f"data-size curve{' (' + name + ')' if name else ''}: {point['n_train']:.0f} training examples: "
                f"AUC whole {point['auc_whole']:.3f}, prefixes {point['auc_prefix']:.3f}"
            )
    return curve


class _Boosting:
    """Scalar features boosted from column `start` on (None: off) for the fits in the block."""

    def __init__(self, start: int | None):
        self.start = start

    def __enter__(self):
        self.token = _SCALAR_FROM.set(self.start)
        return self

    def __exit__(self, *exc):
        _SCALAR_FROM.reset(self.token)


def boosting(names: tuple[str, ...], hidden_size: int) -> _Boosting:
    """The boost for a feature set: its scalars, after its H-column features (Examples.features'
    order), or all of them (no hidden state); none when it has no scalar."""
    matrices = sum(n in MATRICES for n in names)
    if matrices == len(names):
        return _Boosting(None)
    return _Boosting(hidden_size * matrices)


def choose_tau(z: np.ndarray, ex: Examples, max_wrong: float = TAU_MAX_WRONG, grid=TAU_GRID) -> dict[str, Any]:
    """τ_head by the rule (module docstring) from out-of-fold log-odds `z` of the training
    examples: the smallest τ on `grid` at which the weighted share of failing whole answers
    judged >= τ is <= max_wrong in every training set (``ex.source``; one set when None), the
    grid's largest τ if none is; with what each τ accepts, pooled and set by set."""
    from parse_vllm.judge_head import logit_threshold

    sets = [None] if ex.source is None else list(dict.fromkeys(ex.source.tolist()))

    def share(acc: np.ndarray, mask: np.ndarray, passing: bool) -> float | None:
        m = mask & (ex.label if passing else ~ex.label)
        return float(np.average(acc[m], weights=ex.weight[m])) if m.any() else None

    rows = []
    for tau in grid:
        acc = z >= float(logit_threshold(tau))
        row: dict[str, Any] = {"tau": tau}
        for kind, mask in (("whole", ex.whole), ("prefix", ~ex.whole)):
            row[f"{kind}_wrong"] = share(acc, mask, False)
            row[f"{kind}_right"] = share(acc, mask, True)
        if len(sets) > 1:
            row["whole_wrong_by_set"] = {sp: share(acc, ex.whole & (ex.source == sp), False) for sp in sets}
        rows.append(row)

    def worst(r: dict[str, Any]) -> float | None:
        rates = [v for v in r.get("whole_wrong_by_set", {"": r["whole_wrong"]}).values() if v is not None]
        return max(rates) if rates else None

    ok = [r for r in rows if worst(r) is not None and worst(r) <= max_wrong]
    chosen = min(ok, key=lambda r: r["tau"]) if ok else max(rows, key=lambda r: r["tau"])
    where = "in each training set" if len(sets) > 1 else "on the training data"
    return {
        "tau": chosen["tau"],
        "rule": (
            f"the smallest τ in {grid[0]:g}..{grid[-1]:g} (step {grid[1] - grid[0]:g}) whose out-of-fold rate of "
            f"accepting failing whole answers {where} is <= {max_wrong:g}"
        ),
        "max_wrong": max_wrong,
        "met": bool(ok),
        "at_tau": chosen,
        "table": rows,
    }


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
    return head.logit(
        ex.hidden,
        ex.zero_shot if "zero_shot_logit" in head.features else None,
        ex.evidence if head.reads_evidence else None,
    )


def _feature_modes(features: str, ex: Examples) -> tuple[list[tuple[str, ...]], bool]:
    """The candidate feature sets of a --features value, and whether to select forward."""
    if features == "auto":
        return [("hidden",), ("hidden", "zero_shot_logit")], False
    if features == "select":
        return [("hidden",), *[("hidden", f) for f in ex.scalars_available]], True
    names = tuple(n.strip() for n in features.split(",") if n.strip())
    if not names or names[0] != "hidden" or any(n not in SCALARS for n in names[1:]):
        raise ValueError(f"--features {features!r}: 'hidden' then any of {SCALARS}, or one of {FEATURE_MODES}")
    return [names], False


def choose_feature_set(ex: Examples, features: str, score) -> tuple[str, ...]:
    """The feature set a --features value keeps, `score(names)` rating a set (higher is
    better): with "select", forward selection from ("hidden",), each scalar in order kept when
    the set with it beats the set without by >= MIN_FEATURE_GAIN; with two candidates, the
    second when it beats the first by as much; an explicit list, itself."""
    candidates, forward = _feature_modes(features, ex)
    if forward:
        keep: tuple[str, ...] = ("hidden",)
        best = score(keep)
        for f in ex.scalars_available:
            trial = (*keep, f)
            if (sc := score(trial)) - best >= MIN_FEATURE_GAIN:
                keep, best = trial, sc
        return keep
    scores = [score(names) for names in candidates]
    return candidates[1] if len(candidates) > 1 and scores[1] - scores[0] >= MIN_FEATURE_GAIN else candidates[0]


def _nested_cv_figures(ex: Examples, cache: dict, log=print):
    """A scorer for choose_feature_set: a set's nested-CV score (the mean of the whole and
    prefix AUCs), its figures and out-of-fold values kept in `cache` by set."""
    H = ex.hidden.shape[1]

    def score(names: tuple[str, ...]) -> float:
        if names not in cache:
            with boosting(names, H):
                z, chosen = nested_oof(ex.features(names), ex)
            w, p = kind_aucs(z, ex)
            cache[names] = {"auc_whole": w, "auc_prefix": p, "score": _mean([w, p]), "C_per_fold": chosen, "_oof": z}
            log(f"train: features {','.join(names)}: nested-CV AUC whole {w}, prefixes {p} (C per fold {chosen})")
        return cache[names]["score"]

    return score


def feature_ablation(ex: Examples, kept: tuple[str, ...], cache: dict, log=print) -> list[dict]:
    """Nested-CV AUCs of feature sets around the kept one: h alone, h + each scalar, h + all
    scalars, the kept set without each of its scalars, the scalars alone (no h), and each
    scalar alone, unfitted (its own AUC, sign as is)."""
    H = ex.hidden.shape[1]
    scalars = list(ex.scalars_available)
    sets: list[tuple[str, ...]] = [("hidden",), *[("hidden", f) for f in scalars], ("hidden", *scalars), kept]
    sets += [tuple(n for n in kept if n != f) for f in kept[1:]]
    sets.append(tuple(scalars))
    rows, done = [], set()
    for names in sets:
        if names in done:
            continue
        done.add(names)
        if names not in cache:
            with boosting(names, H):
                z, chosen = nested_oof(ex.features(names), ex, grid=C_GRID[::2])
            w, p = kind_aucs(z, ex)
            cache[names] = {"auc_whole": w, "auc_prefix": p, "score": _mean([w, p]), "C_per_fold": chosen}
            log(f"ablation: {','.join(names)}: AUC whole {w}, prefixes {p}")
        c = cache[names]
        rows.append({"features": ",".join(names), "fitted": True, "kept": names == kept,
                     **{k: c[k] for k in ("auc_whole", "auc_prefix", "score")}})  # fmt: skip
    for f in scalars:
        w, p = kind_aucs(ex.scalar(f), ex)
        rows.append({"features": f, "fitted": False, "kept": False, "auc_whole": w, "auc_prefix": p,
                     "score": _mean([w, p])})  # fmt: skip
    return rows


def train(ex: Examples, split: str, features: str = "auto", log=print, ablation: bool | None = None) -> dict[str, Any]:
    """Cross-validate, choose the features and C, fit the head on every example of the set.
    Returns the report's numbers and the fitted pipeline (``"pipe"``). `features`: "auto"
    (h, and the zero-shot log-odds if it helps), "select" (forward selection over every
    scalar the data has: the zero-shot log-odds and, with evidence, EVIDENCE_FEATURES), or
    an explicit list. `ablation` (default: with "select"): the feature ablation table."""
    _, forward = _feature_modes(features, ex)
    H = ex.hidden.shape[1]
    cache: dict = {}  # every feature set tried, in order: its nested-CV figures
    keep = choose_feature_set(ex, features, _nested_cv_figures(ex, cache, log=log))
    compared = {",".join(n): {k: v for k, v in fig.items() if k != "_oof"} for n, fig in cache.items()}
    z_oof = cache[keep]["_oof"]
    X = ex.features(keep)
    with boosting(keep, H):
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
        curves = {}
        sources = [] if ex.source is None else list(dict.fromkeys(ex.source.tolist()))
        humaneval = [sp for sp in sources if sp in ("even", "odd", "all")]
        if len(sources) > 1 and humaneval:
            he = np.isin(ex.source, humaneval)
            curves["humaneval only"] = data_size_curve(X, ex, log=log, pool=he, name="HumanEval only")
            curves["humaneval + others"] = curve
    ablation_rows = None
    if ablation if ablation is not None else forward:
        ablation_rows = feature_ablation(ex, keep, cache, log=log)
    return {
        "pipe": pipe,
        "features": keep,
        "C": C,
        "oof": z_oof,
        "C_grid": grid,
        "feature_comparison": compared,
        "feature_ablation": ablation_rows,
        "scalar_boost": SCALAR_BOOST,
        "training_labels_comparison": by_labels,
        "data_size_curve": curve,
        "data_size_curves": curves,
        # the cross-validated AUCs the head records; the report's figures are scores.figures'
        "aucs": {"head": kind_aucs(z_oof, ex), "zero_shot": kind_aucs(ex.zero_shot, ex)},
        "examples_by_source": {sp: int((ex.source == sp).sum()) for sp in sources},
        "tau": choose_tau(z_oof, ex),
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
