"""The token sampled after a semantically accepted prefix (the runner's
`_resample` through `_vllm.sample_after_prefixes`), with vLLM's own Sampler:
penalties count the request's output plus the accepted prefix only, never
the rejected tail of the scheduled draft; and only the resampled rows'
seeded generators advance."""

import pytest
import torch

V = 16


def metadata(B, *, presence=0.0, random=False, generators=None, spec=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.ones(B) if random else None,
        all_greedy=not random,
        all_random=random,
        top_p=None,
        top_k=None,
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=presence == 0.0,
        prompt_token_ids=torch.full((B, 1), V, dtype=torch.int64),  # padding only
        frequency_penalties=torch.zeros(B),
        presence_penalties=torch.full((B,), presence),
        repetition_penalties=torch.ones(B),
        output_token_ids=[[1] for _ in range(B)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        spec_token_ids=spec,  # what vLLM scheduled this step: the whole draft
    )


@pytest.fixture(scope="module")
def sampler():
    from vllm.v1.sample.sampler import Sampler

    return Sampler()


def test_penalties_count_the_accepted_prefix_not_the_rejected_tail(sampler):
    from parse_vllm import _vllm

    logits = torch.zeros(2, V)
    logits[:, 5] = 1.0  # the target's choice, unless penalised
    # Both requests were scheduled the draft [6, 5, 7]; each accepted [6].
    md = metadata(2, presence=2.0, spec=[[6, 5, 7], [6, 5, 7]])
    out = _vllm.sample_after_prefixes(sampler, logits.clone(), md, {0: [6], 1: [6]})
    assert out.tolist() == [5, 5]  # 5 sits in the rejected tail: not penalised
    out = _vllm.sample_after_prefixes(sampler, logits.clone(), md, {0: [6, 5], 1: [6]})
    assert out[0] != 5 and out[1] == 5  # in row 0's accepted prefix: penalised


def test_only_resampled_rows_generators_advance(sampler):
    from parse_vllm import _vllm

    gens = {i: torch.Generator().manual_seed(100 + i) for i in range(3)}
    before = {i: g.get_state().clone() for i, g in gens.items()}
    md = metadata(3, random=True, generators=gens, spec=[[2, 3]] * 3)
    _vllm.sample_after_prefixes(sampler, torch.randn(3, V), md, {1: [2]})
    assert torch.equal(gens[0].get_state(), before[0]) and torch.equal(gens[2].get_state(), before[2])
    assert not torch.equal(gens[1].get_state(), before[1])
