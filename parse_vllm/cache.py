"""Where parse-vllm keeps what it builds: ``$PARSE_VLLM_CACHE``, else ``~/.cache/parse-vllm``.

Prepared models live in ``<cache>/models/<name>`` (:func:`model_dir`); presets name them
through ``$PARSE_VLLM_CACHE``, which ``parse-vllm serve --config`` expands with
:func:`default_cache_dir`. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Return the cache folder: ``$PARSE_VLLM_CACHE`` if set, else ``~/.cache/parse-vllm``.

    Prepared models live in ``<cache>/models/<name>``.
    """
    env = os.environ.get("PARSE_VLLM_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "parse-vllm"


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder a model called ``name`` is (or would be) prepared in."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / "models" / name
