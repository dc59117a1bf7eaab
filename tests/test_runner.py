"""The PARSE runner's hooks on stand-ins for vLLM's model runner (no model, no engine)."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from parse_vllm.runner import ParseRunnerMixin


class _KvCacheRunner:
    """vLLM's model runner as far as KV-cache set-up goes: GPUModelRunner.initialize_kv_cache
    allocates through initialize_kv_cache_tensors, and _cleanup_profiling_kv_cache drops its
    own references to the profiling cache (CUDA-graph memory profiling, 0.33)."""

    parse = None

    def initialize_kv_cache_tensors(self, num_blocks, *args, **kwargs):
        self.kv_caches = {"model.layers.0.self_attn.attn": torch.zeros(num_blocks, 16)}
        return self.kv_caches

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes, *args, **kwargs):
        pass

    def initialize_kv_cache(self, num_blocks, is_profiling=False, **kwargs):
        self.initialize_metadata_builders(num_blocks, [16])
        self.initialize_kv_cache_tensors(num_blocks)

    def _cleanup_profiling_kv_cache(self):
        self.kv_caches = None


Runner = type("Runner", (ParseRunnerMixin, _KvCacheRunner), {})


def test_the_profiling_kv_cache_is_not_held_once_vllm_drops_it():
    """vLLM computes the KV budget before profiling and allocates the real cache after
    dropping the profiling one: a reference kept by PARSE would hold both at once."""
    runner = Runner()
    runner.initialize_kv_cache(4, is_profiling=True)
    profiling = weakref.ref(runner.kv_caches["model.layers.0.self_attn.attn"])
    runner._cleanup_profiling_kv_cache()
    gc.collect()
    assert profiling() is None
    runner.initialize_kv_cache(64)
    assert runner._parse_caches_by_layer["model.layers.0.self_attn.attn"].shape[0] == 64


# -- one step's translation, on hand-made vLLM objects --------------------------------------

VOCAB = 64
A_DRAFT = [11, 12, 13, 14]  # request "a": judged (τ 0.5), its 4-token draft scheduled this step


@dataclasses.dataclass
class _SamplingMetadata:  # the fields of vllm.v1.sample.metadata.SamplingMetadata that PARSE reads or replaces
    generators: dict
    bad_words_token_ids: dict
    allowed_token_ids_mask: object = None
    max_num_logprobs: object = None
    logprob_token_ids: object = None
    spec_token_ids: object = None


class _StepRunner:
    """vLLM's model runner as far as one step's hooks go: the input batch after
    _update_states, a rejection sampler that took none of "a"'s draft and sampled 5 for
    "b", a sampler that samples 99, vLLM's copy of the drafts."""

    parse = None

    def __init__(self):
        from vllm import SamplingParams

        self.device = torch.device("cpu")
        self.model_config = SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=512)
        tokens = np.zeros((4, 64), dtype=np.int32)
        tokens[0, :20], tokens[1, :8] = np.arange(20), np.arange(8)
        sm = _SamplingMetadata(generators={}, bad_words_token_ids={})
        self.input_batch = SimpleNamespace(
            req_ids=["a", "b"],
            num_reqs=2,
            token_ids_cpu=tokens,
            num_tokens_no_spec=np.array([20, 8, 0, 0]),
            num_computed_tokens_cpu=np.array([19, 7, 0, 0]),
            spec_token_ids=[A_DRAFT, []],
            sampling_metadata=sm,
        )
        self.requests = {
            "a": SimpleNamespace(
                sampling_params=SamplingParams(max_tokens=100, temperature=0.0, stop_token_ids=[2]),
                output_token_ids=[1] * 6,
            ),
            "b": SimpleNamespace(
                sampling_params=SamplingParams(max_tokens=100, temperature=0.0, extra_args={"parse": False}),
                output_token_ids=[1] * 2,
            ),
        }
        self.sampler = lambda logits, sampling_metadata, predict_bonus_token: SimpleNamespace(
            sampled_token_ids=torch.full((logits.shape[0], 1), 99)
        )

    def _update_states(self, scheduler_output):
        return None

    def _sample(self, logits, md):
        from vllm.v1.outputs import SamplerOutput

        return SamplerOutput(
            sampled_token_ids=torch.tensor([[11, -1, -1, -1, -1], [5, -1, -1, -1, -1]]), logprobs_tensors=None
        )

    def sample_tokens(self, *args, **kwargs):
        from vllm.v1.outputs import ModelRunnerOutput

        return ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})

    def take_draft_token_ids(self):
        from vllm.v1.outputs import DraftTokenIds

        return DraftTokenIds(["a", "b"], [[21, 22, 2, 24], [31, 32, 33, 34]])

    def _parse_audit_kv(self):
        pass


class _PassingVerifier:
    """Every copy passes (log-odds 3)."""

    def judge(self, copies):
        from parse_vllm.verify import Judgments

        n = copies.req_row.shape[0]
        return Judgments(np.full(n, 3.0), np.zeros(n), np.zeros(n), 1)


@pytest.fixture
def step_runner(smollm2_dir):
    from transformers import AutoTokenizer

    from parse_vllm.config import ParseConfig
    from parse_vllm.controller import ParseController

    runner = type("Runner", (ParseRunnerMixin, _StepRunner), {})()
    runner.parse = ParseController.create(
        ParseConfig(threshold=0.5),
        window=16,
        tokenizer=AutoTokenizer.from_pretrained(smollm2_dir),
        vocab_size=VOCAB,
        layer_names=["l0"],
        served_model_name="stand-in",
    )
    runner.parse.verifier = _PassingVerifier()
    return runner


def test_one_step_translated_from_vllms_batch_and_back(step_runner):
    """_update_states reads the batch once; _sample judges "a"'s draft (the rejection
    sampler took none of it: its 11 is the token it sampled), takes it whole and samples one target token after it,
    writing both into vLLM's output on the device and the step's host copy; "b" (PARSE
    off) keeps the rejection sampler's token. The drafts reach the scheduler on the step's
    report, cut to their lengths and first stop token; vLLM's own channel stays empty."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    runner, p = step_runner, step_runner.parse
    runner._update_states(SimpleNamespace(num_scheduled_tokens={"a": 5, "b": 1}, finished_req_ids=set(),
                                          scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
                                          preempted_req_ids=set(), scheduled_new_reqs=[]))  # fmt: skip
    view = p.step.batch
    assert view.req_ids == ["a", "b"] and view.num_tokens.tolist() == [20, 8] and view.output_len.tolist() == [6, 2]
    assert p.judging("a") and not p.judging("b")
    md = SpecDecodeMetadata.make_dummy([A_DRAFT, []], device=torch.device("cpu"))
    logits = torch.zeros(6, VOCAB)
    out = runner._sample(logits, md)
    assert out.sampled_token_ids.tolist() == [[11, 12, 13, 14, 99], [5, -1, -1, -1, -1]]
    assert p.step.sampled.tolist() == out.sampled_token_ids.tolist()
    st = p.stats
    assert (st.drafts, st.tokens_accepted_semantic, st.tokens_accepted_token_level, st.copies) == (1, 4, 0, 1)

    p.step.drafted, p.step.draft_lens = True, {"a": 4, "b": 2}
    report = _vllm_report(runner.sample_tokens())
    assert report.drafts == {"a": [21, 22, 2], "b": [31, 32]}  # 2 ends "a" (a stop token of its)
    assert runner.take_draft_token_ids() is None


def _vllm_report(output):
    from parse_vllm import _vllm

    return _vllm.step_report(output)


def test_a_streaming_sessions_next_turn_starts_a_new_request_state(step_runner):
    """A session's next turn comes back as a new request under its old id, with new
    sampling parameters and no output: its PARSE state (options, phase, draft KV) is made
    anew, not carried over."""
    from parse_vllm.policy import Phase

    runner, p = step_runner, step_runner.parse
    out = SimpleNamespace(
        num_scheduled_tokens={"a": 5, "b": 1},
        finished_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
        preempted_req_ids=set(),
        scheduled_new_reqs=[],
    )
    runner._update_states(out)
    p.states["a"].phase, p.states["a"].draft_kv_len = Phase.CONTINUE, 19
    runner._update_states(out)
    assert p.states["a"].phase is Phase.CONTINUE  # the same request, next step
    runner._update_states(SimpleNamespace(**{**out.__dict__, "scheduled_new_reqs": [SimpleNamespace(req_id="a")]}))
    assert p.states["a"].phase is Phase.DRAFT and p.states["a"].draft_kv_len == 0


def test_a_drafter_over_the_whole_batch_drafts_as_far_as_some_request_needs(step_runner, monkeypatch):
    """A drafter that cannot run over chosen rows (vLLM's own proposer, every row): the
    runner schedules the longest draft some row wants, capped at W, and records each row's
    length for the report; once no request drafts again (spec_tokens 0, every request past
    its draft) it is skipped -- unless prefix caching is on, when a skipped step's blocks
    would hold no draft KV for a later request that hits them."""
    import dataclasses

    from parse_vllm.policy import Phase

    runner, p = step_runner, step_runner.parse
    runner._rows_drafting_unsupported = "a stand-in drafter"
    runner.cache_config = SimpleNamespace(enable_prefix_caching=False)
    proposed = []
    monkeypatch.setattr(
        _StepRunner,
        "propose_draft_token_ids",
        lambda self, so, *a, **k: proposed.append(so.num_spec_tokens_to_schedule),
        raising=False,
    )
    runner._update_states(SimpleNamespace(num_scheduled_tokens={"a": 5, "b": 1}, finished_req_ids=set(),
                                          scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
                                          preempted_req_ids=set(), scheduled_new_reqs=[]))  # fmt: skip
    so = SimpleNamespace()
    runner.propose_draft_token_ids(so)
    assert proposed == [16] and p.step.drafted  # "a" drafts a window of W = 16; "b" (PARSE off) nothing
    assert p.step.draft_lens == {"a": 16, "b": 0}

    p.config = dataclasses.replace(p.config, spec_tokens=0)
    p.states["a"].phase = Phase.CONTINUE  # rejected: the target writes the rest
    assert runner.propose_draft_token_ids(so) == [[], []] and proposed == [16]
    runner.cache_config.enable_prefix_caching = True
    runner.propose_draft_token_ids(so)
    assert proposed == [16, 1]
