"""The version of the compiled kernels: a hash of their sources.

setup.py builds `kernel_sources_hash()` of the csrc/ tree into the op
(-DPARSE_VLLM_KERNEL_HASH), which reports it in
`torch.ops.parse_vllm.cuda_kernel_version(dtype)` ("tc-<hash>" for the
tensor-core kernel, "cc-<hash>" for the CUDA-core one). The verifier factory
trusts a recorded measurement only of the version the installed op reports, so
any change to a source under csrc/ makes the old measurements inapplicable.
gpu_check.sh writes the record under the version the op it built reports.

No imports beyond the standard library: setup.py loads this file by path
before the package (and its compiled op) exists.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# What is compiled: every C++ / CUDA source and header under csrc/ (not its READMEs).
SOURCE_SUFFIXES = (".h", ".cuh", ".cu", ".cpp")


def kernel_sources(root: str | Path) -> list[Path]:
    """The files the hash covers, sorted by their path relative to `root`/csrc."""
    csrc = Path(root) / "csrc"
    files = [p for p in csrc.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    return sorted(files, key=lambda p: p.relative_to(csrc).as_posix())


def kernel_sources_hash(root: str | Path) -> str:
    """First 16 hex digits of the sha256 over (relative path, length, bytes) of each
    source: renaming, moving or editing any of them changes it."""
    csrc = Path(root) / "csrc"
    files = kernel_sources(root)
    if not files:
        raise FileNotFoundError(f"no kernel sources under {csrc}")
    h = hashlib.sha256()
    for p in files:
        data = p.read_bytes()
        rel = p.relative_to(csrc).as_posix().encode()
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]
