"""Head-pruned drafts (draft_vocab.py): the head's token choice, the scatter back
to the full vocabulary, the training loss with a pruned head, and the vLLM model
class (`ParseDraftLlamaForCausalLM`, registered by the plugin) run by vLLM alone
and as a `draft_model` speculator, against an HF reference."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from parse_vllm.draft_vocab import (
    ARCHITECTURE,
    HEAD_IDS_KEY,
    HEAD_VOCAB_KEY,
    choose_head_tokens,
    full_vocab_logits,
    head_coverage,
    to_head_index,
)


def test_head_takes_the_most_frequent_tokens_and_every_special_one():
    counts = Counter({7: 50, 3: 50, 9: 40, 1: 5, 4: 1})
    ids = choose_head_tokens(counts, 4, vocab_size=20, always=[19])
    # 19 always; then by count, ties by lower id: 3, 7, then 9
    assert ids.tolist() == [3, 7, 9, 19]
    assert choose_head_tokens(counts, 4, 20, always=[19]).equal(ids)  # deterministic
    # more rows than seen tokens: the lowest unseen ids fill the rest, size exact
    assert choose_head_tokens(counts, 8, 20).tolist() == [0, 1, 2, 3, 4, 5, 7, 9]
    assert head_coverage(counts, ids) == pytest.approx(140 / 146)
    assert to_head_index(ids, 20).tolist() == [-1, -1, -1, 0, -1, -1, -1, 1, -1, 2] + [-1] * 9 + [3]
    for bad in (dict(size=1, always=[0, 1]), dict(size=21, always=()), dict(size=4, always=[20])):
        with pytest.raises(ValueError):
            choose_head_tokens(counts, bad["size"], 20, always=bad["always"])


def test_full_vocab_logits_put_each_row_at_its_token():
    head = torch.tensor([[1.0, 5.0, 2.0], [3.0, -1.0, 0.5]])  # [T=2, rows=3]
    ids = torch.tensor([2, 6, 9])
    full = full_vocab_logits(head, ids, vocab_size=10)
    assert full.shape == (2, 10)
    assert full[:, ids].equal(head)
    others = [i for i in range(10) if i not in (2, 6, 9)]
    assert bool(torch.isinf(full[:, others]).all()) and bool((full[:, others] < 0).all())
    assert full.argmax(-1).tolist() == [6, 2]
    assert torch.allclose(full.softmax(-1)[:, ids], head.softmax(-1))


def test_pruned_head_loss_ignores_tokens_it_cannot_say():
    """Hard loss over the head's rows only (labels outside it dropped); soft loss with
    the mass on missing tokens dropped; hits count a missing label as a miss."""
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from parse_vllm.tools.train_draft import DraftHead, _collate, _loss_and_hits

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )
    ids = torch.tensor([2, 4, 5, 7, 8, 10, 11])  # 9 and 12 are not in the head
    head = DraftHead.of(ids, 50)
    rows = [
        ([1, 2, 3], [4, 5], [[4, 9, 7], [5, 8, 12]], [[-0.1, -2.5, -3.0], [-0.2, -1.9, -2.0]]),
        ([1, 6], [7, 8, 9], None, None),
    ]
    inputs, labels, soft = _collate(rows, [0, 1], pad_id=0, topk=3)
    w = 0.4
    loss, hits, n = _loss_and_hits(model, inputs, labels, soft, w, head)

    mask = labels != -100
    hidden = model.model(input_ids=inputs, attention_mask=(inputs >= 0).long()).last_hidden_state[mask]
    logp = F.linear(hidden, model.model.embed_tokens.weight[ids]).log_softmax(-1)  # [5, 7]
    y = labels[mask].tolist()  # [4, 5, 7, 8, 9]
    row = {int(t): r for r, t in enumerate(ids)}
    hard = -torch.stack([logp[i, row[t]] for i, t in enumerate(y) if t in row]).mean()
    p0 = torch.tensor([-0.1, -2.5, -3.0]).softmax(-1)
    p1 = torch.tensor([-0.2, -1.9, -2.0]).softmax(-1)
    soft_ref = (
        -((p0[0] * logp[0, row[4]] + p0[2] * logp[0, row[7]]) + (p1[0] * logp[1, row[5]] + p1[1] * logp[1, row[8]])) / 2
    )
    assert loss.item() == pytest.approx(((1 - w) * hard + w * soft_ref).item(), rel=1e-5)
    pred = ids[logp.argmax(-1)].tolist()
    assert n == 5 and hits == sum(p == t for p, t in zip(pred, y))


def test_flops_count_only_the_head_rows():
    from parse_vllm.tools.train_draft import flops_per_token

    cfg = dict(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=1000,
    )
    assert flops_per_token({**cfg, HEAD_VOCAB_KEY: 100}, 0) == flops_per_token(cfg, 0) - 8 * 900


# --------------------------------------------------------------------------- in vLLM
PROMPTS = [[1, 9690, 198, 2683, 359], [1, 4093, 198, 19161, 253, 5905, 1517], [504, 3458, 282, 260, 6372]]
MAX_TOKENS = 12


def _hf_greedy(folder, prompts, head_ids=None, max_tokens=MAX_TOKENS):
    """Greedy tokens of the HF Llama in ``folder``, its tied head limited to ``head_ids``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    weight = model.model.embed_tokens.weight
    outs = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(max_tokens):
                h = model.model(input_ids=torch.tensor([seq])).last_hidden_state[0, -1]
                if head_ids is None:
                    seq.append(int((weight @ h).argmax()))
                else:
                    seq.append(int(head_ids[(weight[head_ids] @ h).argmax()]))
            outs.append(seq[len(p) :])
    return outs


@pytest.fixture(scope="module")
def tied_target(tiny_models, tmp_path_factory):
    """The tiny target with its head tied to its embedding, as trained drafts' heads are
    (their rows are the target's embedding rows)."""
    import shutil

    from transformers import LlamaForCausalLM

    src, out = tiny_models["target"], tmp_path_factory.mktemp("tied") / "target"
    model = LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(str(out))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in (
            "special_tokens_map.json",
            "generation_config.json",
            "chat_template.jinja",
        ):
            shutil.copy2(f, out / f.name)
    return out


def _pruned_copy(target, out, head_ids):
    """The target itself with its head cut to ``head_ids``, shipped and assembled the way
    a trained draft is (export_delta -> assemble_draft)."""
    from transformers import LlamaForCausalLM

    from parse_vllm.tools.draft_delta import assemble_draft, export_delta

    dcfg = json.loads((target / "config.json").read_text())
    dcfg.update(architectures=[ARCHITECTURE], tie_word_embeddings=False, **{HEAD_VOCAB_KEY: int(head_ids.numel())})
    model = LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    export_delta(model, dcfg, out / "delta", meta={}, head_ids=head_ids.long())
    return assemble_draft(out / "delta", target, out / "draft")


@pytest.mark.slow
def test_vllm_runs_a_pruned_head_like_the_hf_reference(tied_target, tmp_path):
    """vLLM loads the architecture by name and greedy-decodes exactly the HF reference
    limited to the head; tokens the head lacks never appear, though the unpruned model
    would say them."""
    from conftest import close_llm, engine_kwargs, make_llm
    from safetensors import safe_open
    from vllm import SamplingParams

    target = tied_target
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    full = _hf_greedy(target, PROMPTS)
    # drop every token the unpruned model says, plus random others; keep the specials
    rng = torch.Generator().manual_seed(0)
    dropped = set(t for seq in full for t in seq) | set(torch.randint(0, vocab, (2000,), generator=rng).tolist())
    dropped -= {0, 1, 2}
    head_ids = torch.tensor([t for t in range(vocab) if t not in dropped])
    draft = _pruned_copy(target, tmp_path, head_ids)
    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor(HEAD_IDS_KEY).equal(head_ids)
    want = _hf_greedy(target, PROMPTS, head_ids)

    llm = make_llm(**engine_kwargs(draft))
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        close_llm(llm)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want
    assert not dropped & {t for seq in got for t in seq}
    assert got != full


@pytest.mark.slow
def test_a_pruned_copy_of_the_target_is_accepted_as_its_draft(tied_target, tmp_path):
    """In vLLM's draft_model speculation the pruned head's rows map back to the target's
    ids: the target's own layers under a head missing a few random tokens are accepted
    (nearly) always (a wrong row -> id map would make nearly every draft token wrong)."""
    from parse_vllm.tools.train_draft import measure_acceptance

    target = tied_target
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    rng = torch.Generator().manual_seed(1)
    dropped = set(torch.randint(3, vocab, (300,), generator=rng).tolist())
    head_ids = torch.tensor([t for t in range(vocab) if t not in dropped])
    draft = _pruned_copy(target, tmp_path, head_ids)
    got = measure_acceptance(target, draft, k=4, max_tokens=16, limit=6, dtype="float32")
    assert got["draft_tokens"] > 0
    assert got["acceptance_rate"] > 0.9, got
