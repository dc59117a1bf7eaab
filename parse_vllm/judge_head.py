"""A trained judge: a logistic read-out of the hidden state the verification pass computes.

The zero-shot judgment reads P(Correct) against P(Incorrect) from the target's final hidden
state h at the verification suffix's last token (two rows of the LM head). A judge head is a
learned direction over the same vector:

    z = w · (x - mean) / scale + bias,   judgment = sigmoid(z)

where x is the copy's features: h itself (`hidden`, [H]) and, optionally, the zero-shot
log-odds log P(Correct) - log P(Incorrect) (`zero_shot_logit`, one value), both free in the
pass PARSE already runs, and the cheap evidence of the target's logits over the judged
prefix (`evidence.EVIDENCE_FEATURES`: the drafted tokens' mean, minimum and last-16 mean
log-probability, the share where the target's greedy token differs), free in the step's
forward. The step compares judgments in log-odds (z >= logit(τ)), so τ = 1 never passes
however sure the judge is.

On the device the pass reads w_h · h + w_z · zero-shot + b'; the evidence term w_e · e is a
few numbers per copy and is added on the host (`ReadOut.evidence_logit`), from per-token
values that travel with the step's one read of its inputs: no forward and no transfer more.

h is read where the judge's answer starts: at the chat suffix's last token (for labels of
several tokens the runtime appends the longer one's tokens but its last after the chat
suffix, `templates.LabelScoring`; those rows are not the head's input).

The file (safetensors, a few KiB): tensors `weight`, `mean`, `scale` [F] and `bias` [1],
float32; metadata `format`, `features`, `identity` (what it was trained for, `HeadIdentity`)
and `training` (free-form: data, cross-validated AUC, ...; `prompt_sets` (each set's name,
split and sha256) and `tau_head` (τ chosen by a rule on the training data) when written by
`parse-vllm train-judge` since issue 37). A head that reads evidence features is written as
format /2 (an older parse-vllm refuses it by its format); the others stay /1. An engine refuses a head whose
identity does not match its target, hidden size or verification suffix (`mismatch`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parse_vllm.evidence import EVIDENCE_FEATURES

FORMAT = "parse-vllm-judge-head/1"
FORMAT_EVIDENCE = "parse-vllm-judge-head/2"  # a head that reads EVIDENCE_FEATURES
FORMATS = (FORMAT, FORMAT_EVIDENCE)
SCALAR_FEATURES = ("zero_shot_logit", *EVIDENCE_FEATURES)  # one value each, after h
FEATURES = ("hidden", *SCALAR_FEATURES)
# LM-head columns a head keeps of each label's first token, to tell one set of weights
# from another with the same configuration (a base model and its instruct tune).
FINGERPRINT_DIMS = 16
FINGERPRINT_ATOL = 2e-2  # bf16 against float32 weights
FINGERPRINT_RTOL = 2e-2


class JudgeHeadError(ValueError):
    """A judge-head file cannot be read or does not fit the engine."""


@dataclass(frozen=True)
class HeadIdentity:
    """What a head was trained for: the target and the verification it reads."""

    target: str  # the target's name or folder (shown; not compared)
    architecture: str  # e.g. Qwen2ForCausalLM
    hidden_size: int
    num_layers: int
    vocab_size: int
    suffix_ids: tuple[int, ...]  # the runtime's verification suffix (templates.VerificationTemplate)
    question: str
    labels: tuple[str, str]
    label_ids: tuple[tuple[int, ...], tuple[int, ...]]  # each label's tokens after the suffix
    boundaries: dict[str, Any]  # the BoundaryRule it was trained on: mode, every, max_boundaries
    # [2, FINGERPRINT_DIMS]: the first columns of the LM-head rows of each label's first token
    lm_head_fingerprint: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadIdentity:
        d = dict(d)
        d["suffix_ids"] = tuple(int(x) for x in d["suffix_ids"])
        d["labels"] = tuple(d["labels"])
        d["label_ids"] = tuple(tuple(int(x) for x in ids) for ids in d["label_ids"])
        d["lm_head_fingerprint"] = tuple(tuple(float(x) for x in row) for row in d.get("lm_head_fingerprint", ((), ())))
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise JudgeHeadError(f"judge head identity: unknown field(s) {unknown}")
        return cls(**d)


@dataclass(frozen=True)
class JudgeHead:
    weight: np.ndarray  # [F] over standardised features
    bias: float
    mean: np.ndarray  # [F]
    scale: np.ndarray  # [F]
    features: tuple[str, ...]  # "hidden" then any of SCALAR_FEATURES, in feature order
    identity: HeadIdentity
    training: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [f for f in self.features if f not in FEATURES]
        if (
            unknown
            or not self.features
            or self.features[0] != "hidden"
            or len(set(self.features)) != len(self.features)
        ):
            raise JudgeHeadError(
                f"judge head features must be 'hidden' then any of {FEATURES[1:]}, got {self.features}"
            )
        n = self.num_features
        for name in ("weight", "mean", "scale"):
            a = getattr(self, name)
            if a.shape != (n,):
                raise JudgeHeadError(f"judge head {name} has shape {a.shape}, expected ({n},) for {self.features}")
            if not np.all(np.isfinite(a)):
                raise JudgeHeadError(f"judge head {name} has non-finite values")
        if np.any(self.scale <= 0):
            raise JudgeHeadError("judge head scale must be > 0")
        if not math.isfinite(self.bias):
            raise JudgeHeadError("judge head bias is not finite")

    @property
    def num_features(self) -> int:
        return self.identity.hidden_size + (len(self.features) - 1)

    def folded(self) -> tuple[np.ndarray, float]:
        """(w', b') with w' · x + b' = w · (x - mean) / scale + b: the read-out the pass runs."""
        w = self.weight / self.scale
        return w, float(self.bias - np.dot(w, self.mean))

    @property
    def reads_evidence(self) -> bool:
        return any(f in EVIDENCE_FEATURES for f in self.features)

    @property
    def prompt_sets(self) -> list[dict[str, Any]]:
        """The prompt sets it was trained on (name, split, sha256, ...); [] for older heads."""
        return list(self.training.get("prompt_sets", []))

    @property
    def tau(self) -> float | None:
        """τ_head: the threshold the training rule chose (None for older heads)."""
        t = self.training.get("tau_head")
        return None if t is None else float(t["tau"] if isinstance(t, dict) else t)

    def features_of(
        self, hidden: np.ndarray, zero_shot_logit: np.ndarray | None = None, evidence: np.ndarray | None = None
    ) -> np.ndarray:
        """[C, F] features from hidden states [C, H] (and log-odds [C], evidence [C, 4] in
        EVIDENCE_FEATURES order, when the head reads them), in the head's feature order."""
        cols = [np.asarray(hidden, dtype=np.float64)]
        for name in self.features[1:]:
            if name == "zero_shot_logit":
                if zero_shot_logit is None:
                    raise JudgeHeadError("this judge head reads the zero-shot log-odds too")
                cols.append(np.asarray(zero_shot_logit, dtype=np.float64).reshape(-1, 1))
            else:
                if evidence is None:
                    raise JudgeHeadError(f"this judge head reads the evidence feature {name!r} too")
                ev = np.asarray(evidence, dtype=np.float64).reshape(-1, len(EVIDENCE_FEATURES))
                cols.append(ev[:, EVIDENCE_FEATURES.index(name)][:, None])
        return np.concatenate(cols, axis=1)

    def logit(
        self, hidden: np.ndarray, zero_shot_logit: np.ndarray | None = None, evidence: np.ndarray | None = None
    ) -> np.ndarray:
        """z [C] (float64, on the host): the reference for `ReadOut`."""
        w, b = self.folded()
        return self.features_of(hidden, zero_shot_logit, evidence) @ w + b

    # -- the file ----------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        from safetensors.numpy import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT_EVIDENCE if self.reads_evidence else FORMAT,
            "features": json.dumps(list(self.features)),
            "identity": json.dumps(asdict(self.identity)),
            "training": json.dumps(self.training),
        }
        tensors = {
            "weight": self.weight.astype(np.float32),
            "mean": self.mean.astype(np.float32),
            "scale": self.scale.astype(np.float32),
            "bias": np.array([self.bias], dtype=np.float32),
        }
        save_file(tensors, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> JudgeHead:
        from safetensors import safe_open

        path = Path(path)
        if path.is_dir():
            path = path / "judge_head.safetensors"
        if not path.is_file():
            raise JudgeHeadError(f"parse.judge_head: no file {str(path)!r}")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
        except Exception as e:  # a file that is not safetensors
            raise JudgeHeadError(f"parse.judge_head: {str(path)!r} is not a judge head ({e})") from e
        if meta.get("format") not in FORMATS:
            raise JudgeHeadError(f"parse.judge_head: {str(path)!r} has format {meta.get('format')!r}, not {FORMAT!r}")
        missing = {"weight", "mean", "scale", "bias"} - tensors.keys()
        if missing:
            raise JudgeHeadError(f"parse.judge_head: {str(path)!r} lacks {sorted(missing)}")
        try:
            identity = HeadIdentity.from_dict(json.loads(meta["identity"]))
            features = tuple(json.loads(meta["features"]))
            training = json.loads(meta.get("training", "{}"))
        except (KeyError, TypeError, ValueError) as e:
            raise JudgeHeadError(f"parse.judge_head: {str(path)!r} has bad metadata ({e})") from e
        return cls(
            weight=tensors["weight"].astype(np.float64),
            bias=float(tensors["bias"].reshape(-1)[0]),
            mean=tensors["mean"].astype(np.float64),
            scale=tensors["scale"].astype(np.float64),
            features=features,
            identity=identity,
            training=training,
        )

    # -- does it fit this engine ----------------------------------------------------

    def mismatch(self, engine: HeadIdentity) -> str | None:
        """Why this head cannot judge for an engine whose own identity is `engine` (None: it
        can). The name is not compared (a folder may be renamed); the weights' fingerprint
        is, where both have one."""
        mine = self.identity
        for name in ("architecture", "hidden_size", "num_layers", "vocab_size"):
            if getattr(mine, name) != getattr(engine, name):
                return (
                    f"it was trained for a target with {name}={getattr(mine, name)!r} ({mine.target}), "
                    f"this engine's target has {getattr(engine, name)!r}"
                )
        if mine.suffix_ids != engine.suffix_ids or mine.label_ids != engine.label_ids:
            return (
                "it was trained on another verification suffix or labels "
                f"(question {mine.question!r}, labels {list(mine.labels)}); this engine asks "
                f"{engine.question!r} with labels {list(engine.labels)}: set parse.question and parse.labels "
                "as the head was trained, or train a head for these"
            )
        if mine.boundaries and engine.boundaries and dict(mine.boundaries) != dict(engine.boundaries):
            # its training examples were the prefixes this rule cuts: another rule asks it about
            # prefixes of another kind, where its τ and its AUC were never measured
            return (
                f"it was trained on prefixes cut by another boundary rule ({dict(mine.boundaries)}); this engine "
                f"cuts {dict(engine.boundaries)}: set parse.boundaries, parse.every and parse.max_boundaries as "
                "the head was trained, or train a head for this rule"
            )
        return None

    def fingerprint_mismatch(self, engine_fingerprint: np.ndarray) -> str | None:
        """Why the engine's weights are not the ones the head was trained on (None: they are,
        or the head has no fingerprint)."""
        mine = np.array(self.identity.lm_head_fingerprint, dtype=np.float64)
        if mine.size == 0:
            return None
        theirs = np.asarray(engine_fingerprint, dtype=np.float64)
        if theirs.shape != mine.shape or not np.allclose(theirs, mine, atol=FINGERPRINT_ATOL, rtol=FINGERPRINT_RTOL):
            return (
                f"the target's weights are not the ones it was trained on ({self.identity.target}): "
                "the LM-head rows of the labels differ"
            )
        return None


def lm_head_fingerprint(lm_head_weight: np.ndarray | torch.Tensor, label_ids) -> tuple[tuple[float, ...], ...]:
    """The fingerprint of a target's LM head [vocab, H] for labels (each label's token ids)."""
    w = torch.as_tensor(lm_head_weight).float()
    return tuple(tuple(float(x) for x in w[int(ids[0]), :FINGERPRINT_DIMS]) for ids in label_ids)


def logit_threshold(tau: float | np.ndarray) -> np.ndarray:
    """τ as log-odds: a judgment passes when z >= logit(τ). τ <= 0 -> -inf (every judgment
    passes), τ >= 1 -> +inf (none does: not even a judgment that rounds to P = 1.0)."""
    tau = np.asarray(tau, dtype=np.float64)
    with np.errstate(divide="ignore"):
        z = np.log(tau) - np.log1p(-np.minimum(tau, 1.0))
    return np.where(tau >= 1.0, np.inf, np.where(tau <= 0.0, -np.inf, z))


class ReadOut:
    """The head as the verification pass runs it, on the model's device: z = w' · h + b'
    (+ w_z · zero-shot log-odds), float32, folded from the standardisation once; a head that
    reads evidence adds w_e · e on the host (`evidence_logit`, float64)."""

    def __init__(self, head: JudgeHead, device: torch.device | str):
        w, b = head.folded()
        H = head.identity.hidden_size
        self.weight = torch.tensor(w[:H], dtype=torch.float32, device=device)  # [H]
        col = {name: H + i for i, name in enumerate(head.features[1:])}
        self.zero_shot_weight = float(w[col["zero_shot_logit"]]) if "zero_shot_logit" in col else 0.0
        # [4] in EVIDENCE_FEATURES order, 0 for a feature the head does not read
        self.evidence_weight = np.array([float(w[col[n]]) if n in col else 0.0 for n in EVIDENCE_FEATURES])
        self.reads_evidence = head.reads_evidence
        self.bias = b

    def evidence_logit(self, evidence: np.ndarray) -> np.ndarray:
        """evidence [C, 4] (EVIDENCE_FEATURES order, host) -> w_e · e [C] float64."""
        return np.asarray(evidence, dtype=np.float64).reshape(-1, len(EVIDENCE_FEATURES)) @ self.evidence_weight

    def logit(self, hidden: torch.Tensor, zero_shot_logit: torch.Tensor) -> torch.Tensor:
        """hidden [C, H] at each copy's chat-suffix end, zero-shot log-odds [C] -> z [C]."""
        z = hidden.float() @ self.weight + self.bias
        if self.zero_shot_weight:
            z = z + self.zero_shot_weight * zero_shot_logit.float()
        return z


def resolve_head_path(value: str) -> Path:
    """A head file or folder, or the name of a head shipped with parse-vllm
    (parse_vllm/judges/NAME)."""
    path = Path(value).expanduser()
    if path.exists():
        return path
    shipped = Path(__file__).parent / "judges" / value
    if shipped.exists():
        return shipped
    raise JudgeHeadError(f"parse.judge_head: no file {value!r} (nor a head shipped with parse-vllm by that name)")


def head_tau(value: str) -> float:
    """τ_head of the head `value` names (resolve_head_path): the τ its training rule chose on
    the training data; raises JudgeHeadError for a head trained before the rule."""
    path = resolve_head_path(value)
    tau = JudgeHead.load(path).tau
    if tau is None:
        raise JudgeHeadError(
            f"judge head {value!r} ({path}) records no τ_head (trained before its rule): give τ as a number"
        )
    return tau


def judgment_passes(z: np.ndarray, tau: float) -> np.ndarray:
    """[C] bool: judgments of log-odds `z` that pass τ. τ >= 1 passes none, even a judgment
    whose log-odds are infinite; τ <= 0 passes all."""
    z = np.asarray(z, dtype=np.float64)
    if tau >= 1.0:
        return np.zeros(z.shape, dtype=bool)
    return z >= logit_threshold(tau)


def engine_identity(
    target: str, architecture: str, hidden_size: int, num_layers: int, vocab_size: int, template, config
) -> HeadIdentity:
    """What an engine would ask of a head: its target's shape and its verification
    (`templates.VerificationTemplate` built from `config`, a ParseConfig)."""
    return HeadIdentity(
        target=target,
        architecture=architecture,
        hidden_size=int(hidden_size),
        num_layers=int(num_layers),
        vocab_size=int(vocab_size),
        suffix_ids=tuple(int(x) for x in template.suffix_ids),
        question=config.question,
        labels=tuple(config.labels),
        label_ids=(tuple(template.labels.yes_ids), tuple(template.labels.no_ids)),
        boundaries={"mode": config.boundaries, "every": config.every, "max_boundaries": config.max_boundaries},
    )


def load_for_engine(value: str, identity: HeadIdentity) -> JudgeHead:
    """The head `parse.judge_head` names, checked against the engine (`engine_identity`);
    raises JudgeHeadError saying why it cannot judge for it."""
    path = resolve_head_path(value)
    head = JudgeHead.load(path)
    why = head.mismatch(identity)
    if why is not None:
        raise JudgeHeadError(f"parse.judge_head={value!r} ({path}) cannot judge for this engine: {why}")
    return head
