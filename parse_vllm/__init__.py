"""parse-vllm: PARSE (PArallel pRefix Speculative Engine) for vLLM.

Name PARSE with `additional_config={"parse": {...}}` next to a draft-model
speculative config; see README. Importing this package does not import vLLM.
"""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> None:
    """vLLM general plugin entry point (every vLLM process): version check."""
    from parse_vllm.plugin import register as _register

    _register()


def get_stats(llm) -> dict:
    """PARSE counters of an offline `vllm.LLM` (from its first worker: with
    tensor parallelism every rank makes the same decisions)."""
    return llm.collective_rpc("parse_stats")[0]


def get_request_stats(llm) -> dict[str, dict]:
    """Per request, by the id it was given (`LLM.generate` numbers them "0", "1", ...): drafts
    judged, rejections, draft tokens offered, tokens taken semantically and token-level, for
    the requests in flight and the last 4,096 finished since `reset_stats`."""
    from parse_vllm import _vllm

    return {_vllm.external_request_id(k): v for k, v in llm.collective_rpc("parse_request_stats")[0].items()}


def get_step_costs(llm) -> dict | None:
    """With `on_reject: adaptive`, the window policy's step costs: {"seconds": {feature:
    s}, "fixed": bool, "steps": steps learnt from}. "seconds", read from an engine warmed on
    the serving machine, can be given back as parse option `adaptive_step_costs` to fix
    them. None without the adaptive policy."""
    return llm.collective_rpc("parse_step_costs")[0]


def reset_stats(llm) -> None:
    llm.collective_rpc("parse_reset_stats")


def get_judgments(llm) -> list[dict]:
    """The last judgments recorded with parse option `record_judgments=N`:
    per copy the prefix token ids, the boundary, P(yes) and both labels' log-probabilities."""
    return llm.collective_rpc("parse_judgments")[0]
