"""A second, token-level proposer beside the draft model (parse.token_proposer).

vLLM builds one proposer per engine from its speculative_config
(vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__, `self.drafter`);
PARSE's is the draft model that writes windows. A token-level proposer named
in `parse.token_proposer` is a second vLLM proposer, built here from a
vllm.config.SpeculativeConfig of its own (the same class vLLM builds from
`--speculative-config`, vllm.engine.arg_utils.EngineArgs.create_speculative_config),
on a shallow copy of the engine's VllmConfig that differs only in it (and
has no PARSE section: the proposer rebuilds its copy through VllmConfig's
validation, where the platform would arrange a PARSE engine again):

  eagle3  vllm.v1.spec_decode.eagle.EagleProposer. Its head's attention
          layers register in the engine's static forward context when loaded
          (SpecDecodeBaseProposer.load_model), so the KV-cache spec and
          allocation include them as they include the draft model's; its
          metadata builders are made in the runner's
          GPUModelRunner.initialize_metadata_builders (as vLLM does for its
          drafter in GPUModelRunner.initialize_attn_backend). The target
          returns its auxiliary hidden states (SupportsEagle3
          .set_aux_hidden_state_layers, the runner's
          `use_aux_hidden_state_outputs`, as _setup_eagle3_aux_hidden_state_outputs
          does). Each step it runs as vLLM's own EAGLE branch of
          GPUModelRunner.propose_draft_token_ids (padded batch).
  ngram   vllm.v1.spec_decode.ngram_proposer.NgramProposer over the
          requests' tokens on the host (no model, no KV).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from .drafting import proposer_call


def token_proposer_config(vllm_config, options: dict, num_tokens: int):
    """vllm.config.SpeculativeConfig for `parse.token_proposer` (`options`,
    its method and model or n-gram settings), proposing `num_tokens` tokens."""
    from vllm.config import SpeculativeConfig

    return SpeculativeConfig(
        **options,
        num_speculative_tokens=num_tokens,
        target_model_config=vllm_config.model_config,
        target_parallel_config=vllm_config.parallel_config,
    )


def token_proposer_unsupported(spec) -> str | None:
    """Why a token proposer's SpeculativeConfig cannot run beside PARSE (None:
    it can). Its drafts reach vLLM's rejection sampler as greedy proposals
    (no draft probabilities), through the padded batch, one token per step."""
    if spec.draft_sample_method != "greedy":
        return f"draft_sample_method={spec.draft_sample_method!r} (only 'greedy')"
    if spec.rejection_sample_method != "standard":
        return f"rejection_sample_method={spec.rejection_sample_method!r} (only 'standard': lossless)"
    if spec.parallel_drafting:
        return "parallel_drafting"
    if spec.disable_padded_drafter_batch:
        return "disable_padded_drafter_batch"
    return None


class TokenProposer:
    """The second proposer: built and loaded with the runner's model
    (`load`), given its KV-cache metadata builders (`initialize`), then run
    once per step (`propose`)."""

    def __init__(self, runner, options: dict, num_tokens: int):
        self.method = options["method"]
        self.num_tokens = num_tokens  # k: tokens proposed per request and step
        config = copy.copy(runner.vllm_config)
        config.speculative_config = token_proposer_config(runner.vllm_config, options, num_tokens)
        # Without the PARSE section: the proposer re-validates its copy
        # (vllm.config.utils.replace), which is not PARSE's engine.
        extra = dict(config.additional_config or {})
        extra.pop("parse", None)
        config.additional_config = extra
        if self.method == "eagle3":
            from vllm.v1.spec_decode.eagle import EagleProposer

            self.proposer = EagleProposer(config, runner.device, runner)
        else:
            from vllm.v1.spec_decode.ngram_proposer import NgramProposer

            self.proposer = NgramProposer(config)
        self.config = config

    @property
    def keeps_kv(self) -> bool:
        """EAGLE-3's head keeps KV of every token, so it runs every step; the
        n-gram proposer keeps nothing and reads the host's tokens."""
        return self.method == "eagle3"

    def load(self, runner) -> None:
        """Load the head beside the target (it shares the target's embedding
        where its checkpoint has none) and make the target return the
        hidden states it reads."""
        self.proposer.load_model(runner.model)
        if self.method != "eagle3":
            return
        hf = self.config.speculative_config.draft_model_config.hf_config
        layers = getattr(hf, "eagle_aux_hidden_state_layer_ids", None)
        if not layers:
            layers = runner.model.get_eagle3_default_aux_hidden_state_layers()
        runner.model.set_aux_hidden_state_layers(tuple(layers))
        runner.use_aux_hidden_state_outputs = True
        self.aux_layers = tuple(int(x) for x in layers)

    def initialize(self, kv_cache_config, kernel_block_sizes) -> None:
        if self.method == "eagle3":
            self.proposer.initialize_attn_backend(kv_cache_config, kernel_block_sizes)

    def propose(self, runner, args: tuple, kwargs: dict, new_tokens, committed) -> tuple[torch.Tensor, np.ndarray]:
        """(proposed tokens [B, k] on the device, their number per request
        [B]) for every request of the batch; `args`, `kwargs` are the
        runner's propose_draft_token_ids arguments after scheduler_output.
        Runs last in a step: EAGLE's draft steps advance the step's attention
        metadata in place. The n-gram proposer reads `new_tokens`, the rows'
        tokens of this step (accepted draft tokens, then the sampled one),
        and `committed` [B], the rows' token counts before it, on the host."""
        if self.method == "ngram":
            return self._propose_ngram(runner, new_tokens, committed)
        drafts = self._propose_eagle(runner, proposer_call(args, kwargs))
        return drafts, np.full(drafts.shape[0], self.num_tokens, dtype=np.int64)

    def _propose_eagle(self, runner, a: dict) -> torch.Tensor:
        # As GPUModelRunner.propose_draft_token_ids's EAGLE branch, padded batch.
        p = self.proposer
        sampled = a["sampled_token_ids"]  # [B, W+1], -1 after each row's tokens
        md, cm, aux = a["spec_decode_metadata"], a["common_attn_metadata"], a["aux_hidden_states"]
        next_token_ids, valid_count = p.prepare_next_token_ids_padded(
            sampled, runner.requests, runner.input_batch, runner.discard_request_mask.gpu
        )
        token_indices_to_sample = num_rejected = None  # (no drafts this step: each row's last token)
        if md is not None:
            cm, token_indices_to_sample, num_rejected = p.prepare_inputs_padded(cm, md, valid_count)
        n = int(cm.num_actual_tokens)
        return p.propose(
            num_speculative_tokens=self.num_tokens,
            target_token_ids=runner.input_ids.gpu[:n],
            target_positions=runner._get_positions(n),
            target_hidden_states=torch.cat([h[:n] for h in aux], dim=-1),
            next_token_ids=next_token_ids,
            token_indices_to_sample=token_indices_to_sample,
            sampling_metadata=a["sampling_metadata"],
            common_attn_metadata=cm,
            num_rejected_tokens_gpu=num_rejected,
            slot_mappings=a["slot_mappings"],
        )

    def _propose_ngram(self, runner, new_tokens: list[np.ndarray], committed) -> tuple[torch.Tensor, np.ndarray]:
        # NgramProposer reads each row's tokens from the input batch, which
        # gets this step's tokens in bookkeeping, after drafting: they are
        # written here first (the same values bookkeeping writes).
        batch = runner.input_batch
        tokens = batch.token_ids_cpu
        lens = np.asarray(committed, dtype=np.int64).copy()
        for i, new in enumerate(new_tokens):
            end = min(int(lens[i]) + new.shape[0], tokens.shape[1])
            tokens[i, lens[i] : end] = new[: end - lens[i]]
            lens[i] = end
        rows = self.proposer.propose(
            self.num_tokens, [t.tolist() for t in new_tokens], lens, tokens, None
        )  # B x [<= k]
        out = torch.zeros((len(rows), self.num_tokens), dtype=torch.int64)
        lens = np.zeros(len(rows), dtype=np.int64)
        for i, r in enumerate(rows):
            lens[i] = min(len(r), self.num_tokens)
            out[i, : lens[i]] = torch.as_tensor(r[: lens[i]], dtype=torch.int64)
        return out.to(runner.device), lens
