"""The judges the head is compared with (issue: the field's training-free baseline), built as an
optional data stage (``--baselines``) over the examples the head is trained and scored on.

**The KL judge** (arXiv 2601.04766): how far the draft's next-token distributions are from the
target's over the tokens a judgment covers, untrained. Per answer token j (predicted at the
position before it), both models' distributions are read with vLLM's ``prompt_logprobs=k``:
each model's top k tokens with their log-probabilities (and the answer's own token). The full
distributions (151k entries a token) are too big to keep, so the divergence is taken over U,
the union of the two top-k sets, plus one bucket for the rest of the vocabulary:

    P(x) for x in U: its log-probability where x is in P's top k, else P's remaining mass
                     spread evenly over the tokens outside its top k, (1 - Σ_topk P) / (V - k)
    P(rest) = 1 - Σ_{x in U} P(x)       (the same for Q)
    KL(P || Q) = Σ_{x in U + rest} P(x) log(P(x) / Q(x))

(`topk_kl`). `tests/test_judge_baselines.py` checks it against the exact KL of full softmaxes;
on a real set, `kl_check` compares it with the full distributions of both models (HF forwards)
over the first KL_CHECK_ANSWERS answers and writes how far apart they are (``kl_check.json``:
per direction, the per-token absolute and relative errors, and the correlation of the per-token
values and of the window means the judge reads). Per
example, over the draft tokens of the window its boundary ends in (from `window_start` to the
boundary, as the evidence features read them), `KL_FEATURES`: the mean, the maximum and the
90th percentile of KL(target || draft) and of KL(draft || target). Higher means less alike;
the judge scores -KL.

**The suffix-free head**: the target's final hidden state at the prefix's own last token
(prompt + prefix, no verification suffix), which the window's forward computes anyway; a head
reading it would need no verification pass. ``hidden_at_prefix.npy`` [N, H].

Files (beside the features stage's, rows in ``index.jsonl`` order): ``token_kl.jsonl`` (per
distinct answer, both directions' per-token KL), ``kl.npy`` [N, 6], ``kl_check.json``,
``hidden_at_prefix.npy``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from . import data
from .data import BASELINES_STAGE as STAGE

TOP_K = 20  # tokens per position each model reports (vLLM's default max_logprobs)
KL_CHECK_ANSWERS = 8  # answers whose top-k KL is compared with the full distributions' (kl_check)
KL_FEATURES = ("kl_td_mean", "kl_td_max", "kl_td_p90", "kl_dt_mean", "kl_dt_max", "kl_dt_p90")
_TINY = 1e-12  # a probability never quite 0 in the log


def _spread(ids: np.ndarray, lp: np.ndarray, union: np.ndarray, vocab: int) -> np.ndarray:
    """One model's probabilities over `union` [U] + a rest bucket, from its top tokens `ids`
    [k] with log-probabilities `lp` [k] (module docstring)."""
    p_top = np.exp(lp.astype(np.float64))
    rest = max(0.0, 1.0 - p_top.sum())
    outside = max(vocab - len(ids), 1)
    p = np.full(len(union), rest / outside)
    where = {int(t): i for i, t in enumerate(union)}
    for t, v in zip(ids, p_top):
        p[where[int(t)]] = v
    return np.append(p, max(0.0, 1.0 - p.sum()))


def topk_kl(p_ids, p_lp, q_ids, q_lp, vocab: int) -> float:
    """KL(P || Q) from each one's top tokens (ids [k], log-probabilities [k]), the rest of
    each one's mass spread over the tokens outside its top set (module docstring)."""
    p_ids, q_ids = np.asarray(p_ids, dtype=np.int64), np.asarray(q_ids, dtype=np.int64)
    union = np.union1d(p_ids, q_ids)
    p = _spread(p_ids, np.asarray(p_lp), union, vocab)
    q = _spread(q_ids, np.asarray(q_lp), union, vocab)
    m = p > 0
    return float(np.sum(p[m] * (np.log(p[m]) - np.log(np.maximum(q[m], _TINY)))))


def exact_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """[L] KL(P || Q) per row of two [L, V] logit arrays: the full softmaxes."""
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def kl_features(kl_td: np.ndarray, kl_dt: np.ndarray, start: int, end: int) -> np.ndarray:
    """[6] KL_FEATURES over answer tokens start..end-1 (end > start)."""
    out = []
    for kl in (kl_td, kl_dt):
        seg = np.asarray(kl[start:end], dtype=np.float64)
        out += [seg.mean(), seg.max(), float(np.percentile(seg, 90))]
    return np.array(out)


def example_kl(rows: list[dict], token_kl: dict[tuple[str, int], np.ndarray], window: int) -> np.ndarray:
    """[N, 6] the KL features of each example (rows as index.jsonl's), over the draft tokens
    of the window its boundary ends in; `token_kl[(task, answer)]`: [2, len] per answer token,
    KL(target || draft) and KL(draft || target)."""
    from parse_vllm.evidence import window_start

    out = np.zeros((len(rows), len(KL_FEATURES)))
    for i, r in enumerate(rows):
        kl = token_kl[(r["task"], r["answer"])]
        out[i] = kl_features(kl[0], kl[1], window_start(r["length"], window), r["length"])
    return out


class TopkReader(data.LogprobReader):
    """A model's top `k` next-token log-probabilities at every position of each sequence after
    its first (vLLM ``prompt_logprobs=k``; the sequence's own token is among them, as vLLM
    adds it): per sequence, a list of (ids [k'], log-probabilities [k']) per position. The
    engine is the evidence stage's reader's, allowed k log-probabilities."""

    def __init__(self, engine: dict[str, Any], k: int = TOP_K):
        super().__init__(dict(engine, max_logprobs=k))
        self.k = k

    def __call__(self, sequences: list[list[int]]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        from parse_vllm._vllm import LLM, SamplingParams

        if self.llm is None:
            self.llm = LLM(**self.engine)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=self.k)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        return [
            [
                (np.fromiter(d.keys(), dtype=np.int64), np.array([v.logprob for v in d.values()], dtype=np.float64))
                for d in o.prompt_logprobs[1:]
            ]
            for o in outs
        ]


def open_topk_reader(engine: dict[str, Any]) -> TopkReader:
    """The draft's or the target's reader (the tests replace it with HF models)."""
    return TopkReader(engine)


def token_kl(target: list[tuple[np.ndarray, np.ndarray]], draft: list[tuple[np.ndarray, np.ndarray]], vocab: int):
    """[2, L] per position: KL(target || draft) and KL(draft || target) by `topk_kl`."""
    out = np.zeros((2, len(target)))
    for j, ((t_ids, t_lp), (d_ids, d_lp)) in enumerate(zip(target, draft)):
        out[0, j] = topk_kl(t_ids, t_lp, d_ids, d_lp, vocab)
        out[1, j] = topk_kl(d_ids, d_lp, t_ids, t_lp, vocab)
    return out


def stage_baselines(job) -> None:
    """The stage (module docstring) over a data folder whose features stage is done: per
    distinct answer, both models' top-k over prompt + answer (the two engines side by side,
    a batch of answers at a time, resumable), then the per-example KL features; and the
    target's hidden state at each example's prompt + prefix."""
    if job.done(STAGE):
        return
    job.check_partial(STAGE)
    rows = data.read_jsonl(job.path("index.jsonl"))
    answers = {(a["task"], a["answer"]): a["token_ids"] for a in data.read_jsonl(job.path("boundaries.jsonl"))}
    needed = list(dict.fromkeys((r["task"], r["answer"]) for r in rows))
    path = job.path("token_kl.jsonl")
    have = {(r["task"], r["answer"]) for r in data.read_jsonl(path)}
    todo = [key for key in needed if key not in have]
    clock = data._Clock(job, STAGE)
    readers = (open_topk_reader(job.target_engine), open_topk_reader(job.draft_engine)) if todo else ()
    try:
        for n, batch in enumerate(data.chunks(todo, data.CALL_BATCHES * job.batch)):
            seqs = [job.prompt_ids[t] + answers[(t, a)] for t, a in batch]
            target, draft = (r(seqs) for r in readers)
            vocab = len(job.tokenizer)  # the pair shares it (a draft model is refused otherwise)
            out = []
            for (t, a), tk, dk in zip(batch, target, draft):
                p = len(job.prompt_ids[t])
                kl = token_kl(tk[p - 1 :], dk[p - 1 :], vocab)  # the answer's tokens: predicted from p - 1 on
                out.append({"task": t, "answer": a, "kl_td": [round(float(x), 6) for x in kl[0]],
                            "kl_dt": [round(float(x), 6) for x in kl[1]]})  # fmt: skip
            data.append_jsonl(path, out)
            clock.tick()
            job.log(f"baselines: KL of {len(have) + min(len(todo), (n + 1) * data.CALL_BATCHES * job.batch)}"
                    f"/{len(needed)} answers, {job.seconds(STAGE) / 60:.1f} min")  # fmt: skip
            job.deadline.check()
    finally:
        for r in readers:
            r.close()
    kl = {(r["task"], r["answer"]): np.array([r["kl_td"], r["kl_dt"]]) for r in data.read_jsonl(path)}
    np.save(job.path("kl.npy"), example_kl(rows, kl, job.settings.window))
    if not job.path("kl_check.json").is_file():
        check = kl_check(job, {key: kl[key] for key in needed[:KL_CHECK_ANSWERS]}, answers)
        job.path("kl_check.json").write_text(json.dumps(check, indent=1) + "\n")
        job.log(f"baselines: top-{TOP_K} KL against the full distributions: {check}")
        clock.tick()
    _hidden_at_prefix(job, rows, answers, clock)
    clock.tick()
    job.mark_done(STAGE, rows=len(rows), answers=len(needed))


def kl_errors(approx: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    """How far per-token top-k KLs [L] are from the exact ones [L]."""
    err = np.abs(approx - exact)
    rel = err / np.maximum(exact, 1e-6)
    corr = float(np.corrcoef(approx, exact)[0, 1]) if len(exact) > 1 and exact.std() > 0 else None
    return {"median_abs": float(np.median(err)), "p90_abs": float(np.percentile(err, 90)),
            "median_rel": float(np.median(rel)), "p90_rel": float(np.percentile(rel, 90)),
            "mean_exact": float(exact.mean()), "pearson": corr}  # fmt: skip


def kl_check(job, token_kl: dict[tuple[str, int], np.ndarray], answers: dict) -> dict[str, Any]:
    """The top-k KL of some answers (`token_kl`: [2, len] each) against the exact KL of both
    models' full distributions (HF forwards, float32) at the same positions, per direction
    (``td``: KL(target || draft), ``dt``), per token and as window means of W tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
              for path in (job.settings.target, job.settings.draft)]  # fmt: skip
    approx, exact, means = [], [], []
    for (task, a), kl in token_kl.items():
        prompt = job.prompt_ids[task]
        seq = prompt + answers[(task, a)]
        with torch.no_grad():  # answer token j is predicted at position len(prompt) - 1 + j
            t, d = (m(torch.tensor([seq])).logits[0, len(prompt) - 1 : -1].double().numpy() for m in models)
        full = np.stack([exact_kl(t, d), exact_kl(d, t)])
        approx.append(kl)
        exact.append(full)
        w = job.settings.window
        means += [(kl[:, i : i + w].mean(axis=1), full[:, i : i + w].mean(axis=1)) for i in range(0, kl.shape[1], w)]
    out: dict[str, Any] = {"answers": len(approx), "tokens": int(sum(k.shape[1] for k in approx)), "top_k": TOP_K}
    for i, name in enumerate(("td", "dt")):
        got, want = np.concatenate([k[i] for k in approx]), np.concatenate([e[i] for e in exact])
        out[name] = kl_errors(got, want)
        mg, mw = np.array([m[0][i] for m in means]), np.array([m[1][i] for m in means])
        out[name]["window_mean_pearson"] = float(np.corrcoef(mg, mw)[0, 1]) if len(mw) > 1 and mw.std() > 0 else None
    return out


def _hidden_at_prefix(job, rows: list[dict], answers: dict, clock) -> None:
    """hidden_at_prefix.npy [N, H]: the target's final hidden state at prompt + prefix's last
    token, in parts of TASKS_PER_FEATURE_CALL tasks (resumable)."""
    parts = job.path("hidden_at_prefix")
    parts.mkdir(exist_ok=True)
    by_task, groups = data.task_groups(job, rows)
    reader = None
    try:
        for g, group in enumerate(groups):
            part = parts / f"part-{g:05d}.npz"
            if part.is_file():
                continue
            ids = [i for t in group for i in by_task[t]]
            seqs = [job.prompt_ids[rows[i]["task"]] + answers[(rows[i]["task"], rows[i]["answer"])][: rows[i]["length"]]
                    for i in ids]  # fmt: skip
            reader = reader or data.open_reader(job.target_engine)
            tmp = part.with_name(part.stem + ".tmp.npz")
            np.savez(tmp, rows=np.asarray(ids, dtype=np.int64), hidden=reader(seqs))
            tmp.replace(part)
            clock.tick()
            job.log(f"baselines: hidden states at the prefix, {g + 1}/{len(groups)} groups of tasks")
            job.deadline.check()
    finally:
        if reader is not None:
            reader.close()
    loaded = [np.load(parts / f"part-{g:05d}.npz") for g in range(len(groups))]
    hidden = np.zeros((len(rows), loaded[0]["hidden"].shape[1]), dtype=np.float32)
    for z in loaded:
        hidden[z["rows"]] = z["hidden"]
    np.save(job.path("hidden_at_prefix.npy"), hidden)
