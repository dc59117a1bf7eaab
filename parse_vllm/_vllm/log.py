"""PARSE's loggers, under vLLM's."""

from __future__ import annotations


def init_logger(name: str):
    """A logger under vLLM's "vllm" logger, so PARSE's lines get vLLM's
    handlers, format and VLLM_LOGGING_LEVEL (vllm.logger configures only
    the "vllm" namespace)."""
    from vllm.logger import init_logger as _init_logger

    return _init_logger(f"vllm.plugins.{name}")
