"""Entry point `vllm.platform_plugins`: returns the PARSE variant of the
platform vLLM would pick itself (CPU or CUDA), or None to stay out of the way
(another out-of-tree platform is installed, or PARSE_VLLM_PLATFORM=0).

Kept light: vLLM calls this while resolving its platform, when most of vLLM
cannot be imported yet (`parse_vllm._vllm` imports vLLM only inside its
functions)."""

from __future__ import annotations

import os

_PARSE_PLATFORMS = {
    "vllm.platforms.cpu.CpuPlatform": "parse_vllm.platform.ParseCpuPlatform",
    "vllm.platforms.cuda.CudaPlatform": "parse_vllm.platform.ParseCudaPlatform",
}


def detect() -> str | None:
    if os.environ.get("PARSE_VLLM_PLATFORM", "1") == "0":
        return None
    from importlib.metadata import entry_points

    others = [ep for ep in entry_points(group="vllm.platform_plugins") if ep.name != "parse_vllm"]
    if others:
        # vLLM activates one out-of-tree platform only; leave it to the other.
        return None
    # Checks the vLLM version first: on an unsupported one this raises, vLLM
    # logs it and keeps its own platform, and the general plugin (register)
    # then fails with the same message.
    from parse_vllm import _vllm

    return _PARSE_PLATFORMS.get(_vllm.builtin_platform_qualname())
