"""The PARSE line in vLLM's periodic stats log (entry point
`vllm.stat_logger_plugins`, loaded by the OpenAI server's AsyncLLM)."""

from __future__ import annotations

from parse_vllm import _vllm
from parse_vllm.metrics import read_multiprocess_counters

logger = _vllm.init_logger("parse_vllm")


class ParseStatLogger(_vllm.StatLoggerBase):
    """vLLM stat logger plugin (`vllm.stat_logger_plugins`): adds a PARSE line
    to vLLM's periodic stats log. Does nothing unless PARSE is configured."""

    def __init__(self, vllm_config, engine_index: int = 0):
        from parse_vllm.config import parse_section

        self.enabled = parse_section(getattr(vllm_config, "additional_config", None)) is not None
        self.engine_index = engine_index
        self._last: dict[str, float] = {}

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        if not self.enabled:
            return
        totals = read_multiprocess_counters()
        if not totals or totals == self._last:
            return
        self._last = totals
        drafted = totals.get("draft_tokens", 0.0)
        sem = totals.get("tokens_accepted_semantic", 0.0)
        tok = totals.get("tokens_accepted_token_level", 0.0)
        rate = (sem + tok) / drafted if drafted else 0.0
        logger.info(
            "PARSE metrics: drafts=%d, draft tokens=%d, accepted=%d (%.1f%%; "
            "semantic=%d, token-level=%d), whole drafts=%d, rejections=%d, "
            "verification passes=%d, copies=%d, suffix tokens=%d, rounds=%d",
            totals.get("drafts", 0),
            drafted,
            sem + tok,
            100 * rate,
            sem,
            tok,
            totals.get("drafts_accepted_whole", 0),
            totals.get("rejections", 0),
            totals.get("verification_passes", 0),
            totals.get("copies", 0),
            totals.get("suffix_tokens", 0),
            totals.get("rounds", 0),
        )
