"""PARSE parameters: engine-wide (`additional_config["parse"]`) and per request
(`SamplingParams.extra_args` / OpenAI `vllm_xargs`).

No vLLM import here: process 0 validates with this module before any engine
exists, and the worker reads the same dataclass.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# Measured on SmolLM2-135M-Instruct (8 hand-made cases): this wording rates
# garbage answers lower than the plainer "Is the answer so far correct?".
DEFAULT_QUESTION = "Is the assistant's answer above correct and well written so far? Answer Correct or Incorrect."

BOUNDARY_MODES = ("sentence", "tokens", "both")
DEFAULT_DRAFT_CHUNK = 2
VERIFIERS = ("auto", "forked", "kernel")
TOKEN_PROPOSERS = ("eagle3", "ngram")  # methods of parse.token_proposer
ON_REJECT_MODES = ("continue", "redraft", "adaptive")


class ParseConfigError(ValueError):
    """A PARSE parameter is unknown or has a bad value."""


@dataclass(frozen=True)
class ParseConfig:
    """Engine-wide PARSE parameters: the PARSE keys of
    `speculative_config={"method": "parse", "model": DRAFT, "num_speculative_tokens": W, ...}`,
    or `additional_config={"parse": {...}}` beside vLLM's own
    `{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": W}`.
    """

    # τ: a prefix passes when P(Correct) / (P(Correct) + P(Incorrect)) >= τ.
    # τ > 1 never passes (pure token-level speculation, lossless); τ = 0
    # accepts every draft whole. "head" (from_dict): the τ_head the judge head records.
    threshold: float = 0.5
    # Where the draft is cut for judging: "sentence" (sentence or line ends in
    # the detokenized draft), "tokens" (every `every` tokens), or "both".
    boundaries: str = "sentence"
    every: int = 32
    # At most this many judged prefixes (copies) per request per pass; the
    # whole draft (the holistic check) is always one of them.
    max_boundaries: int = 8
    # The user turn appended after each prefix, and the two answer labels
    # whose next-token probabilities are compared.
    question: str = DEFAULT_QUESTION
    labels: tuple[str, str] = ("Correct", "Incorrect")
    # A trained judge (`parse-vllm train-judge`): a head file, or the name of one shipped
    # with parse-vllm; the verification pass then reads its logistic read-out of the
    # target's hidden state instead of P(Correct) against P(Incorrect) (None: zero-shot).
    # It must have been trained for this target, question and labels.
    judge_head: str | None = None
    # Judge the whole draft first; run the prefix pass only for drafts that
    # fail it (cheaper when most drafts are right, one more pass when not).
    two_stage: bool = False
    # Token guard: a semantically accepted draft token must also be among the
    # target's top `guard` tokens at its position (0 = off). The judge reads
    # meaning; the guard catches a wrong digit or name it waves through.
    # 1 = exactly token-level acceptance: greedy requests take only draft
    # tokens the target itself would pick, sampled requests only what vLLM's
    # rejection sampler accepts.
    guard: int = 0
    # After a rejected draft: "continue" = the target writes the rest of the
    # answer (the paper), optionally with token-level speculation of
    # `spec_tokens` draft tokens (0: the target alone); "redraft" = the target writes up to `redraft_tokens` tokens or
    # to the next sentence end, then the draft drafts again, at most
    # `max_rounds` times; "adaptive" = each time a request could open a window,
    # window_policy.py chooses its length, or the token-level arm for a while,
    # from what the judge has taken and what a window costs on this engine.
    on_reject: str = "continue"
    spec_tokens: int = 0
    # on_reject "adaptive": the cost model's seconds per unit of each of
    # window_policy.FEATURES ("step", "target_forward", "target_tokens",
    # "draft_forwards", "draft_tokens", "verify_passes", "verify_tokens", "draft_calls"),
    # fixed instead of fitted online to this engine's step times. For decisions
    # that do not move with the machine's load (benchmarks, tests), or costs
    # measured once on the serving GPU. A feature not named costs 0.
    adaptive_step_costs: dict | None = None
    # Who writes the token-level drafts (`spec_tokens` tokens: after a
    # rejection, between redraft rounds, for PARSE-off requests and τ > 1):
    # None = the draft model that writes the windows; or a second proposer in
    # the same engine, named as vLLM's own speculative_config names it:
    # {"method": "eagle3", "model": HEAD} (an EAGLE-3 head for the target) or
    # {"method": "ngram", "prompt_lookup_max": 4, ...}. The draft model still
    # writes every window.
    token_proposer: dict | None = None
    # Draft tokens a window advances per engine step: a window of W tokens is
    # drafted over W / draft_chunk steps, its request out of the target's
    # batch meanwhile, so the other requests keep decoding instead of waiting
    # W draft steps (0 = the whole window in one step).
    draft_chunk: int = DEFAULT_DRAFT_CHUNK
    # Judge a window while it is drafted (windows.py): each time the part drafted since its
    # last judgment holds a boundary, that part goes to the target; the passing prefix is
    # taken and the window goes on, the first failing boundary ends it. The text taken is
    # the whole window's (at one-stage judging, no boundary dropped for max_boundaries),
    # and a rejection throws away at most a chunk or two of draft instead of the rest of W.
    judge_chunks: bool = False
    redraft_tokens: int = 32
    max_rounds: int = 4
    # How the verification pass attends over the cached prefixes: "forked"
    # (forked block tables + vLLM's own paged attention, with scratch KV
    # blocks; the CPU path), "kernel" (the fused prefix-verify kernel over the
    # backend's standard paged layout, no scratch; GPU), or "auto" (kernel
    # where available, else forked).
    verifier: str = "auto"
    # KV-cache blocks held back from the scheduler as scratch space for the
    # forked verification (0 = auto). More copies than fit run in chunks.
    scratch_blocks: int = 0
    # PARSE for requests that don't say otherwise in their extra_args.
    default_enabled: bool = True
    # Debugging aid: keep the last N judgments (prefix token ids, P(yes),
    # label logits) in the worker, readable with parse_vllm.get_judgments(llm).
    record_judgments: int = 0
    # Testing aid: after every step the worker scans the requests' block
    # tables and keeps high-water marks (blocks held, scratch blocks found in
    # a request's table), reported by the `parse_kv_blocks` RPC. Polls from
    # outside can miss a short load on a busy machine; this cannot. Costs a
    # scan of the block tables per step.
    audit_kv_blocks: bool = False
    # Testing aid: counts, per step, host-to-device copies PARSE's code makes from pageable
    # memory (outside its staged copies; on a GPU each waits for the stream), reported by
    # the `parse_step_audit` RPC as pageable_copies_max. Slows every step down.
    audit_transfers: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> ParseConfig:
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ParseConfigError(f"unknown PARSE option(s) {unknown}; known: {sorted(known)}")
        if "labels" in raw:
            labels = raw["labels"]
            if (
                not isinstance(labels, (list, tuple))
                or len(labels) != 2
                or not all(isinstance(x, str) and x.strip() for x in labels)
            ):
                raise ParseConfigError(f"parse.labels must be two non-empty strings, got {labels!r}")
            raw["labels"] = (labels[0], labels[1])
        if raw.get("threshold") == HEAD_THRESHOLD:
            raw["threshold"] = _head_threshold(raw.get("judge_head"))
        cfg = cls(**raw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(name: str, why: str) -> ParseConfigError:
            return ParseConfigError(f"parse.{name}={getattr(self, name)!r}: {why}")

        _check_threshold(self.threshold, "parse.threshold")
        if self.boundaries not in BOUNDARY_MODES:
            raise bad("boundaries", f"must be one of {BOUNDARY_MODES}")
        for name in ("every", "max_boundaries"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be an integer >= 1")
        _check_guard(self.guard, "parse.guard")
        for name in ("spec_tokens", "draft_chunk", "scratch_blocks", "record_judgments"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "must be an integer >= 0")
        for name in ("redraft_tokens", "max_rounds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be an integer >= 1")
        _check_token_proposer(self.token_proposer, self.spec_tokens)
        _check_step_costs(self.adaptive_step_costs, self.on_reject)
        if self.judge_head is not None and not (isinstance(self.judge_head, str) and self.judge_head.strip()):
            raise bad("judge_head", "must be a path to a judge head (or the name of a shipped one)")
        if self.verifier not in VERIFIERS:
            raise bad("verifier", f"must be one of {VERIFIERS}")
        if self.on_reject not in ON_REJECT_MODES:
            raise bad("on_reject", f"must be one of {ON_REJECT_MODES}")
        if not isinstance(self.question, str) or not self.question.strip():
            raise bad("question", "must be a non-empty string")
        if self.labels[0] == self.labels[1]:
            raise bad("labels", "the two labels must differ")
        for name in ("two_stage", "judge_chunks", "default_enabled", "audit_kv_blocks", "audit_transfers"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["labels"] = list(self.labels)
        return d


def _check_token_proposer(proposer: Any, spec_tokens: int) -> None:
    if proposer is None:
        return
    name = "parse.token_proposer"
    if not isinstance(proposer, dict):
        raise ParseConfigError(
            f'{name} must be an object such as {{"method": "eagle3", "model": HEAD}}, got {proposer!r}'
        )
    method = proposer.get("method")
    if method not in TOKEN_PROPOSERS:
        raise ParseConfigError(f"{name}.method must be one of {TOKEN_PROPOSERS}, got {method!r}")
    if method == "eagle3" and not (isinstance(proposer.get("model"), str) and proposer["model"].strip()):
        raise ParseConfigError(f'{name}: method "eagle3" needs "model", the EAGLE-3 head\'s folder')
    if "num_speculative_tokens" in proposer:
        raise ParseConfigError(
            f"{name}.num_speculative_tokens is not an option: parse.spec_tokens says how many tokens it proposes"
        )
    if spec_tokens < 1:
        raise ParseConfigError(
            f"{name} is set but parse.spec_tokens is 0: say how many tokens it proposes per step (e.g. 3)"
        )


def _check_step_costs(costs: Any, on_reject: str) -> None:
    """parse.adaptive_step_costs: None, or seconds (finite, >= 0) by window_policy.FEATURES name."""
    from parse_vllm.window_policy import FEATURES

    if costs is None:
        return
    name = "parse.adaptive_step_costs"
    if on_reject != "adaptive":
        raise ParseConfigError(f'{name} is read only by on_reject "adaptive", and on_reject is {on_reject!r}')
    if not isinstance(costs, dict) or not costs:
        raise ParseConfigError(
            f"{name} must be a non-empty object of seconds by feature {list(FEATURES)}, got {costs!r}"
        )
    unknown = sorted(set(costs) - set(FEATURES))
    if unknown:
        raise ParseConfigError(f"{name}: unknown feature(s) {unknown}; known: {list(FEATURES)}")
    for key, value in costs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ParseConfigError(f"{name}[{key!r}] must be a finite number of seconds >= 0, got {value!r}")


HEAD_THRESHOLD = "head"  # parse.threshold: the judge head's τ_head


def _head_threshold(judge_head: Any) -> float:
    if not judge_head:
        raise ParseConfigError(f'parse.threshold="{HEAD_THRESHOLD}" takes τ_head from parse.judge_head: name one')
    from parse_vllm.judge_head import JudgeHeadError, head_tau

    try:
        return head_tau(str(judge_head))
    except JudgeHeadError as e:
        raise ParseConfigError(f'parse.threshold="{HEAD_THRESHOLD}": {e}') from None


def _check_threshold(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        head = f' (or "{HEAD_THRESHOLD}" in parse.threshold)' if name == "parse.threshold" else ""
        raise ParseConfigError(f"{name} must be a number{head}, got {value!r}")
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ParseConfigError(f"{name} must be >= 0 (values above 1 never pass), got {value}")
    return value


def _check_guard(value: Any, name: str) -> int:
    # vllm_xargs may carry numbers as floats ("parse_guard": 4.0) or strings.
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParseConfigError(
            f"{name} must be an integer >= 0 (the target's top-k a semantically accepted "
            f"token must be in; 0 = off, 1 = token-level acceptance only), got {value!r}"
        )
    return value


# ---------------------------------------------------------------------------
# Per request: SamplingParams(extra_args={...}) / OpenAI {"vllm_xargs": {...}}.
# vllm_xargs values are flat (str | int | float | list), so the keys are flat.

PARSE_ARG = "parse"  # on/off for this request
THRESHOLD_ARG = "parse_threshold"  # τ for this request
GUARD_ARG = "parse_guard"  # token guard (top-k) for this request
REQUEST_KEYS = (PARSE_ARG, THRESHOLD_ARG, GUARD_ARG)

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


@dataclass(frozen=True)
class RequestOptions:
    enabled: bool
    threshold: float
    guard: int = 0


def request_options(extra_args: dict[str, Any] | None, config: ParseConfig) -> RequestOptions:
    """Resolve one request's PARSE options; raises ParseConfigError on a bad
    key or value. Keys that don't start with "parse" belong to others and are
    ignored."""
    enabled, threshold, guard = config.default_enabled, config.threshold, config.guard
    for key, value in (extra_args or {}).items():
        if not key.startswith(PARSE_ARG):
            continue
        if key == PARSE_ARG:
            enabled = _parse_bool(value, key)
        elif key == THRESHOLD_ARG:
            threshold = _check_threshold(value, key)
        elif key == GUARD_ARG:
            guard = _check_guard(value, key)
        else:
            raise ParseConfigError(f"unknown PARSE request option {key!r}; known: {list(REQUEST_KEYS)}")
    return RequestOptions(enabled=enabled, threshold=threshold, guard=guard)


def _parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ParseConfigError(f"{key} must be true/false (or 1/0, on/off), got {value!r}")


# ---------------------------------------------------------------------------
# Naming PARSE in vLLM's speculative config: {"method": "parse", "model": DRAFT,
# "num_speculative_tokens": W, <PARSE options>, <other draft-model keys of vLLM's>}.
# vLLM knows no method "parse": the plugin hands vLLM its draft-model config and the
# PARSE options as additional_config["parse"] (plugin.name_parse).

PARSE_METHOD = "parse"
VLLM_METHOD = "draft_model"  # vLLM's own method PARSE drafts with


def parse_option_names() -> set[str]:
    return {f.name for f in dataclasses.fields(ParseConfig)}


def split_speculative_config(
    spec: dict[str, Any], vllm_keys: set[str] | None = None, given: set[str] = frozenset()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A speculative config naming PARSE, split into vLLM's keys and PARSE's options.
    Keys are read as vLLM reads them ("num-speculative-tokens" is num_speculative_tokens).
    With `vllm_keys` (the fields of vLLM's SpeculativeConfig), a key that is neither
    PARSE's nor vLLM's is refused, saying which keys exist. `given`: keys said elsewhere
    (vLLM's --spec-model/--spec-tokens), not needed in `spec`."""
    if not isinstance(spec, dict):
        raise ParseConfigError(f'a speculative config naming "method": "{PARSE_METHOD}" is an object, got {spec!r}')
    spec = {str(k).replace("-", "_"): v for k, v in spec.items()}
    ours = parse_option_names()
    options = {k: v for k, v in spec.items() if k in ours}
    rest = {k: v for k, v in spec.items() if k not in ours}
    if vllm_keys is not None:
        unknown = sorted(set(rest) - set(vllm_keys))
        if unknown:
            import difflib

            near = {k: difflib.get_close_matches(k, sorted(ours | set(vllm_keys)), n=1) for k in unknown}
            hints = "".join(f"; {k!r}: did you mean {m[0]!r}?" for k, m in near.items() if m)
            raise ParseConfigError(
                f'speculative_config with "method": "{PARSE_METHOD}": unknown key(s) {unknown}{hints}. '
                f"PARSE's options: {sorted(ours)}; vLLM's draft-model keys: {sorted(set(vllm_keys) - {'method'})}"
            )
    for key, what in (("model", "the draft model (HF hub name or folder)"), ("num_speculative_tokens", "the window W")):
        if rest.get(key) is None and key not in given:
            raise ParseConfigError(f'speculative_config with "method": "{PARSE_METHOD}" needs "{key}": {what}')
    return rest, options


def merge_parse_options(
    from_spec: dict[str, Any], section: dict[str, Any] | None, where: str = 'additional_config["parse"]'
) -> dict[str, Any]:
    """PARSE options given in the speculative config and in `where` (another place that
    names them), as one: an option given in both must have one value."""
    section = dict(section or {})
    clash = sorted(k for k in set(from_spec) & set(section) if _plain(from_spec[k]) != _plain(section[k]))
    if clash:
        both = ", ".join(f"{k}: {from_spec[k]!r} in speculative_config, {section[k]!r} in {where}" for k in clash)
        raise ParseConfigError(f"PARSE option(s) set twice with different values ({both}); give each once")
    return {**section, **from_spec}


def _plain(value: Any) -> Any:
    """JSON's view of a value (a tuple and a list of the same items are one setting)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def parse_section(additional_config: Any) -> dict[str, Any] | None:
    """The raw `parse` section of vLLM's additional_config, or None when PARSE
    is not named."""
    if not isinstance(additional_config, dict):
        return None
    section = additional_config.get("parse")
    if section is None:
        return None
    if section is True:
        return {}
    if not isinstance(section, dict):
        raise ParseConfigError(f'additional_config["parse"] must be an object of PARSE options, got {section!r}')
    return section
