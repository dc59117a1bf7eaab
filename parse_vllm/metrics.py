"""PARSE counters.

The worker counts; the numbers reach users three ways:
  * `parse_vllm.get_stats(llm)` (offline), through the worker's `parse_stats`
    RPC (`LLM.collective_rpc`);
  * Prometheus `/metrics` of the OpenAI server: the worker writes the counters
    in prometheus_client's multiprocess mode, which `parse-vllm serve` turns on
    (PROMETHEUS_MULTIPROC_DIR) before vLLM starts, so vLLM's own `/metrics`
    collects them beside its `vllm:*` series;
  * the periodic log line ("PARSE metrics: ..."), written by the stat logger
    `ParseStatLogger` (entry point `vllm.stat_logger_plugins`) every time vLLM
    logs its own stats.
vLLM's `vllm:spec_decode_*` series need nothing from here: they count the
sampled lengths PARSE returns (drafted = window, accepted = accepted prefix).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields

PROM_PREFIX = "parse:"


@dataclass
class KvAudit:
    """High-water marks of the worker's KV-block use, taken after every step
    when the parse option `audit_kv_blocks` is on (load tests)."""

    steps: int = 0
    batch_requests_max: int = 0
    request_blocks_held_max: int = 0
    # Must stay 0: a scratch block in a request's own table would let the
    # next verification pass overwrite that request's KV.
    scratch_blocks_in_request_tables_max: int = 0

    def record(self, batch_requests: int, blocks_held: int, scratch_in_tables: int) -> None:
        self.steps += 1
        self.batch_requests_max = max(self.batch_requests_max, batch_requests)
        self.request_blocks_held_max = max(self.request_blocks_held_max, blocks_held)
        self.scratch_blocks_in_request_tables_max = max(self.scratch_blocks_in_request_tables_max, scratch_in_tables)


def _counter(text: str):
    return field(default=0, metadata={"help": text})


@dataclass
class RequestCounts:
    """One request's PARSE counters (parse_vllm.get_request_stats): where its tokens came from."""

    drafts_judged: int = 0  # drafts judged semantically
    rejections: int = 0  # of them, rejected
    draft_tokens: int = 0  # draft tokens offered to the judge
    semantic: int = 0  # tokens accepted semantically (past token-level acceptance)
    token_level: int = 0  # draft tokens accepted token by token, in judged drafts and plain ones
    # on_reject adaptive: the window policy's decisions by their reason (window_policy.WHY), one
    # a step the request had no window in flight
    policy: dict[str, int] = field(default_factory=dict)


@dataclass
class ParseStats:
    """PARSE's counters, each monotonically increasing; the help texts are
    the Prometheus series' (parse:<name>_total)."""

    drafts: int = _counter("Drafts judged semantically (one per request and verification step).")
    draft_tokens: int = _counter("Draft tokens offered to the semantic judge.")
    verification_passes: int = _counter("Target forward passes over verification suffixes.")
    copies: int = _counter("Verification-suffix copies (judged prefixes) computed.")
    suffix_tokens: int = _counter("Verification-suffix tokens computed (scratch KV).")
    tokens_accepted_semantic: int = _counter(
        "Draft tokens accepted because the judge passed them (beyond token-level)."
    )
    tokens_accepted_token_level: int = _counter("Draft tokens accepted by token-level verification.")
    drafts_accepted_whole: int = _counter("Judged drafts accepted to their end.")
    rejections: int = _counter("Judged drafts with a failed boundary.")
    draft_tokens_discarded: int = _counter("Draft tokens of rejected drafts not taken (past the accepted prefix).")
    chunk_commits: int = _counter(
        "Parts of windows judged while the window was drafted and taken, the window going on (judge_chunks)."
    )
    guard_cuts: int = _counter("Judged drafts the token guard cut short of what the judge passed.")
    rounds: int = _counter("Redraft rounds started after a rejection.")
    drafter_passes: int = _counter("Drafter calls (each a first pass over some requests' new tokens, then drafting).")
    drafter_rows: int = _counter("Requests in drafter calls (a request drafting in a step counts once per call).")
    drafter_tokens: int = _counter("Tokens the drafter's first passes wrote draft KV for (catch-up included).")
    window_chunks: int = _counter("Chunks of windows drafted over several engine steps (one per window and step).")
    windows_dropped: int = _counter("Windows dropped unfinished: their request was preempted (it drafts again).")
    policy_token_level_steps: int = _counter(
        "Steps a request spent on the token-level arm because the adaptive window policy chose it."
    )
    policy_probes: int = _counter("Short windows the adaptive policy opened after a back-off (re-probes).")
    # Labelled families (LABELLED: the Prometheus label of each key).
    # index (0-based) of the first failed boundary -> count
    rejections_by_boundary: dict[int, int] = field(default_factory=dict)
    # Token-level drafts (not judged) by proposer ("draft_model", "eagle3",
    # "ngram"): drafts verified, their tokens, and the tokens accepted.
    token_level_drafts: dict[str, int] = field(default_factory=dict)
    token_level_draft_tokens: dict[str, int] = field(default_factory=dict)
    token_level_accepted_tokens: dict[str, int] = field(default_factory=dict)
    # Windows opened, by length (tokens), under on_reject adaptive.
    windows_opened: dict[int, int] = field(default_factory=dict)
    # Steps the adaptive policy ran its token-level arm at each k (0: the target alone).
    token_level_k_steps: dict[int, int] = field(default_factory=dict)
    # A high-water mark, not a counter (not exported): the most draft tokens a
    # window drafted in chunks took in one engine step (<= draft_chunk).
    window_chunk_max: int = 0

    def note_window_chunk(self, num_tokens: int) -> None:
        self.window_chunks += 1
        self.window_chunk_max = max(self.window_chunk_max, num_tokens)

    def window_opened(self, length: int) -> None:
        _add(self.windows_opened, length, 1)

    def token_level_k_chosen(self, k: int) -> None:
        _add(self.token_level_k_steps, k, 1)

    def reject_at(self, boundary_index: int) -> None:
        self.rejections += 1
        _add(self.rejections_by_boundary, boundary_index, 1)

    def token_level(self, proposer: str, drafts: int, draft_tokens: int, accepted: int) -> None:
        _add(self.token_level_drafts, proposer, drafts)
        _add(self.token_level_draft_tokens, proposer, draft_tokens)
        _add(self.token_level_accepted_tokens, proposer, accepted)

    def minus(self, other: ParseStats) -> ParseStats:
        """What the counters gained since `other` (labelled families key by key)."""
        out = ParseStats(**{k: getattr(self, k) - getattr(other, k) for k in COUNTERS})
        for name in LABELLED:
            now, last = getattr(self, name), getattr(other, name)
            setattr(out, name, {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)})
        return out

    def copy(self) -> ParseStats:
        return ParseStats(**{**self.as_dict(), **{n: dict(getattr(self, n)) for n in LABELLED}})

    def as_dict(self) -> dict:
        return asdict(self)


def _add(counts: dict, key, n: int) -> None:
    if n:
        counts[key] = counts.get(key, 0) + n


# name -> help of every plain counter
COUNTERS = {f.name: f.metadata["help"] for f in fields(ParseStats) if "help" in f.metadata}
# labelled families: name -> (label, help)
LABELLED = {
    "rejections_by_boundary": ("boundary", "Judged drafts by the index of their first failed boundary."),
    "token_level_drafts": ("proposer", "Token-level drafts (not judged) verified, by proposer."),
    "token_level_draft_tokens": ("proposer", "Tokens of token-level drafts (not judged), by proposer."),
    "token_level_accepted_tokens": ("proposer", "Tokens of token-level drafts accepted, by proposer."),
    "windows_opened": ("length", "Windows the adaptive policy opened, by length."),
    "token_level_k_steps": ("k", "Steps the adaptive policy ran its token-level arm at k draft tokens (0: none)."),
}


class PromExporter:
    """Mirrors ParseStats into prometheus_client counters when the process
    runs in multiprocess mode (so the API server's /metrics can collect them);
    a no-op otherwise."""

    def __init__(self, labels: dict[str, str]):
        self.enabled = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._counters = {}
        self._families = {}
        self._labels = labels
        if not self.enabled:
            return
        from prometheus_client import Counter

        names = list(labels)
        for name, doc in COUNTERS.items():
            self._counters[name] = Counter(PROM_PREFIX + name, doc, names).labels(**labels)
        for name, (label, doc) in LABELLED.items():
            self._families[name] = (label, Counter(PROM_PREFIX + name, doc, names + [label]))

    def add(self, delta: ParseStats) -> None:
        if not self.enabled:
            return
        for name, counter in self._counters.items():
            v = getattr(delta, name)
            if v:
                counter.inc(v)
        for name, (label, family) in self._families.items():
            for key, n in getattr(delta, name).items():
                family.labels(**self._labels, **{label: str(key)}).inc(n)


def read_multiprocess_counters() -> dict[str, float]:
    """Sum of the PARSE counters over all processes, from the multiprocess
    directory (used by the stat logger in the API server process)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return {}
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    totals: dict[str, float] = {}
    for metric in registry.collect():
        if not metric.name.startswith(PROM_PREFIX):
            continue
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                key = sample.name[len(PROM_PREFIX) : -len("_total")]
                if key == "rejections_by_boundary":
                    key = f"rejections_at_{sample.labels.get('boundary')}"
                elif key in LABELLED:
                    key = f"{key}_{sample.labels.get(LABELLED[key][0])}"
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals
