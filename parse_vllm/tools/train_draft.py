"""Train a small draft for a target by distilling the target's own greedy answers.

``parse-vllm train-draft`` (also ``scripts/train_draft.py``) runs two resumable stages in a
work folder (default ``<cache>/train/<target name>``):

1. **answers** -- :mod:`parse_vllm.tools.prompts` makes topic-driven prompts (never the
   evaluation questions); the target answers them greedily with vLLM (chat template
   applied, ``max_tokens`` each).  Written in chunks to ``answers.jsonl``; a re-run
   continues after the last finished chunk.
2. **distill** -- a ``LlamaForCausalLM`` with few layers, the target's width and the
   target's (frozen, tied) token embedding, initialised from target layers, optionally with
   its output head cut to the answers' commonest tokens (``--head-vocab``, draft_vocab.py), is trained
   with cross-entropy on the target's greedy tokens (sequence-level distillation: the
   labels are exactly what the target emits, which is what token-level acceptance rewards).
   bf16 autocast, AdamW, cosine schedule, a token budget and a wall-clock bound;
   checkpoints every few minutes, resumes from the last one; a fixed seed fixes the data
   order and initialisation.

The result is a *delta*: only the draft's own weights (its layers and final norm, and its
head's token ids) plus its config, tens of MB (:mod:`parse_vllm.tools.draft_delta`, which also
rebuilds a normal HF folder from it and the target's embedding: that is how the shipped draft,
``parse_vllm/drafts/``, is installed by ``parse-vllm prepare-models``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from parse_vllm.draft_vocab import (
    ARCHITECTURE,
    HEAD_IDS_KEY,
    HEAD_VOCAB_KEY,
    choose_head_tokens,
    head_coverage,
    to_head_index,
)
from parse_vllm.tools.draft_delta import (
    DELTA_CONFIG,
    DELTA_META,
    DELTA_WEIGHTS,
    SHARED_WEIGHTS,
    assemble_draft,
    export_delta,
)
from parse_vllm.tools.prompts import chat_prompt_ids


@dataclass
class DraftShape:
    """Shape of the draft relative to its target."""

    num_layers: int = 2
    intermediate_size: int = 1024
    #: target layers the draft's layers start from (len == num_layers)
    init_layers: tuple[int, ...] = (0, 1)
    #: output head rows: the most frequent answer tokens (draft_vocab.py); 0 = the whole vocabulary
    head_vocab: int = 0


@dataclass
class TrainConfig:
    num_prompts: int = 2000
    #: more prompts, written by the target itself (tools/prompts.py, self-instruct family)
    self_instruct: int = 0
    max_tokens: int = 256  # answer length cap when generating data
    token_budget: int = 700_000  # answer tokens seen in training (epochs as needed)
    max_minutes: float = 30.0  # wall-clock bound of the distill stage
    batch_tokens: int = 4096  # padded tokens per optimiser step
    lr: float = 1.5e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint_minutes: float = 3.0
    shape: DraftShape = field(default_factory=DraftShape)
    #: continue from an exported draft (its folder) instead of cutting the target's layers
    init_from: str | None = None
    #: the target's top-k next-token log-probabilities saved with each answer token (0: none)
    teacher_topk: int = 8
    #: loss = (1 - w) * CE(greedy token) + w * CE(target's top-k distribution), on rows that have it
    soft_weight: float = 0.5


def flops_per_token(cfg: dict, context: int = 512) -> float:
    """Multiply-accumulates per generated token (weights + attention at ``context``;
    the head counts only its rows for a head-pruned draft)."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * i + 2 * heads * d * context
    return L * per_layer + h * (cfg.get(HEAD_VOCAB_KEY) or cfg["vocab_size"])


# --------------------------------------------------------------------------- stage 1
def generate_answers(target: str, work: Path, cfg: TrainConfig, exclude: Sequence[str], chunk: int = 250) -> Path:
    """Greedy target answers for ``cfg.num_prompts`` generated prompts and then
    ``cfg.self_instruct`` target-written ones -> ``work/answers.jsonl`` (appended to, so an
    interrupted run and a run asking for more prompts go on where the file ends)."""
    from tqdm import tqdm

    from parse_vllm.tools.prompts import make_prompts

    out = work / "answers.jsonl"
    prompts = make_prompts(cfg.num_prompts, seed=cfg.seed, exclude=exclude)
    done = 0
    if out.exists():
        with open(out) as f:
            done = sum(1 for line in f if line.strip())
    if done >= len(prompts) + cfg.self_instruct:
        return out
    from parse_vllm._vllm import LLM, SamplingParams  # vLLM only when answers are still to write

    llm = LLM(
        model=target,
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=128,
        enforce_eager=True,
        kv_cache_memory_bytes=4 << 30,
        seed=cfg.seed,
    )
    if cfg.self_instruct:
        prompts += write_prompts(llm, work / "prompts_self_instruct.jsonl", cfg.self_instruct, cfg.seed, exclude)
    tok = llm.get_tokenizer()
    # logprobs=k: the target's top-k at every answer position comes free with generation and
    # gives the draft the target's whole ranking to learn, not just its argmax.
    params = SamplingParams(
        temperature=0.0, max_tokens=cfg.max_tokens, logprobs=cfg.teacher_topk or None, detokenize=False
    )
    bar = tqdm(total=len(prompts), initial=done, desc="target answers", unit="prompt")
    t0, new_tokens = time.perf_counter(), 0
    for start in range(done, len(prompts), chunk):
        rows = prompts[start : start + chunk]
        ids = [chat_prompt_ids(tok, r["prompt"]) for r in rows]
        results = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        with open(out, "a") as f:
            for r, p, res in zip(rows, ids, results):
                answer = list(res.outputs[0].token_ids)
                new_tokens += len(answer)
                row = {**r, "prompt_ids": list(p), "answer_ids": answer}
                if cfg.teacher_topk and res.outputs[0].logprobs:
                    top = [
                        sorted(d.items(), key=lambda kv: -kv[1].logprob)[: cfg.teacher_topk]
                        for d in res.outputs[0].logprobs
                    ]
                    row["topk_ids"] = [[t for t, _ in pos] for pos in top]
                    row["topk_logprobs"] = [[round(lp.logprob, 4) for _, lp in pos] for pos in top]
                f.write(json.dumps(row) + "\n")
        bar.update(len(rows))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    del llm
    return out


def write_prompts(llm: Any, path: Path, count: int, seed: int, exclude: Sequence[str]) -> list[dict]:
    """``count`` requests written by the target (``path``, JSONL, kept and extended across
    runs): it continues a numbered list of example requests (tools/prompts.py), sampled at
    temperature 1; lines that are too short or long, repeats, and lines sharing a long word
    n-gram with ``exclude`` (the evaluation questions) are dropped. Sampled with the engine's
    seed, not per-request seeds: vLLM 0.32's CPU runner fails on seeded requests whose prompt
    is prefilled in chunks (torch CPU generators have no offset to rewind)."""
    from parse_vllm._vllm import SamplingParams
    from parse_vllm.tools.prompts import accept_written_request, banned_ngrams, self_instruct_text

    rows: list[dict] = []
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    banned = banned_ngrams(exclude)
    seen = {r["prompt"] for r in rows}
    rng = random.Random(f"self-instruct-{seed}-{len(rows)}")
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=100, stop=["\n"])
    for _ in range(20):
        if len(rows) >= count:
            break
        asked = [self_instruct_text(rng) for _ in range(max(16, int(1.3 * (count - len(rows)))))]
        written = llm.generate(asked, params, use_tqdm=False)
        with open(path, "a") as f:
            for w in written:
                text = accept_written_request(w.outputs[0].text, seen, banned)
                if text is not None and len(rows) < count:
                    rows.append({"category": "self-instruct", "prompt": text})
                    f.write(json.dumps(rows[-1]) + "\n")
    if len(rows) < count:
        raise RuntimeError(f"the target wrote only {len(rows)} usable requests of {count} asked for")
    return rows[:count]


#: one training example: prompt ids, answer ids, and per answer token the target's top-k
#: ids and log-probabilities (None for answers generated without them)
Row = tuple[list[int], list[int], "list[list[int]] | None", "list[list[float]] | None"]


def load_answers(path: Path) -> list[Row]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append((r["prompt_ids"], r["answer_ids"], r.get("topk_ids"), r.get("topk_logprobs")))
    return rows


# --------------------------------------------------------------------------- stage 2
def init_draft(target_dir: Path, shape: DraftShape, seed: int) -> tuple[Any, dict]:
    """The draft: target config with fewer/narrower layers, weights cut from the target.

    Layers come from ``shape.init_layers``; the MLP keeps the ``intermediate_size`` neurons
    with the largest ``|up| * |down|`` weight norms (a standard magnitude prune), so the
    draft starts as a shallow copy of the target rather than from noise.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tcfg = json.loads((target_dir / "config.json").read_text())
    target = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    if len(shape.init_layers) != shape.num_layers:
        raise ValueError(f"init_layers {shape.init_layers} must name {shape.num_layers} target layers")
    dcfg = dict(tcfg)
    dcfg.update(
        num_hidden_layers=shape.num_layers,
        intermediate_size=shape.intermediate_size,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    dcfg.pop("transformers_version", None)
    draft = LlamaForCausalLM(LlamaConfig(**dcfg)).float()
    sd_t = target.state_dict()
    # The final norm starts at 1 unless the draft ends with the target's last layer: the
    # target's gains are tuned for that layer's residual stream and make a shallow draft's
    # first predictions wildly over-confident (initial loss ~15 instead of ~8 here).
    n_t = tcfg["num_hidden_layers"]
    ends_like_target = shape.init_layers[-1] % n_t == n_t - 1
    new = {
        "model.embed_tokens.weight": sd_t["model.embed_tokens.weight"],
        "model.norm.weight": (
            sd_t["model.norm.weight"].clone() if ends_like_target else torch.ones_like(sd_t["model.norm.weight"])
        ),
    }
    for i, src in enumerate(shape.init_layers):
        src %= n_t
        pre_d, pre_t = f"model.layers.{i}.", f"model.layers.{src}."
        for k, v in sd_t.items():
            if k.startswith(pre_t) and ".mlp." not in k:
                new[pre_d + k[len(pre_t) :]] = v
        up, gate, down = (sd_t[pre_t + f"mlp.{n}_proj.weight"] for n in ("up", "gate", "down"))
        score = up.norm(dim=1) * down.norm(dim=0) * gate.norm(dim=1)
        keep = score.topk(shape.intermediate_size).indices.sort().values
        new[pre_d + "mlp.up_proj.weight"] = up[keep]
        new[pre_d + "mlp.gate_proj.weight"] = gate[keep]
        new[pre_d + "mlp.down_proj.weight"] = down[:, keep]
    missing, unexpected = draft.load_state_dict(new, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"draft init: missing {missing}, unexpected {unexpected}")
    draft.tie_weights()
    del target
    if shape.head_vocab:
        # Trained as a tied Llama; loaded by vLLM as the head-pruned architecture.
        dcfg.update(architectures=[ARCHITECTURE], tie_word_embeddings=False, **{HEAD_VOCAB_KEY: shape.head_vocab})
    return draft, dcfg


@dataclass
class DraftHead:
    """The rows of a head-pruned draft's output head (draft_vocab.py)."""

    token_ids: Any  # [rows] long, ascending target ids
    to_row: Any  # [vocab] long: target id -> row, -1 where the head has none

    @classmethod
    def of(cls, token_ids, vocab: int) -> DraftHead:
        return cls(token_ids=token_ids.long(), to_row=to_head_index(token_ids.long(), vocab))


def choose_draft_head(counts: Counter, target_dir: Path, size: int, vocab: int) -> DraftHead:
    """The ``size`` most frequent tokens in ``counts`` plus every special token of the target."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return DraftHead.of(choose_head_tokens(counts, size, vocab, always=tok.all_special_ids), vocab)


def _batches(rows: list[tuple[list[int], list[int]]], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar length (little padding), in a seeded random order."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i][0]) + len(rows[i][1]), rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(rows[i][0]) + len(rows[i][1])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


@dataclass
class SoftTargets:
    """The target's top-k distribution at the answer positions that have one.

    Rows follow ``labels != -100`` in row-major order (the order ``hidden[mask]`` yields).
    """

    rows: Any  # [num_soft] long: index into the answer positions
    ids: Any  # [num_soft, k] long
    probs: Any  # [num_soft, k] float: renormalised over the top k


def _collate(rows, idx, pad_id: int, topk: int = 0):
    """inputs [B, T], labels [B, T] (-100 outside the answer): position t predicts token t+1;
    plus the answers' soft targets (None when ``topk`` is 0 or no row in the batch has them)."""
    import torch

    seqs = [rows[i][0] + rows[i][1] for i in idx]
    T = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    soft_rows, soft_ids, soft_lp, offset = [], [], [], 0
    for b, i in enumerate(idx):
        s, p = seqs[b], len(rows[i][0])
        inputs[b, : len(s) - 1] = torch.tensor(s[:-1])
        labels[b, p - 1 : len(s) - 1] = torch.tensor(s[p:])
        n_ans = len(s) - p
        top_ids, top_lp = rows[i][2], rows[i][3]
        if topk and top_ids is not None and len(top_ids) == n_ans:
            soft_rows.extend(range(offset, offset + n_ans))
            # pad short rankings (a position may list fewer than k) with a repeat at -inf
            soft_ids.extend((ids + ids[-1:] * topk)[:topk] for ids in top_ids)
            soft_lp.extend((lp + [-math.inf] * topk)[:topk] for lp in top_lp)
        offset += n_ans
    soft = None
    if soft_rows:
        soft = SoftTargets(
            rows=torch.tensor(soft_rows), ids=torch.tensor(soft_ids), probs=torch.tensor(soft_lp).softmax(-1)
        )
    return inputs, labels, soft


def _loss_and_hits(
    model, inputs, labels, soft: SoftTargets | None = None, soft_weight: float = 0.0, head: DraftHead | None = None
):
    """Loss on answer positions only (the lm_head runs on those rows alone): cross-entropy on
    the target's greedy token, mixed with cross-entropy against the target's top-k
    distribution where the batch has it. With a pruned ``head``, the logits cover its rows
    only: tokens it cannot say drop out of the loss and count as misses in ``hits``."""
    import torch.nn.functional as F

    mask = labels != -100
    hidden = model.model(input_ids=inputs, attention_mask=(inputs >= 0).long()).last_hidden_state
    h = hidden[mask]  # [num_answer_tokens, hidden]
    weight = model.model.embed_tokens.weight  # tied head, frozen
    y = labels[mask]  # [num_answer_tokens] target ids
    if head is not None:
        weight = weight[head.token_ids]
    logits = F.linear(h, weight)  # [num_answer_tokens, rows]
    logp = logits.float().log_softmax(-1)
    y_row = y if head is None else head.to_row[y]  # -1: not in the head
    loss = F.nll_loss(logp, y_row, ignore_index=-1) if bool((y_row >= 0).any()) else logp.sum() * 0
    if soft is not None and soft_weight > 0:
        ids = soft.ids if head is None else head.to_row[soft.ids]
        probs = soft.probs * (ids >= 0)  # mass on tokens the head lacks is dropped
        soft_loss = -(probs * logp[soft.rows].gather(1, ids.clamp(min=0))).sum(-1).mean()
        loss = (1 - soft_weight) * loss + soft_weight * soft_loss
    pred = logits.argmax(-1)
    if head is not None:
        pred = head.token_ids[pred]
    hits = (pred == y).sum().item()
    return loss, hits, int(y.numel())


def evaluate(model, rows, batch_tokens: int, pad_id: int, head: DraftHead | None = None) -> float:
    """Teacher-forced greedy agreement with the target on ``rows`` (a proxy for acceptance)."""
    import torch

    model.eval()
    hits = total = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for idx in _batches(rows, batch_tokens, random.Random(0)):
            inputs, labels, _ = _collate(rows, idx, pad_id)
            _, h, n = _loss_and_hits(model, inputs, labels, head=head)
            hits, total = hits + h, total + n
    model.train()
    return hits / max(total, 1)


def _identity(config: dict) -> dict:
    """What a checkpoint must agree on to be resumed: everything but the time bounds."""
    return {k: v for k, v in config.items() if k not in ("max_minutes", "checkpoint_minutes")}


def distill(target_dir: Path, work: Path, cfg: TrainConfig, log=print) -> Path:
    """Train the draft on ``work/answers.jsonl``; checkpoints in ``work/ckpt.pt``; -> ``work/draft``."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    rows = load_answers(work / "answers.jsonl")[: cfg.num_prompts + cfg.self_instruct]
    rng = random.Random(cfg.seed)
    perm = list(range(len(rows)))
    rng.shuffle(perm)
    n_eval = max(16, len(rows) // 20)
    eval_rows = [rows[i] for i in perm[:n_eval]]
    train_rows = [rows[i] for i in perm[n_eval:]]
    answer_tokens = sum(len(r[1]) for r in train_rows)
    soft_tokens = sum(len(r[1]) for r in train_rows if r[2] is not None)
    log(
        f"[train-draft] data: {len(train_rows)} train answers ({answer_tokens} answer tokens, {soft_tokens} of "
        f"them with the target's top-{cfg.teacher_topk}; {sum(len(r[0]) for r in train_rows)} prompt tokens), "
        f"{len(eval_rows)} held out"
    )

    model, dcfg = init_draft(target_dir, cfg.shape, cfg.seed)
    prev = {}
    if cfg.init_from:
        from safetensors.torch import load_file

        prev = load_file(str(Path(cfg.init_from) / DELTA_WEIGHTS))
        model.load_state_dict({k: v.float() for k, v in prev.items() if k != HEAD_IDS_KEY}, strict=False)
        log(f"[train-draft] starting from {cfg.init_from} ({len(prev)} tensors)")
    head = head_info = None
    if cfg.shape.head_vocab:
        # A continued draft keeps its head; a new one takes the training answers' commonest tokens.
        train_counts = Counter(t for r in train_rows for t in r[1])
        head = (
            DraftHead.of(prev[HEAD_IDS_KEY], dcfg["vocab_size"])
            if HEAD_IDS_KEY in prev
            else choose_draft_head(train_counts, target_dir, cfg.shape.head_vocab, dcfg["vocab_size"])
        )
        if head.token_ids.numel() != cfg.shape.head_vocab:
            raise ValueError(
                f"--init-from {cfg.init_from} has a {head.token_ids.numel()}-row head, not {cfg.shape.head_vocab}"
            )
        head_info = {
            "rows": cfg.shape.head_vocab,
            "coverage_train": head_coverage(train_counts, head.token_ids),
            "coverage_held_out": head_coverage(Counter(t for r in eval_rows for t in r[1]), head.token_ids),
        }
        log(
            f"[train-draft] head: {cfg.shape.head_vocab} of {dcfg['vocab_size']} tokens, covering "
            f"{head_info['coverage_train']:.4f} of the training answers' tokens and "
            f"{head_info['coverage_held_out']:.4f} of the held-out ones"
        )
    pad_id = int(dcfg.get("pad_token_id") or 0)
    model.model.embed_tokens.weight.requires_grad_(False)  # shared with the target, never trained
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    steps_per_epoch = len(_batches(train_rows, cfg.batch_tokens, random.Random(0)))
    total_steps = max(1, math.ceil(cfg.token_budget / max(answer_tokens, 1) * steps_per_epoch))

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total_steps)))

    state = {"step": 0, "epoch": 0, "pos": 0, "tokens": 0, "seconds": 0.0, "history": []}
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        if _identity(saved.get("config", {})) != _identity(asdict(cfg)):
            raise ValueError(
                f"{ckpt} was made with other settings; delete it or pass the same options "
                f"(only --max-minutes may change between runs)"
            )
        model.load_state_dict(saved["model"], strict=False)
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"[train-draft] resuming at step {state['step']} ({state['tokens']} tokens seen)")
    else:
        acc0 = evaluate(model, eval_rows, cfg.batch_tokens, pad_id, head)
        state["history"].append({"step": 0, "tokens": 0, "eval_agreement": acc0})
        log(f"[train-draft] before training: held-out greedy agreement {acc0:.3f}")

    def save() -> None:
        trainable = {k: v for k, v in model.state_dict().items() if k not in SHARED_WEIGHTS and k != "lm_head.weight"}
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"config": asdict(cfg), "model": trainable, "opt": opt.state_dict(), "state": state}, tmp)
        os.replace(tmp, ckpt)

    t_start = time.perf_counter() - state["seconds"]
    last_save = time.perf_counter()
    bar = tqdm(total=total_steps, initial=state["step"], desc="distill", unit="step")
    run_hits = run_n = 0
    while state["step"] < total_steps:
        batches = _batches(train_rows, cfg.batch_tokens, random.Random(cfg.seed * 1000 + state["epoch"]))
        while state["pos"] < len(batches) and state["step"] < total_steps:
            if time.perf_counter() - t_start > cfg.max_minutes * 60:
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(state["step"])
            inputs, labels, soft = _collate(train_rows, batches[state["pos"]], pad_id, cfg.teacher_topk)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, hits, n = _loss_and_hits(model, inputs, labels, soft, cfg.soft_weight, head)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            state["step"] += 1
            state["pos"] += 1
            state["tokens"] += n
            run_hits, run_n = run_hits + hits, run_n + n
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", agree=f"{run_hits / max(run_n, 1):.3f}")
            if time.perf_counter() - last_save > cfg.checkpoint_minutes * 60:
                state["seconds"] = time.perf_counter() - t_start
                save()
                last_save = time.perf_counter()
                run_hits = run_n = 0
        else:
            if state["pos"] >= len(batches):
                state["epoch"] += 1
                state["pos"] = 0
            continue
        break  # out of time
    bar.close()
    state["seconds"] = time.perf_counter() - t_start
    acc = evaluate(model, eval_rows, cfg.batch_tokens, pad_id, head)
    state["history"].append({"step": state["step"], "tokens": state["tokens"], "eval_agreement": acc})
    save()
    log(
        f"[train-draft] {state['step']}/{total_steps} steps, {state['tokens']} tokens, "
        f"{state['seconds'] / 60:.1f} min; held-out greedy agreement {acc:.3f}"
    )

    out = work / "draft"
    export_delta(
        model,
        dcfg,
        out,
        head_ids=None if head is None else head.token_ids,
        meta={
            "target": target_dir.name,
            "train": asdict(cfg),
            "data_answers": len(train_rows),
            "data_answer_tokens": answer_tokens,
            "data_soft_tokens": soft_tokens,
            "steps": state["step"],
            "tokens_seen": state["tokens"],
            "train_minutes": round(state["seconds"] / 60, 2),
            "history": state["history"],
            "head": head_info,
            "flops_per_token_target": flops_per_token(json.loads((target_dir / "config.json").read_text())),
            "flops_per_token_draft": flops_per_token(dcfg),
            # a continued run records the run it started from
            "previous": (
                json.loads((Path(cfg.init_from) / DELTA_META).read_text())
                if cfg.init_from and (Path(cfg.init_from) / DELTA_META).exists()
                else None
            ),
        },
    )
    return out


def measure_acceptance(
    target: Path,
    draft: Path,
    k: int = 4,
    max_tokens: int = 256,
    batch: int = 16,
    limit: int | None = None,
    dtype: str = "bfloat16",
) -> dict:
    """The standard quality figure of a draft: vLLM's own ``draft_model`` speculative decoding
    with ``k`` tokens, greedy, on MT-Bench's 80 first-turn questions (chat template applied).

    Returns the acceptance rate (accepted / proposed draft tokens) and the mean acceptance
    length (1 + accepted tokens per draft, the tokens each target step yields).
    """
    from parse_vllm._vllm import LLM, SamplingParams
    from parse_vllm.tools.engine import close, spec_counters
    from parse_vllm.tools.prompts import mtbench_questions

    llm = LLM(
        model=str(target),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=batch,
        kv_cache_memory_bytes=2 << 30,
        seed=0,
        disable_log_stats=False,  # the spec-decode counters
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": k},
    )
    try:
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": chat_prompt_ids(tok, q["prompt"])} for q in mtbench_questions()[:limit]]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True)
        c = spec_counters(llm)
    finally:
        close(llm)
    return {
        "k": k,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "drafts": int(c["drafts"]),
        "draft_tokens": int(c["draft_tokens"]),
        "accepted": int(c["accepted"]),
        "acceptance_rate": c["accepted"] / c["draft_tokens"] if c["draft_tokens"] else None,
        "mean_acceptance_length": 1 + c["accepted"] / c["drafts"] if c["drafts"] else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``parse-vllm train-draft``: answers, then distill, then (``--ship``) install the delta."""
    from parse_vllm.cache import default_cache_dir
    from parse_vllm.tools.prepare_models import DEMO_DRAFT_NAME, DEMO_TARGET_NAME, SHIPPED_DRAFTS, prepare_models
    from parse_vllm.tools.prompts import mtbench_questions

    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="parse-vllm train-draft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help=f"target HF folder (default: the prepared {DEMO_TARGET_NAME})")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: <cache>/train/<target name>)")
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    ap.add_argument(
        "--self-instruct",
        type=int,
        default=d.self_instruct,
        help="more prompts, written by the target itself, after the --num-prompts generated ones",
    )
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens, help="answer length cap when generating data")
    ap.add_argument("--token-budget", type=int, default=d.token_budget, help="answer tokens to train on")
    ap.add_argument("--max-minutes", type=float, default=d.max_minutes, help="wall-clock bound of the distill stage")
    ap.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--layers", type=int, default=d.shape.num_layers)
    ap.add_argument("--intermediate-size", type=int, default=d.shape.intermediate_size)
    ap.add_argument(
        "--init-layers",
        default=None,
        help="comma-separated target layers the draft's layers start from (default: the first --layers)",
    )
    ap.add_argument(
        "--head-vocab",
        type=int,
        default=d.shape.head_vocab,
        help="output head rows: the answers' most frequent tokens (0: the whole vocabulary)",
    )
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--init-from",
        default=None,
        help="continue training an exported draft (a folder with draft_delta.safetensors), fresh schedule",
    )
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument(
        "--teacher-topk",
        type=int,
        default=d.teacher_topk,
        help="save the target's top-k log-probabilities with new answers (0: greedy tokens only)",
    )
    ap.add_argument(
        "--soft-weight",
        type=float,
        default=d.soft_weight,
        help="weight of the loss against the target's top-k distribution (rest: its greedy token)",
    )
    ap.add_argument(
        "--eval-acceptance",
        action="store_true",
        help="measure vLLM draft_model (k=4) acceptance on MT-Bench and record it in training.json",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads for distillation (default: all cores)")
    ap.add_argument(
        "--ship",
        action="store_true",
        help=f"copy the result into the package (parse_vllm/drafts/{DEMO_DRAFT_NAME}) for make demo/bench",
    )
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    target = Path(args.target) if args.target else prepare_models(names=(DEMO_TARGET_NAME,))[DEMO_TARGET_NAME]
    if not (target / "config.json").is_file():
        ap.error(f"--target {target}: not a HF model folder (no config.json)")
    work = args.work or default_cache_dir() / "train" / target.name
    work.mkdir(parents=True, exist_ok=True)
    try:
        init_layers = (
            tuple(int(x) for x in args.init_layers.split(",")) if args.init_layers else tuple(range(args.layers))
        )
    except ValueError:
        ap.error(f"--init-layers {args.init_layers!r}: expected comma-separated integers")
    if len(init_layers) != args.layers:
        ap.error(f"--init-layers names {len(init_layers)} layers, --layers is {args.layers}")
    shape = DraftShape(
        num_layers=args.layers,
        intermediate_size=args.intermediate_size,
        init_layers=init_layers,
        head_vocab=args.head_vocab,
    )
    cfg = TrainConfig(
        num_prompts=args.num_prompts,
        self_instruct=args.self_instruct,
        max_tokens=args.max_tokens,
        token_budget=args.token_budget,
        max_minutes=args.max_minutes,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        seed=args.seed,
        shape=shape,
        init_from=args.init_from,
        warmup_steps=args.warmup_steps,
        teacher_topk=args.teacher_topk,
        soft_weight=args.soft_weight,
    )
    if args.num_prompts < 1 or args.self_instruct < 0:
        ap.error("--num-prompts must be >= 1 and --self-instruct >= 0")
    if not 0 <= args.soft_weight <= 1:
        ap.error(f"--soft-weight {args.soft_weight}: must be in [0, 1]")
    print(f"[train-draft] work folder {work}")
    generate_answers(str(target), work, cfg, exclude=[q["prompt"] for q in mtbench_questions()])
    out = distill(target, work, cfg)
    meta = json.loads((out / DELTA_META).read_text())
    print(
        f"[train-draft] draft delta in {out}: {meta['flops_per_token_target'] / meta['flops_per_token_draft']:.2f}x "
        f"fewer MACs per token than the target; held-out greedy agreement "
        f"{meta['history'][-1]['eval_agreement']:.3f}"
    )
    if args.eval_acceptance:
        with tempfile.TemporaryDirectory() as tmp:
            acc = measure_acceptance(target, assemble_draft(out, target, Path(tmp) / "draft"))
        meta["acceptance_mtbench"] = acc
        (out / DELTA_META).write_text(json.dumps(meta, indent=2) + "\n")
        print(
            f"[train-draft] vLLM draft_model k=4 on MT-Bench: acceptance rate {acc['acceptance_rate']:.3f}, "
            f"mean acceptance length {acc['mean_acceptance_length']:.2f}"
        )
    if args.ship:
        dest = SHIPPED_DRAFTS / DEMO_DRAFT_NAME
        dest.mkdir(parents=True, exist_ok=True)
        for name in (DELTA_WEIGHTS, DELTA_CONFIG, DELTA_META):
            shutil.copy2(out / name, dest / name)
        print(f"[train-draft] shipped to {dest} (run `parse-vllm prepare-models` to assemble it)")
    return 0


__all__ = [
    "TrainConfig",
    "DraftShape",
    "generate_answers",
    "distill",
    "flops_per_token",
    "measure_acceptance",
    "main",
]
