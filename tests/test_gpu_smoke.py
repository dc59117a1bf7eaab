"""scripts/gpu_smoke.py, the first command on a GPU machine, on the CPU: its answer where it
cannot run, the order in which it sets up vLLM's environment, the kernel checks skipped
when the CUDA op is absent, its checks and its report driven through fake engines, and
the EAGLE-3 head it makes for the tiny target."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_smoke.py"


@pytest.fixture(scope="module")
def smoke():
    # loading the script sets VLLM_USE_V2_MODEL_RUNNER in this process: put it back after
    before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    if before is None:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    else:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = before


def _run_script(*args: str, env: dict | None = None, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, **(env or {})}
    if pythonpath:
        e["PYTHONPATH"] = pythonpath + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=e, capture_output=True, text=True, timeout=300)


def test_without_a_gpu_it_says_so_in_one_json_line():
    r = _run_script(env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2, r.stderr
    (line,) = r.stdout.strip().splitlines()
    out = json.loads(line)
    assert out["ok"] is False and "no CUDA device" in out["skipped"]


def test_bad_arguments_exit_2():
    for bad in (["--draft-chunk", "16"], ["--draft-chunk", "0"], ["--window", "1"], ["--eagle3", "medusa"]):
        r = _run_script(*bad)
        assert r.returncode == 2 and "error" in r.stderr, bad


def test_vllm_is_first_imported_with_model_runner_v1_and_its_log_on_stderr(tmp_path):
    """A stand-in `vllm` package records the environment at its import and refuses to load:
    the script must have set the runner before (even against the caller's setting) and
    answer with one JSON line, exit status 2."""
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    record = tmp_path / "seen.json"
    (fake / "__init__.py").write_text(
        "import json, os\n"
        f"json.dump({{k: os.environ.get(k) for k in ('VLLM_USE_V2_MODEL_RUNNER', 'VLLM_LOGGING_STREAM')}}, "
        f"open({str(record)!r}, 'w'))\n"
        "raise ImportError('stand-in vllm')\n"
    )
    r = _run_script("--device", "cpu", env={"VLLM_USE_V2_MODEL_RUNNER": "1"}, pythonpath=str(fake.parent))
    assert r.returncode == 2, r.stdout + r.stderr
    assert json.loads(r.stdout.strip())["skipped"] == "vLLM is not installed: stand-in vllm"
    assert json.loads(record.read_text()) == {
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    }


def test_why_the_kernel_verifier_cannot_run(smoke, monkeypatch):
    import parse_vllm.ops as ops

    monkeypatch.setattr(ops, "has_cuda_op", lambda: False)
    monkeypatch.setattr(ops, "compiled_op_error", lambda: None)
    assert "no CUDA kernel of the op" in smoke.kernel_unavailable("cuda")
    monkeypatch.setattr(ops, "compiled_op_error", lambda: "ImportError: undefined symbol")
    assert "undefined symbol" in smoke.kernel_unavailable("cuda")
    monkeypatch.setattr(ops, "has_cuda_op", lambda: True)
    assert smoke.kernel_unavailable("cuda") is None
    assert "CUDA only" in smoke.kernel_unavailable("cpu")


# --------------------------------------------------------------------------- fake engines

WANT = [[11, 12, 13, 14], [21, 22, 23, 24]]
PROMPTS = ["a", "b"]


class FakeLLM:
    """Answers like a PARSE engine: the target's tokens at lossless settings (unless told
    otherwise), its counters and judgments through collective_rpc as parse_vllm reads them."""

    def __init__(self, parse, *, p_yes=0.7, lossy_at=None, eagle3=(30, 90)):
        self.parse, self.p_yes, self.lossy_at, self.eagle3 = parse or {}, p_yes, lossy_at, eagle3
        self.stats = {}

    def generate(self, prompts, params):
        x = params["extra"]
        tau, guard = x.get("parse_threshold", 0.5), x.get("parse_guard", 0)
        lossless = tau > 1 or guard == 1 or not self.parse
        ids = [list(w) for w in WANT] if lossless else [w[:2] + [0, 0] for w in WANT]
        if self.lossy_at is not None and (tau, guard) == self.lossy_at:
            ids[1][-1] = 99
        drafts = 0 if tau > 1 else 2
        acc, drafted = self.eagle3 if "token_proposer" in self.parse else (0, 0)
        self.stats = {
            "drafts": drafts,
            "window_chunks": 8 * drafts,
            "window_chunk_max": 2 if drafts else 0,
            "copies": 3 if 0 < tau <= 1 else 0,
            "tokens_accepted_semantic": 5 if tau == 0 else 0,
            "token_level_draft_tokens": {"eagle3": drafted} if drafted else {},
            "token_level_accepted_tokens": {"eagle3": acc} if acc else {},
        }
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=i)], prompt_token_ids=[1]) for i in ids]

    def collective_rpc(self, name):
        return [
            {
                "parse_stats": lambda: self.stats,
                "parse_reset_stats": lambda: None,
                "parse_judgments": lambda: [{"token_ids": [1, 2, 3], "p_yes": self.p_yes}],
                "parse_kv_blocks": lambda: {"request_blocks_held": 0, "runner_requests": 0},
            }[name]()
        ]


class FakeEngines:
    def __init__(self, refuse=(), **llm_kw):
        self.made, self.closed, self.refuse, self.llm_kw = [], 0, refuse, llm_kw

    def make(self, target, *, draft=None, parse=None, enforce_eager=False):
        self.made.append({"target": str(target), "parse": parse, "enforce_eager": enforce_eager})
        if parse and parse.get("verifier") in self.refuse:
            raise ValueError(f"parse.verifier={parse['verifier']!r} cannot run here")
        kw = self.llm_kw.get((parse or {}).get("verifier", "eagle3" if parse else "target"), {})
        return FakeLLM(parse, **kw)

    def params(self, max_tokens, **extra):
        return {"max_tokens": max_tokens, "extra": extra}

    def finish_steps(self, llm):
        pass

    def close(self, llm):
        self.closed += 1


def _args(smoke, *argv):
    return smoke.parse_args(list(argv))


MODELS = {"target": Path("/t"), "draft": Path("/d")}


def test_without_the_cuda_op_the_kernel_checks_are_skipped_and_the_forked_ones_run(smoke, monkeypatch):
    import parse_vllm.ops as ops

    monkeypatch.setattr(ops, "has_cuda_op", lambda: False)
    monkeypatch.setattr(ops, "compiled_op_error", lambda: None)
    fake = FakeEngines()
    checks, stats = smoke.run_verifiers(_args(smoke), fake, MODELS, PROMPTS, WANT)
    assert [m["parse"]["verifier"] for m in fake.made] == ["forked"] and fake.closed == 1
    for name in smoke.KERNEL_CHECKS:
        assert checks[name]["ok"] is None and "no CUDA kernel of the op" in checks[name]["skipped"]
    ran = {k: c for k, c in checks.items() if c["ok"] is not None}
    assert set(ran) == {f"{n}_forked" for n in ("lossless_guard1", "windows_over_steps", "lossless_tau_above_1")} | {
        "accept_forked",
        "judged_forked",
        "kv_forked",
    }
    assert all(c["ok"] for c in ran.values()), ran
    assert checks["windows_over_steps_forked"] == {
        "ok": True,
        "drafts": 2,
        "window_chunks": 16,
        "window_chunk_max": 2,
        "draft_chunk": 2,
    }
    assert set(stats) == {"forked"} and smoke.overall(checks)


def test_with_the_cuda_op_both_verifiers_run_and_their_judgments_are_compared(smoke, monkeypatch):
    import parse_vllm.ops as ops

    monkeypatch.setattr(ops, "has_cuda_op", lambda: True)
    checks, _ = smoke.run_verifiers(_args(smoke), FakeEngines(), MODELS, PROMPTS, WANT)
    assert checks["kernel_equals_forked"] == {"ok": True, "compared": 1, "max_abs_p_yes_diff": 0.0}
    assert all(c["ok"] for c in checks.values())
    # the kernel's P(yes) off by 0.01, and its guard-1 output off by one token: both fail
    fake = FakeEngines(kernel={"p_yes": 0.71, "lossy_at": (0.5, 1)})
    checks, _ = smoke.run_verifiers(_args(smoke), fake, MODELS, PROMPTS, WANT)
    assert not checks["kernel_equals_forked"]["ok"]
    assert checks["kernel_equals_forked"]["max_abs_p_yes_diff"] == pytest.approx(0.01)
    assert checks["lossless_guard1_kernel"] == {"ok": False, "first_mismatch_prompt": 1}
    assert checks["lossless_guard1_forked"]["ok"] and not smoke.overall(checks)
    # a kernel engine refused at start is one failed check; the forked engine still runs
    checks, _ = smoke.run_verifiers(_args(smoke), FakeEngines(refuse=("kernel",)), MODELS, PROMPTS, WANT)
    assert "cannot run here" in checks["engine_kernel"]["error"] and checks["lossless_guard1_forked"]["ok"]
    assert checks["kernel_equals_forked"]["ok"] is False


def test_eagle3_graphs_against_eager(smoke):
    agree = smoke.graphs_agree_with_eager
    e = smoke.eagle3_acceptance(
        {"token_level_draft_tokens": {"eagle3": 90}, "token_level_accepted_tokens": {"eagle3": 30}}
    )
    assert e == {"drafted": 90, "accepted": 30, "rate": pytest.approx(1 / 3)}
    assert agree(e, {**e, "accepted": 31, "rate": 31 / 90})["ok"]
    stale = agree(e, {"drafted": 90, "accepted": 2, "rate": 2 / 90})  # a head reading stale hidden states
    assert not stale["ok"] and stale["rate_diff"] == pytest.approx(28 / 90)
    weak = agree({"drafted": 90, "accepted": 3, "rate": 3 / 90}, {"drafted": 90, "accepted": 3, "rate": 3 / 90})
    assert not weak["ok"] and weak["why"].startswith("inconclusive")


def test_eagle3_runs_eager_and_with_graphs_on_a_gpu(smoke):
    setup = {"target": MODELS["target"], "draft": MODELS["draft"], "head": Path("/head")}
    fake = FakeEngines()
    checks = smoke.run_eagle3(_args(smoke), fake, setup, PROMPTS, WANT)
    assert [m["enforce_eager"] for m in fake.made] == [True, False]
    assert fake.made[0]["parse"]["token_proposer"] == {"method": "eagle3", "model": "/head"}
    assert checks["eagle3_lossless_eager"]["ok"] and checks["eagle3_lossless_graphs"]["ok"]
    assert checks["eagle3_graphs_agree_with_eager"]["ok"]
    checks = smoke.run_eagle3(_args(smoke, "--device", "cpu"), FakeEngines(), setup, PROMPTS, WANT)
    assert checks["eagle3_graphs_agree_with_eager"] == {"ok": None, "skipped": "no CUDA graphs on the CPU"}


def test_report_and_exit_status(smoke, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="stand-in"))
    for k, v in (("VLLM_LOGGING_LEVEL", "WARNING"), ("VLLM_LOGGING_STREAM", "ext://sys.stderr")):
        monkeypatch.setenv(k, v)  # what main() sets when unset, undone after this test
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(smoke, "tiny_models", lambda workdir, dtype: MODELS)
    monkeypatch.setattr(
        smoke, "eagle3_setup", lambda args, models, pids, want, workdir: {**models, "pair": "tiny", "head": "/h"}
    )

    def main(fake, *argv):
        code = smoke.main(["--device", "cpu", *argv], engines=fake)
        (line,) = capsys.readouterr().out.strip().splitlines()
        return code, json.loads(line)

    code, out = main(FakeEngines())
    assert code == 0 and out["ok"] is True and out["vllm"] == "stand-in" and out["draft_chunk"] == 2
    assert set(out["skipped"]) == set(smoke.KERNEL_CHECKS) | {"eagle3_graphs_agree_with_eager"}
    assert out["checks"]["eagle3_lossless_eager"]["eagle3"]["accepted"] == 30
    assert out["eagle3"]["pair"] == "tiny" and set(out["stats_tau_0_5"]) == {"forked"}
    code, out = main(FakeEngines(forked={"lossy_at": (1.5, 0)}))
    assert code == 1 and out["checks"]["lossless_tau_above_1_forked"]["ok"] is False
    code, out = main(FakeEngines(), "--eagle3", "off")
    assert code == 0 and not any(k.startswith("eagle3") for k in out["checks"])

    def broken(args, engines, workdir):
        raise RuntimeError("the engine died")

    monkeypatch.setattr(smoke, "run", broken)
    code, out = main(FakeEngines())
    assert code == 1 and out["ok"] is False and out["error"] == "RuntimeError: the engine died"


def test_the_eagle3_head_made_for_the_tiny_target_proposes_its_tokens(smoke, tmp_path):
    """The head's proposal at position t, computed from its files as vLLM's EAGLE-3 head
    computes it (attention and MLP adding nothing), is the target's token at t + 2."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.families import make_tiny_family_model

    target = make_tiny_family_model("qwen3", tmp_path / "t", num_layers=4, hidden_size=64, intermediate_size=128)
    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    sequences = []
    with torch.no_grad():
        for prompt in ([5, 6, 7], [100, 200, 300, 400]):
            out = model.generate(torch.tensor([prompt]), min_new_tokens=12, max_new_tokens=12, do_sample=False)
            out = out[0].tolist()
            sequences.append((prompt, out[len(prompt) :]))
    fitted = smoke.fit_eagle3_head(target, sequences, tmp_path / "head")
    assert fitted["fit_accuracy"] == 1.0 and fitted["positions"] == 2 * 11

    head = Path(fitted["head"])
    config = json.loads((head / "config.json").read_text())
    shipped = json.loads((smoke.SHIPPED_HEAD / "config.json").read_text())
    assert set(config) == set(shipped) and set(config["transformer_layer_config"]) >= {
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    }
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    w = load_file(str(head / "model.safetensors"))
    assert w["t2d"].sum().item() == config["draft_vocab_size"] == w["lm_head.weight"].shape[0]
    with torch.no_grad():
        for prompt, output in sequences:
            ids = prompt + output
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i][0] for i in (1, 2, 3)], dim=-1)
            eps = config["transformer_layer_config"]["rms_norm_eps"]
            h = F.rms_norm(aux @ w["fc.weight"].t(), (64,), w["norm.weight"], eps)
            draft_ids = (h @ w["lm_head.weight"].t()).argmax(-1)
            proposed = draft_ids + w["d2t"][draft_ids]  # vLLM: target id = draft id + d2t[draft id]
            t = range(len(prompt) - 1, len(ids) - 2)
            assert proposed[list(t)].tolist() == [ids[i + 2] for i in t]
