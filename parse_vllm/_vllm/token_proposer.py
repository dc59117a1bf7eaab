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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


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


def eagle3_aux_layers(spec) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head's config names (None: it names none), read as vLLM
    reads them for its own drafter (GPUModelRunner._get_eagle3_aux_layers_from_config, which
    only looks at `speculative_config`)."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))


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


@dataclass
class ProposerStep:
    """What the token proposer reads in a step (`proposer_step` builds it): the runner's
    propose_draft_token_ids call (`proposer_call`); the rows' tokens of the step on the
    host (accepted draft tokens, then the sampled one; none for a row still in prefill)
    and their counts before it; EAGLE-3's input (`target_hidden_states`, taken first); the
    step's staged host-to-device copy; and of the runner, the inputs vLLM's own EAGLE
    branch reads (GPUModelRunner.requests, input_batch, discard_request_mask, input_ids,
    _get_positions)."""

    call: dict
    new_tokens: list[np.ndarray]  # [B]
    committed: np.ndarray  # [B]
    target_hidden: torch.Tensor | None  # [num_tokens, k * hidden]
    to_device: Callable
    requests: dict
    input_batch: object
    discard_mask: torch.Tensor  # [max_reqs] on the device
    input_ids: torch.Tensor  # [max_tokens] on the device
    positions: Callable[[int], torch.Tensor]


def proposer_step(runner, call: dict, new_tokens, committed, target_hidden, to_device) -> ProposerStep:
    return ProposerStep(
        call=call,
        new_tokens=new_tokens,
        committed=committed,
        target_hidden=target_hidden,
        to_device=to_device,
        requests=runner.requests,
        input_batch=runner.input_batch,
        discard_mask=runner.discard_request_mask.gpu,
        input_ids=runner.input_ids.gpu,
        positions=runner._get_positions,
    )


class TokenProposer:
    """The second proposer: built and loaded with the runner's model
    (`load`), given its KV-cache metadata builders (`initialize`), then run
    once per step (`propose`)."""

    def __init__(self, runner, options: dict, num_tokens: int):
        self.method = options["method"]
        self.num_tokens = num_tokens  # k: tokens proposed per request and step
        self.dummy_runs = 0  # the head's warm-up, profiling and capture runs (dummy_run)
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

    @classmethod
    def attach(cls, runner, options: dict, num_tokens: int) -> TokenProposer:
        """Built and loaded beside the runner's model."""
        tp = cls(runner, options, num_tokens)
        tp.load(runner)
        return tp

    @property
    def keeps_kv(self) -> bool:
        """EAGLE-3's head keeps KV of every token, so it runs every step; the
        n-gram proposer keeps nothing and reads the host's tokens."""
        return self.method == "eagle3"

    def load(self, runner) -> None:
        """Load the head beside the target (it shares the target's embedding
        where its checkpoint has none) and make the target return the
        hidden states it reads: the layers vLLM itself would pick for it
        (GPUModelRunner._get_eagle3_aux_layers_from_config: the head's
        eagle_aux_hidden_state_layer_ids, top level or in eagle_config, else the
        target's defaults), or none for a head that reads the last hidden state
        (eagle_config.use_aux_hidden_state false,
        SpecDecodeBaseProposer.eagle3_use_aux_hidden_state)."""
        self.proposer.load_model(runner.model)
        self.aux_layers: tuple[int, ...] = ()
        if self.method != "eagle3" or not self.proposer.eagle3_use_aux_hidden_state:
            return
        from vllm.model_executor.models.interfaces import supports_eagle3

        if not supports_eagle3(runner.get_model()):
            raise ValueError(
                f"the target ({type(runner.get_model()).__name__}) does not return the hidden states an EAGLE-3 "
                "head reads (vLLM's SupportsEagle3): use another token_proposer"
            )
        layers = eagle3_aux_layers(self.config.speculative_config)
        if not layers:
            layers = runner.model.get_eagle3_default_aux_hidden_state_layers()
        runner.model.set_aux_hidden_state_layers(tuple(layers))
        runner.use_aux_hidden_state_outputs = True
        self.aux_layers = tuple(int(x) for x in layers)

    def target_hidden_states(self, a: dict) -> torch.Tensor | None:
        """The target's hidden states EAGLE-3 reads for the step's tokens
        [num_tokens, k * hidden] (its auxiliary layers, concatenated), from a
        propose_draft_token_ids call's arguments (`proposer_call`); None for n-gram.
        Built before anything else runs in the step: on a GPU the target's
        outputs are weak references into the CUDA-graph pool that every graph
        shares, so a later replay (the draft model's) may overwrite them (vLLM's
        own EAGLE branch of GPUModelRunner.propose_draft_token_ids concatenates
        them before its drafter runs, too)."""
        if self.method != "eagle3":
            return None
        n = int(a["common_attn_metadata"].query_start_loc_cpu[-1])
        if self.aux_layers:
            return torch.cat([h[:n] for h in a["aux_hidden_states"]], dim=-1)
        return a["hidden_states"][:n].clone()

    def initialize(self, kv_cache_config, kernel_block_sizes) -> None:
        if self.method == "eagle3":
            self.proposer.initialize_attn_backend(kv_cache_config, kernel_block_sizes)

    # vLLM wires only its own drafter (`runner.drafter`) into CUDA graphs, warm-up and memory
    # profiling; the runner calls these beside it for the head.

    def initialize_cudagraph_keys(self, cudagraph_mode) -> None:
        """As GPUModelRunner._check_and_update_cudagraph_mode does for its drafter, with the
        engine's resolved mode (the head runs PIECEWISE graphs where the target may)."""
        if self.method == "eagle3":
            self.proposer.initialize_cudagraph_keys(cudagraph_mode)

    def dummy_run(self, num_tokens: int, cudagraph_runtime_mode, is_graph_capturing: bool) -> None:
        """The head's share of a GPUModelRunner._dummy_run (warm-up, torch.compile, memory
        profiling, CUDA-graph capture), as that method runs its drafter: graphs only for
        PIECEWISE capture and replays, never with the head's enforce_eager; while capturing,
        the head's own slot-mapping buffer (SpecDecodeBaseProposer.dummy_run takes it when
        its layers are named in `slot_mappings`)."""
        if self.method != "eagle3":
            return
        from vllm.config import CUDAGraphMode

        mode = CUDAGraphMode.NONE if cudagraph_runtime_mode is None else cudagraph_runtime_mode
        use_cudagraphs = (
            (is_graph_capturing and mode == CUDAGraphMode.PIECEWISE)
            or (not is_graph_capturing and mode != CUDAGraphMode.NONE)
        ) and not self.config.speculative_config.enforce_eager
        p = self.proposer
        self.proposer.dummy_run(
            num_tokens,
            use_cudagraphs=use_cudagraphs,
            is_graph_capturing=is_graph_capturing,
            slot_mappings=dict.fromkeys(p._draft_attn_layer_names) if is_graph_capturing else None,
        )
        self.dummy_runs += 1

    def propose(self, step: ProposerStep) -> tuple[torch.Tensor, np.ndarray]:
        """(proposed tokens [B, k] on the device, their number per request [B]) for every
        request of the batch. Runs last in a step: EAGLE's draft steps advance the step's
        attention metadata in place."""
        if self.method == "ngram":
            return self._propose_ngram(step)
        drafts = self._propose_eagle(step)
        return drafts, np.full(drafts.shape[0], self.num_tokens, dtype=np.int64)

    def _propose_eagle(self, step: ProposerStep) -> torch.Tensor:
        # As GPUModelRunner.propose_draft_token_ids's EAGLE branch, padded batch.
        p, a = self.proposer, step.call
        sampled = a["sampled_token_ids"]  # [B, W+1], -1 after each row's tokens
        md, cm = a["spec_decode_metadata"], a["common_attn_metadata"]
        next_token_ids, valid_count = p.prepare_next_token_ids_padded(
            sampled, step.requests, step.input_batch, step.discard_mask
        )
        token_indices_to_sample = num_rejected = None  # (no drafts this step: each row's last token)
        if md is not None:
            cm, token_indices_to_sample, num_rejected = p.prepare_inputs_padded(cm, md, valid_count)
        n = int(cm.num_actual_tokens)
        return p.propose(
            num_speculative_tokens=self.num_tokens,
            target_token_ids=step.input_ids[:n],
            target_positions=step.positions(n),
            target_hidden_states=step.target_hidden[:n],
            next_token_ids=next_token_ids,
            token_indices_to_sample=token_indices_to_sample,
            sampling_metadata=a["sampling_metadata"],
            common_attn_metadata=cm,
            num_rejected_tokens_gpu=num_rejected,
            slot_mappings=a["slot_mappings"],
        )

    def _propose_ngram(self, step: ProposerStep) -> tuple[torch.Tensor, np.ndarray]:
        # NgramProposer reads each row's tokens from the input batch, which
        # gets this step's tokens in bookkeeping, after drafting: they are
        # written here first (the same values bookkeeping writes).
        new_tokens = step.new_tokens
        tokens = step.input_batch.token_ids_cpu
        lens = np.asarray(step.committed, dtype=np.int64).copy()
        for i, new in enumerate(new_tokens):
            end = min(int(lens[i]) + new.shape[0], tokens.shape[1])
            tokens[i, lens[i] : end] = new[: end - lens[i]]
            lens[i] = end
        rows = self.proposer.propose(
            self.num_tokens, [t.tolist() for t in new_tokens], lens, tokens, None
        )  # B x [<= k]
        out = np.zeros((len(rows), self.num_tokens), dtype=np.int64)
        lens = np.zeros(len(rows), dtype=np.int64)
        for i, r in enumerate(rows):
            lens[i] = min(len(r), self.num_tokens)
            out[i, : lens[i]] = r[: lens[i]]
        return step.to_device(out)[0], lens


def dummy_run_arguments(num_tokens: int, args: tuple, kwargs: dict) -> tuple:
    """(cudagraph_runtime_mode, is_graph_capturing) of a GPUModelRunner._dummy_run call
    (the CPU runner's is the same method)."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bound = inspect.signature(GPUModelRunner._dummy_run).bind(None, num_tokens, *args, **kwargs)
    return bound.arguments.get("cudagraph_runtime_mode"), bool(bound.arguments.get("is_graph_capturing", False))
