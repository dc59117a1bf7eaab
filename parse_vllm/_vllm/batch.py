"""The model runner's requests and input batch: per-request sampling
parameters, block tables, seeded generators."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import numpy as np
import torch


def request_extra_args(runner, req_id: str) -> dict | None:
    """The request's SamplingParams.extra_args (OpenAI `vllm_xargs`)."""
    req = runner.requests.get(req_id)
    if req is None or req.sampling_params is None:
        return None
    return req.sampling_params.extra_args


def request_output_len(runner, req_id: str) -> int:
    req = runner.requests.get(req_id)
    return 0 if req is None else len(req.output_token_ids)


def request_limits(runner, req_id: str) -> tuple[int, int, frozenset[int]]:
    """(max_tokens, min_tokens, the token ids that end the request), as
    vllm.v1.core.sched.utils.check_stop reads them: SamplingParams.eos_token_id
    (None under ignore_eos) and SamplingParams.stop_token_ids (which
    update_from_generation_config extends with the generation config's extra
    EOS ids, unless ignore_eos). Not all_stop_token_ids: it holds EOS even
    under ignore_eos, for the min-tokens processor."""
    sp = runner.requests[req_id].sampling_params
    stops = set(sp.stop_token_ids or ())
    if sp.eos_token_id is not None:
        stops.add(sp.eos_token_id)
    return sp.max_tokens or 0, sp.min_tokens or 0, frozenset(stops)


def request_is_greedy(runner, req_id: str) -> bool:
    """Whether the request samples greedily (vLLM's SamplingType.GREEDY:
    temperature below its epsilon)."""
    from vllm.sampling_params import SamplingType

    return runner.requests[req_id].sampling_params.sampling_type == SamplingType.GREEDY


def request_wants_logprobs(runner, req_id: str) -> bool:
    sp = runner.requests[req_id].sampling_params
    return sp is not None and sp.logprobs is not None


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


def committed_tokens(runner):
    """(token ids [max_reqs, max_len] numpy, tokens per row [B]): every row's
    prompt and output tokens as of the start of this step (the step's sampled
    tokens are appended in bookkeeping, after drafting)."""
    batch = runner.input_batch
    return batch.token_ids_cpu, batch.num_tokens_no_spec[: batch.num_reqs]


def scheduled_drafts(runner, num_draft_tokens) -> np.ndarray:
    """[Σd] int64: this step's scheduled draft tokens, row after row, on the
    host (vllm.v1.worker.gpu_input_batch.InputBatch.spec_token_ids, set from
    SchedulerOutput.scheduled_spec_decode_tokens): what
    SpecDecodeMetadata.draft_token_ids holds on the device."""
    batch = runner.input_batch
    rows = [batch.spec_token_ids[i] for i in range(batch.num_reqs)]
    if [len(r) for r in rows] != list(num_draft_tokens):
        raise RuntimeError("PARSE: the input batch's draft tokens do not match the step's spec-decode metadata")
    return np.array([t for r in rows for t in r], dtype=np.int64)


def rows_in_partial_prefill(runner, scheduler_output):
    """[B] bool: rows whose prompt is still being prefilled after this step
    (their sampled token is thrown away)."""
    batch = runner.input_batch
    scheduled = np.array([scheduler_output.num_scheduled_tokens.get(r, 0) for r in batch.req_ids], dtype=np.int64)
    n = batch.num_reqs
    return batch.num_computed_tokens_cpu[:n] + scheduled < batch.num_tokens_no_spec[:n]
