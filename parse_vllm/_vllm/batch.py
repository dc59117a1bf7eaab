"""The model runner's requests and input batch: one read of the batch per engine step
(`BatchView`), block tables, seeded generators."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class BatchView:
    """vLLM's input batch as PARSE reads it in one engine step: read once, when the step's
    scheduler output has been applied (GPUModelRunner._update_states), then passed to every
    hook of the step and everything below them. Rows are the input batch's (B of them, as
    vllm.v1.worker.gpu_input_batch.InputBatch orders them); host values only.

    Worked example, B = 2: a request 40 tokens into its answer, with a 3-token draft
    scheduled, and a new one whose 100-token prompt is prefilled in two chunks of 64:
        req_ids        ["a", "b"]
        num_tokens     [152, 100]   # prompt + output as of the step's start (drafts not counted)
        num_computed   [151, 0]     # in the KV cache before this step
        num_scheduled  [4, 64]      # its last token and its draft; b's first chunk
        output_len     [40, 0]
        spec_tokens    [[d0, d1, d2], []]
        prefilling     [False, True]  # b's prompt is not all in the cache after this step
    """

    req_ids: list[str]  # [B]
    token_ids: np.ndarray  # [max_reqs, max_len] the batch's token ids as of the step's start (vLLM's array, not a copy)
    num_tokens: np.ndarray  # [B] prompt + output tokens as of the step's start (InputBatch.num_tokens_no_spec)
    num_computed: np.ndarray  # [B] tokens in the KV cache before this step
    num_scheduled: np.ndarray  # [B] tokens scheduled this step (the last token and its draft, or a prompt chunk)
    output_len: np.ndarray  # [B] output tokens so far
    max_tokens: np.ndarray  # [B] 0: no limit
    min_tokens: np.ndarray  # [B]
    stops: list[frozenset[int]]  # [B] the token ids that end each request (`request_stops`)
    greedy: np.ndarray  # [B] bool: the request samples greedily
    wants_logprobs: np.ndarray  # [B] bool
    extra_args: list[dict | None]  # [B] SamplingParams.extra_args (OpenAI `vllm_xargs`)
    spec_tokens: list[list[int]]  # [B] this step's scheduled draft tokens
    bad_words: np.ndarray  # [B] bool: the request has bad words (SamplingMetadata.bad_words_token_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def prefilling(self) -> np.ndarray:
        """[B] bool: the prompt is still being prefilled after this step (the token sampled
        for the row is thrown away)."""
        return self.num_computed + self.num_scheduled < self.num_tokens


def request_stops(sp) -> frozenset[int]:
    """The token ids that end a request, as vllm.v1.core.sched.utils.check_stop reads them:
    SamplingParams.eos_token_id (None under ignore_eos) and SamplingParams.stop_token_ids
    (which update_from_generation_config extends with the generation config's extra EOS
    ids, unless ignore_eos). Not all_stop_token_ids: it holds EOS even under ignore_eos, for
    the min-tokens processor."""
    stops = set(sp.stop_token_ids or ())
    if sp.eos_token_id is not None:
        stops.add(sp.eos_token_id)
    return frozenset(stops)


def batch_view(runner, scheduler_output) -> BatchView:
    """The step's BatchView, from the runner's input batch and requests
    (vllm.v1.worker.gpu_input_batch.CachedRequestState.sampling_params, output_token_ids)
    and the scheduler output's num_scheduled_tokens."""
    from vllm.sampling_params import SamplingType

    batch = runner.input_batch
    B = batch.num_reqs
    req_ids = list(batch.req_ids)
    params = [runner.requests[r].sampling_params for r in req_ids]
    bad_words = batch.sampling_metadata.bad_words_token_ids or {}
    return BatchView(
        req_ids=req_ids,
        token_ids=batch.token_ids_cpu,
        num_tokens=batch.num_tokens_no_spec[:B].astype(np.int64),
        num_computed=batch.num_computed_tokens_cpu[:B].astype(np.int64),
        num_scheduled=np.array([scheduler_output.num_scheduled_tokens.get(r, 0) for r in req_ids], dtype=np.int64),
        output_len=np.array([len(runner.requests[r].output_token_ids) for r in req_ids], dtype=np.int64),
        max_tokens=np.array([sp.max_tokens or 0 for sp in params], dtype=np.int64),
        min_tokens=np.array([sp.min_tokens or 0 for sp in params], dtype=np.int64),
        stops=[request_stops(sp) for sp in params],
        greedy=np.array([sp.sampling_type == SamplingType.GREEDY for sp in params], dtype=bool),
        wants_logprobs=np.array([sp.logprobs is not None for sp in params], dtype=bool),
        extra_args=[sp.extra_args for sp in params],
        spec_tokens=[list(batch.spec_token_ids[i]) for i in range(B)],
        bad_words=np.array([i in bad_words for i in range(B)], dtype=bool),
    )


def scheduled_drafts(view: BatchView, num_draft_tokens) -> np.ndarray:
    """[Σd] int64: this step's scheduled draft tokens, row after row (what
    SpecDecodeMetadata.draft_token_ids holds on the device)."""
    if [len(t) for t in view.spec_tokens] != list(num_draft_tokens):
        raise RuntimeError("PARSE: the input batch's draft tokens do not match the step's spec-decode metadata")
    return np.array([t for row in view.spec_tokens for t in row], dtype=np.int64)


def request_block_table(runner, kv_cache_group_id: int):
    """The input batch's block table of one KV-cache group, as numpy
    [max_num_reqs, max_blocks] (rows = input-batch rows, manager block ids)."""
    return runner.input_batch.block_table[kv_cache_group_id].get_numpy_array()


def discarded_rows_cpu_generators(runner) -> dict[int, torch.Generator]:
    """Per-request (seeded) CPU generators of the input-batch rows whose
    sample this step is thrown away: prompts still being prefilled in chunks
    (`GPUModelRunner.discard_request_mask`). vLLM rewinds those generators
    after sampling with `Generator.set_offset` in
    vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync; a CPU generator has no offset and raises there,
    which kills the engine (vLLM 0.32's CPU runner inherits this as is)."""
    import numpy as np

    gens = runner.input_batch.generators
    if not gens:
        return {}
    rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    return {int(i): gens[int(i)] for i in rows if int(i) in gens and gens[int(i)].device.type == "cpu"}


@contextlib.contextmanager
def generators_hidden(runner, rows: Iterable[int]):
    """Take these rows' generators out of the input batch for the duration
    (so `_bookkeeping_sync` does not try to rewind them), then put them back."""
    gens = runner.input_batch.generators
    hidden = {i: gens.pop(i) for i in list(rows) if i in gens}
    try:
        yield
    finally:
        gens.update(hidden)


def batch_request_block_ids(input_batch) -> set[int]:
    """Every KV block id held by the requests now in the input batch, over
    all KV-cache groups (vllm.v1.worker.block_table.MultiGroupBlockTable
    `.block_tables`, each row valid up to `num_blocks_per_row[row]`)."""
    held: set[int] = set()
    for table in input_batch.block_table.block_tables:
        ids = table.get_numpy_array()
        for row in range(input_batch.num_reqs):
            held.update(int(b) for b in ids[row, : table.num_blocks_per_row[row]])
    return held


def external_request_id(request_id: str) -> str:
    """The id a caller gave a request, from the engine's: vLLM's InputProcessor
    (vllm.v1.engine.input_processor) appends "-" and 8 random characters to make ids unique,
    keeping the caller's as EngineCoreRequest.external_req_id."""
    head, sep, tail = request_id.rpartition("-")
    return head if sep and len(tail) == 8 else request_id
