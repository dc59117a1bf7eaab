"""The EAGLE-3 head trainer (`parse-vllm train-eagle3`, speculators) and the head it shipped.

The stages run on a tiny random target with a few fake answers (no engine for the answers:
the answers file is already full): speculators' dataset, the target's hidden states, training
with speculators' model and loss, a run interrupted and resumed, the export; the exported head
then runs in vLLM as an eagle3 proposer."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("speculators", reason="speculators is not installed (scripts/setup_env.sh installs it)")

from parse_vllm.tools import train_eagle3 as te  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AUX = (1, 2, 3)  # the tiny target has 4 layers: speculators' default [2, 2, 1] repeats a layer
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France and a large city.",
    "def add(a, b):\n    return a + b",
    "Water boils at one hundred degrees Celsius at sea level.",
    "1. Read the question.\n2. Think.\n3. Answer briefly.",
    "Photosynthesis turns light, water and carbon dioxide into sugar.",
]


def _config(**kw) -> te.Eagle3TrainConfig:
    base = dict(
        num_prompts=12,
        max_len=256,
        draft_vocab=512,
        total_seq_len=256,
        token_budget=2_000,
        max_minutes=5.0,
        warmup_steps=1,
        val_fraction=0.25,
        checkpoint_minutes=0.0,  # a checkpoint after every step
        target_layer_ids=AUX,
    )
    base.update(kw)
    return te.Eagle3TrainConfig(**base)


def _fake_answers(target: Path, work: Path, n: int) -> None:
    """``n`` rows of answers.jsonl as train_draft writes them: chat prompt ids and answer ids."""
    from transformers import AutoTokenizer

    from parse_vllm.tools.prompts import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(str(target))
    rng = random.Random(0)
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "answers.jsonl", "w") as f:
        for i in range(n):
            prompt = f"Question {i}: {rng.choice(TEXTS)}"
            answer = tok.encode(" ".join(rng.sample(TEXTS, 3)), add_special_tokens=False) + [tok.eos_token_id]
            f.write(
                json.dumps(
                    {
                        "category": "test",
                        "prompt": prompt,
                        "prompt_ids": chat_prompt_ids(tok, prompt),
                        "answer_ids": answer,
                    }
                )
                + "\n"
            )


def test_vocab_mapping_is_consistent(tiny_models):
    import torch

    vocab = 49152
    counts = Counter({100: 50, 7: 40, 3000: 30, 42: 30, 5: 1})
    d2t, t2d = te.vocab_mapping(tiny_models["target"], counts, 64, vocab)
    ids = torch.arange(64) + d2t  # target id of each draft row (speculators' / vLLM's offset form)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool and t2d.shape == (vocab,)
    assert int(t2d.sum()) == 64 and torch.equal(torch.nonzero(t2d).flatten(), ids)
    assert bool((ids[1:] > ids[:-1]).all())  # ascending, distinct
    assert {100, 7, 3000, 42, 5} <= set(ids.tolist())  # every counted token fits in 64 rows
    from transformers import AutoTokenizer

    special = AutoTokenizer.from_pretrained(str(tiny_models["target"])).all_special_ids
    assert set(special) <= set(ids.tolist())  # EOS and the chat-turn tokens are always there


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory):
    """The stages on the tiny target; the train stage stopped after 2 steps, then resumed."""
    import torch

    target = tiny_models["target"]
    work = tmp_path_factory.mktemp("eagle3") / "work"
    cfg = _config()
    _fake_answers(target, work, cfg.num_prompts)
    te.answers(target, work, cfg, exclude=[])  # the file is full: no engine
    te.build_dataset(target, work, cfg, log=lambda *_: None)
    assert te.extract_hidden_states(target, work, cfg, log=lambda *_: None) == cfg.num_prompts

    # interrupted: the third optimiser step raises, after two checkpointed steps
    calls = {"n": 0}
    from speculators.models.eagle3 import Eagle3DraftModel

    forward = Eagle3DraftModel.forward

    def failing(self, *a, **kw):
        if self.training:
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
        return forward(self, *a, **kw)

    Eagle3DraftModel.forward = failing
    try:
        with pytest.raises(KeyboardInterrupt):
            te.train(target, work, cfg, log=lambda *_: None)
    finally:
        Eagle3DraftModel.forward = forward
    saved = torch.load(work / te.CKPT, weights_only=False)
    assert saved["state"]["step"] == 2
    logs: list[str] = []
    meta = te.run_pipeline(target, work, cfg, exclude=[], log=logs.append)
    return {"target": target, "work": work, "cfg": cfg, "meta": meta, "logs": logs}


def test_hidden_states_are_the_targets_own(trained):
    """hs_<i>: the residual stream after each aux layer, then the last layer's before the final
    norm, float16, for exactly the row's tokens (speculators' FileTransfer reads them back)."""
    import torch
    from datasets import load_from_disk
    from hs_connectors import FileTransfer
    from transformers import AutoModelForCausalLM

    data = trained["work"] / te.DATA_DIR
    table = load_from_disk(str(data))
    assert len(table) == trained["cfg"].num_prompts
    sample = FileTransfer(data / "hidden_states").get_cached(0)
    ids = table[0]["input_ids"]
    assert torch.equal(sample["token_ids"], ids)
    assert sample["hidden_states"].dtype == torch.float16 and sample["hidden_states"].shape == (len(ids), 4, 128)
    model = AutoModelForCausalLM.from_pretrained(str(trained["target"]), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.model(input_ids=ids[None], output_hidden_states=True)
        last = out.hidden_states[-1]
        pre_norm = []
        h = model.model.norm.register_forward_pre_hook(lambda _m, a: pre_norm.append(a[0]))
        model.model(input_ids=ids[None])
        h.remove()
    for j, layer in enumerate(AUX):
        want = out.hidden_states[layer][0] if layer < 4 else pre_norm[0][0]
        assert torch.allclose(sample["hidden_states"][:, j].float(), want, atol=2e-2, rtol=1e-2)
    assert torch.allclose(sample["hidden_states"][:, 3].float(), pre_norm[0][0], atol=2e-2, rtol=1e-2)
    assert not torch.allclose(pre_norm[0][0], last[0], atol=1e-3)  # really before the norm
    # each row is prompt + answer with the loss mask on the answer tokens only
    rows = [json.loads(line) for line in (trained["work"] / "answers.jsonl").read_text().splitlines()]
    by_ids = {tuple(r["prompt_ids"] + r["answer_ids"]): len(r["prompt_ids"]) for r in rows}
    for r in table.with_format(None):
        n_prompt = by_ids[tuple(r["input_ids"])]
        assert r["loss_mask"] == [0] * n_prompt + [1] * (len(r["input_ids"]) - n_prompt)


def test_training_resumed_and_exported(trained):
    import torch
    from safetensors import safe_open

    meta, cfg, logs = trained["meta"], trained["cfg"], trained["logs"]
    assert any("resuming at step 2" in line for line in logs)
    assert meta["steps"] == meta["total_steps"] >= 3
    assert [h["step"] for h in meta["history"]] == [0, meta["steps"]]
    assert meta["aux_layers"] == list(AUX) and meta["head"]["rows"] == cfg.draft_vocab
    head = trained["work"] / te.HEAD_DIR
    config = json.loads((head / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == cfg.draft_vocab
    assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.ttt_steps
    with safe_open(str(head / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert not any(k.startswith("embed_tokens") for k in keys)  # vLLM shares the target's
        assert {"fc.weight", "lm_head.weight", "d2t", "norm.weight"} <= keys
        assert f.get_tensor("fc.weight").dtype == torch.float16
        d2t = f.get_tensor("d2t")
        t2d = f.get_tensor("t2d")
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.arange(cfg.draft_vocab) + d2t)
    # the head's output rows are the target's output rows of the draft vocabulary
    from safetensors.torch import load_file

    weights = load_file(str(trained["target"] / "model.safetensors"))
    emb = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    with safe_open(str(head / "model.safetensors"), framework="pt") as f:
        lm = f.get_tensor("lm_head.weight").float()
    assert torch.allclose(lm, emb[torch.arange(cfg.draft_vocab) + d2t], atol=1e-3)
    assert meta["artifact_bytes"] == te.head_size_bytes(head)


def test_a_second_run_redoes_only_what_is_missing(trained):
    target, work, cfg = trained["target"], trained["work"], trained["cfg"]
    (work / te.DATA_DIR / "hidden_states" / te.HIDDEN_FILE.format(3)).unlink()
    assert te.extract_hidden_states(target, work, cfg, log=lambda *_: None) == 1
    assert te.extract_hidden_states(target, work, cfg, log=lambda *_: None) == 0
    with pytest.raises(ValueError, match="other settings"):
        te.train(target, work, _config(lr=5e-4), log=lambda *_: None)


@pytest.mark.slow
def test_the_exported_head_runs_in_vllm(trained):
    """vLLM's eagle3 proposer loads the head (float32, its embedding shared with the target)
    and greedy output is the target's own."""
    res = te.measure_eagle3(
        trained["target"],
        trained["work"] / te.HEAD_DIR,
        k=3,
        max_tokens=16,
        prompts=["Say something.", "Count to five."],
    )
    e = res["eagle3"]
    assert e["drafts"] > 0 and e["draft_tokens"] == 3 * e["drafts"] and 0 <= e["accepted"] <= e["draft_tokens"]
    assert e["output_tokens"] == res["target_alone"]["output_tokens"]
    assert res["same_outputs"] == 2


def test_cli_wires_train_eagle3(capsys):
    from parse_vllm import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["train-eagle3", "--help"])
    assert exc.value.code == 0
    assert "--max-minutes" in capsys.readouterr().out


def test_shipped_head_if_present():
    """The shipped head (parse_vllm/drafts/<target>-eagle3): small, no embedding, provenance."""
    head = ROOT / "parse_vllm" / "drafts" / "smollm2-135m-instruct-eagle3"
    if not head.is_dir():
        pytest.skip("no shipped eagle3 head")
    from safetensors import safe_open

    meta = json.loads((head / "training.json").read_text())
    config = json.loads((head / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and meta["method"] == "eagle3"
    assert meta["data_answer_tokens"] > 100_000 and meta["train_minutes"] > 0
    assert (head / "model.safetensors").stat().st_size < 32 << 20
    with safe_open(str(head / "model.safetensors"), framework="pt") as f:
        assert not any(k.startswith("embed_tokens") for k in f.keys())
