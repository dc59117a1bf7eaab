"""vLLM's environment variables (vllm.envs), set from inside a process that already runs an
engine."""

from __future__ import annotations

import os


def set_vllm_env(name: str, value: str) -> None:
    """Set `name` for vLLM in this process. An engine core started in this process caches
    every vllm.envs value (vllm.envs.enable_envs_cache, called by
    vllm.v1.engine.core.EngineCore.__init__; 0.33: the same), so a variable set after it
    would be invisible to the next engine built here: the cache is cleared too, and fills
    again on the next read."""
    os.environ[name] = value
    import vllm.envs as envs

    if envs._is_envs_cache_enabled():
        envs.__getattr__.cache_clear()
