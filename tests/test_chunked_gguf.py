"""GGUF files in chunk packages (parse_vllm/tools/chunked_gguf.py) on small fake
packages written on the fly; and prepare-models building a model from such
chunks (SmolLM2's GGUF cut into three fake packages)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import sys
from pathlib import Path

import pytest

from parse_vllm.tools.chunked_gguf import (
    QWEN25_CODER_0_5B,
    QWEN25_CODER_1_5B,
    Chunk,
    ChunkedGGUF,
    ChunkError,
    ChunkMissingError,
    assemble,
)


def _fake_packages(root: Path, pieces: list[bytes], prefix: str) -> ChunkedGGUF:
    """One installed package per piece (`<prefix>-partN` 0.1.0, module
    `<prefix>_partN`, file data/partNN.bin, with its dist-info), and their manifest."""
    chunks = []
    for i, data in enumerate(pieces, 1):
        module = f"{prefix}_part{i}"
        (root / module / "data").mkdir(parents=True)
        (root / module / "__init__.py").write_text("")
        (root / module / "data" / f"part{i:02d}.bin").write_bytes(data)
        dist = root / f"{module}-0.1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {prefix}-part{i}\nVersion: 0.1.0\n")
        chunks.append(
            Chunk(
                f"{prefix}-part{i}",
                "0.1.0",
                module,
                f"data/part{i:02d}.bin",
                len(data),
                hashlib.sha256(data).hexdigest(),
            )
        )
    whole = b"".join(pieces)
    return ChunkedGGUF(f"{prefix}.gguf", len(whole), hashlib.sha256(whole).hexdigest(), tuple(chunks))


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    return root


PIECES = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]


def test_assemble_concatenates_checked_chunks_in_order(on_path, tmp_path):
    gguf = _fake_packages(on_path, PIECES, "fakea")
    seen = []
    out = assemble(gguf, tmp_path / "a.gguf", progress=seen.append, block=64)
    assert out.read_bytes() == b"".join(PIECES)
    assert seen and "checked" in seen[-1]


def test_a_missing_chunk_names_its_package_and_writes_nothing(on_path, tmp_path):
    gguf = _fake_packages(on_path, PIECES, "fakeb")
    gone = Chunk("fakeb-part9", "0.1.0", "fakeb_part9", "data/part09.bin", 1, "0" * 64)
    bad = ChunkedGGUF(gguf.file_name, gguf.size, gguf.sha256, (*gguf.chunks[:2], gone))
    with pytest.raises(
        ChunkMissingError, match=r"'fakeb-part9' is not installed; install it with: pip install 'fakeb-part9==0.1.0'"
    ):
        assemble(bad, tmp_path / "b.gguf")
    assert not (tmp_path / "b.gguf").exists()
    (on_path / "fakeb_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(ChunkMissingError, match=r"'fakeb-part2' has no data/part02.bin"):
        assemble(gguf, tmp_path / "b.gguf")


def test_a_corrupt_chunk_names_its_package_and_leaves_no_file(on_path, tmp_path):
    gguf = _fake_packages(on_path, PIECES, "fakec")
    path = on_path / "fakec_part2" / "data" / "part02.bin"
    data = bytearray(path.read_bytes())
    data[17] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(
        ChunkError, match=r"'fakec-part2' is corrupt .* pip install --force-reinstall 'fakec-part2==0.1.0'"
    ):
        assemble(gguf, tmp_path / "c.gguf")
    assert not (tmp_path / "c.gguf").exists()


def test_the_whole_file_is_checked_too(on_path, tmp_path):
    gguf = _fake_packages(on_path, PIECES, "faked")
    wrong = ChunkedGGUF(gguf.file_name, gguf.size, "f" * 64, gguf.chunks)
    with pytest.raises(ChunkError, match="expected"):
        assemble(wrong, tmp_path / "d.gguf")
    assert not (tmp_path / "d.gguf").exists()


@pytest.mark.parametrize("gguf", [QWEN25_CODER_1_5B, QWEN25_CODER_0_5B], ids=lambda g: g.file_name)
def test_the_pair_manifests_add_up(gguf):
    assert sum(c.size for c in gguf.chunks) == gguf.size
    for i, c in enumerate(gguf.chunks, 1):
        assert c.package.endswith(f"part{i}") and c.module == c.package.replace("-", "_")
        assert c.path == f"data/part{i:02d}.bin" and len(c.sha256) == 64


def test_prepare_models_builds_a_model_from_chunk_packages(on_path, tmp_path, monkeypatch, smollm2_dir):
    """SmolLM2's GGUF cut into three fake chunk packages goes through the same
    path as the Qwen2.5-Coder pair: assembled, checked, dequantized, stored
    with a marker naming the first chunk package; a re-run is a no-op."""
    from parse_vllm.tools import prepare_models as pm

    real = pm._SPECS["smollm2-135m-instruct"]
    gguf_bytes = real.locate(real, tmp_path, False).read_bytes()
    third = len(gguf_bytes) // 3
    pieces = [gguf_bytes[:third], gguf_bytes[third : 2 * third], gguf_bytes[2 * third :]]
    chunks = _fake_packages(on_path, pieces, "fakesmol")
    spec = dataclasses.replace(
        real, name="fake-smol", package="fakesmol-part1", locate=pm._locate_chunked, chunks=chunks
    )
    monkeypatch.setitem(pm._SPECS, "fake-smol", spec)
    cache = tmp_path / "cache"
    folder = pm.prepare_models(cache, names=("fake-smol",), progress=False)["fake-smol"]
    marker = json.loads((folder / pm.MARKER_FILE).read_text())
    assert marker["source_package"] == "fakesmol-part1" and marker["source_version"] == "0.1.0"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert pm.prepare_models(cache, names=("fake-smol",), progress=False)["fake-smol"] == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
    # a corrupt chunk: a clear error, and the finished folder is left as it was
    (on_path / "fakesmol_part3" / "data" / "part03.bin").write_bytes(pieces[2][:-1] + b"x")
    monkeypatch.setattr(pm, "_read_marker", lambda f: None)  # force a rebuild
    with pytest.raises(pm.ModelPreparationError, match="'fakesmol-part3' is corrupt"):
        pm.prepare_models(cache, names=("fake-smol",), progress=False)
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
    assert sys.modules.get("fakesmol_part1") is None  # chunk packages are found, never imported


def test_the_models_extra_installs_the_pairs_chunk_packages():
    """pyproject's `models` extra and the manifests name the same packages and versions
    (`make pair` installs the manifests' list, pip the extra's)."""
    import tomllib

    from parse_vllm.tools import prepare_models as pm

    root = Path(__file__).resolve().parents[1]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["models"]
    wanted = QWEN25_CODER_1_5B.requirements + QWEN25_CODER_0_5B.requirements
    assert [r for r in extra if "part" in r] == wanted
    assert pm.main(["--pair", "--requirements"]) == 0
