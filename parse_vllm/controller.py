"""Per-engine PARSE state, and the only writer of it.

What the model runner holds, as one object: the configuration and what follows from it
(window, boundary rule, template, verifier, judge head), each request's state
(`policy.RequestState`) and open window (`windows.OpenWindow`), the counters and their
Prometheus export, the recorded judgments and the KV audit. The runner reports what vLLM
did through a few transitions, in step order, and reads back what to do:

  begin_step(batch, finished, resumed, preempted)   a step's batch is known: requests
                    come and go, preempted ones lose their draft KV and windows; a new
                    StepScratch (`self.step`)
  row_states()      what each batch row drafts (drafting.RowStates)
  drafted(rows, kv_len, chunks)   the drafter ran: draft KV, windows advanced, the drafts'
                    lengths
  judge(...)        one verification call (the step's judge)
  sampled(...)      the step's outcome: counters and phase changes

No vLLM object: the runner passes plain values.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from parse_vllm import proposers
from parse_vllm.acceptance import cut_at_stop
from parse_vllm.boundaries import BoundaryRule, sentence_end_mask
from parse_vllm.clock import SpanClock
from parse_vllm.config import ParseConfig, ParseConfigError, RequestOptions, request_options
from parse_vllm.drafting import DraftRows, RowStates
from parse_vllm.metrics import KvAudit, ParseStats, PromExporter, RequestCounts
from parse_vllm.policy import Phase, RequestState
from parse_vllm.step import DraftBatch, StepResult, StepSettings, judged_drafts
from parse_vllm.templates import VerificationTemplate, build_template
from parse_vllm.transfers import HostCopies
from parse_vllm.verify import CopyBatch, Verifier
from parse_vllm.window_policy import FEATURES as WINDOW_COST_FEATURES
from parse_vllm.window_policy import RequestPolicy, WindowPolicy
from parse_vllm.windows import OpenWindow, StepReport, advance_windows

FINISHED_KEPT = 4096  # finished requests whose counters parse_vllm.get_request_stats still reads


@dataclass
class JudgedRequests:
    """Who a step's DraftBatch rows are, gathered once by the runner."""

    req_ids: list[str]  # [R]
    context: list[np.ndarray]  # [R] each request's tokens before its draft (only when judgments are recorded)


@dataclass
class StepScratch:
    """One engine step's PARSE values, shared by the hooks that run in it."""

    batch: object  # _vllm.BatchView of the step
    report: StepReport  # for the scheduler, on the step's output
    drafted: bool = False  # the drafter ran (vLLM skips it in some steps)
    sampled: np.ndarray | None = None  # [B, W+1] the step's tokens on the host, once fetched
    draft_lens: dict[str, int] = field(default_factory=dict)  # each batch row's draft length


@dataclass
class ParseController:
    config: ParseConfig
    window: int  # W = num_speculative_tokens
    rule: BoundaryRule
    sentence_end: np.ndarray  # [vocab] bool
    template: VerificationTemplate
    layer_names: list[str]
    served_model_name: str
    device: str = "cpu"  # the model's
    token_proposer: str | None = None  # parse.token_proposer's method
    verifier: Verifier | None = None  # set once the KV cache exists
    read_out: object | None = None  # the judge head on the device (judge_head.ReadOut); None: zero-shot

    def __post_init__(self) -> None:
        # every copy between host and device of a step, counted
        self.host = HostCopies(self.device, watch_pageable=self.config.audit_transfers)
        self.states: dict[str, RequestState] = {}
        # the counters of the last FINISHED_KEPT finished requests, by request id
        self.finished: collections.OrderedDict[str, RequestCounts] = collections.OrderedDict()
        self.windows: dict[str, OpenWindow] = {}  # windows drafted over several steps, by request
        self.step: StepScratch | None = None
        self.policy: WindowPolicy | None = None  # on_reject adaptive
        if self.config.on_reject == "adaptive":
            copies = 1 if self.config.two_stage else self.config.max_boundaries
            self.policy = WindowPolicy(
                self.window,
                self.config.spec_tokens,
                self.config.draft_chunk,
                copies * self.template.suffix_len,
                step_costs=self.config.adaptive_step_costs,
                judge_chunks=self.config.judge_chunks,
                token_drafts_counted=self.token_proposer is None,
            )
        self._step_x = np.zeros(len(WINDOW_COST_FEATURES))  # what the step ran (window_policy.FEATURES)
        # the drafter's time in a step (the runner's spans), for the window policy's cost model
        self.drafter_clock = SpanClock(self.device, enabled=self.policy is not None)
        self._step_start: float | None = None
        self._rows = 0  # requests in the step being timed
        self.stats = ParseStats()
        self._exported = ParseStats()
        self._prom = PromExporter({"model_name": self.served_model_name})
        self.judgments: collections.deque = collections.deque(maxlen=max(1, self.config.record_judgments))
        self.kv_audit: KvAudit | None = KvAudit() if self.config.audit_kv_blocks else None

    @classmethod
    def create(cls, config: ParseConfig, *, window: int, tokenizer, vocab_size: int, **engine) -> ParseController:
        """The engine's controller from its PARSE configuration and the target's tokenizer:
        the verification template, the sentence ends the boundaries and rewrites read, the
        boundary rule. `engine`: layer_names, served_model_name, device."""
        template = build_template(tokenizer, config)
        sentence_end = sentence_end_mask(tokenizer, vocab_size)
        return cls(
            config=config,
            window=window,
            rule=BoundaryRule(config.boundaries, config.every, config.max_boundaries, sentence_end),
            sentence_end=sentence_end,
            template=template,
            token_proposer=(config.token_proposer or {}).get("method"),
            **engine,
        )

    def load_judge_head(self, target_shape: dict, lm_head_columns) -> None:
        """The judge head (parse.judge_head) on the device, once it is known to fit the
        target (`target_shape`: _vllm.target_shape) and its weights (`lm_head_columns(ids,
        n)`: the LM head's first n columns of the rows `ids`); process 0 checked the rest."""
        from parse_vllm.judge_head import FINGERPRINT_DIMS, ReadOut, engine_identity, load_for_engine

        identity = engine_identity(**target_shape, template=self.template, config=self.config)
        head = load_for_engine(self.config.judge_head, identity)
        why = head.fingerprint_mismatch(lm_head_columns([ids[0] for ids in identity.label_ids], FINGERPRINT_DIMS))
        if why is not None:
            raise ParseConfigError(f"parse.judge_head={self.config.judge_head!r}: {why}")
        self.read_out = ReadOut(head, self.device)

    @property
    def reads_evidence(self) -> bool:
        """The judge head reads the cheap evidence of the step's logits (evidence.py)."""
        return self.read_out is not None and bool(getattr(self.read_out, "reads_evidence", False))

    def copy_evidence(self, copies: CopyBatch, batch: DraftBatch) -> np.ndarray:
        """[C, 4] the evidence features (evidence.EVIDENCE_FEATURES) of each copy's judged
        prefix draft[:b], from the per-token values fetched with the step's inputs."""
        from parse_vllm.evidence import EVIDENCE_FEATURES, prefix_features

        if batch.evidence is None:
            raise RuntimeError("the judge head reads evidence but the step fetched none")
        k_of = {int(r): k for k, r in enumerate(batch.row)}
        out = np.zeros((int(copies.req_row.shape[0]), len(EVIDENCE_FEATURES)))
        ks = np.array([k_of[int(r)] for r in copies.req_row], dtype=np.int64)
        b = copies.prefix_len - batch.cached_len[ks]
        for k in np.unique(ks):
            m = ks == k
            out[m] = prefix_features(batch.evidence[0, k], batch.evidence[1, k], b[m])
        return out

    def describe(self) -> str:
        """The engine's PARSE settings, one line for the log."""
        c, t = self.config, self.template
        return (
            f"window W={self.window}, τ={c.threshold:.3g}, guard={c.guard}, boundaries={c.boundaries}, "
            f"max K={c.max_boundaries}, suffix {t.suffix_len} tokens {t.suffix_text!r}, labels {c.labels[0]!r}/"
            f"{c.labels[1]!r} (ids {t.labels.yes_ids}/{t.labels.no_ids}), on_reject={c.on_reject}, "
            f"judge={c.judge_head or 'zero-shot'}, token-level drafts by {proposers.writer(self.token_proposer)}"
        )

    def count_drafter(self, run) -> None:
        """A step's drafter calls (drafting.PassesRun): counters, and the step's cost."""
        self.stats.drafter_passes += run.calls
        self.stats.drafter_rows += run.call_rows
        self.stats.drafter_tokens += run.call_tokens
        self.host.count_drafter_calls(run.calls)
        self._step_x[3] += run.forwards
        self._step_x[4] += run.call_tokens + run.drafted
        self._step_x[7] += run.calls

    # -- transitions ------------------------------------------------------------

    def begin_step(
        self,
        batch,
        finished: set[str],
        resumed: set[str],
        preempted: set[str],
        new: set[str] = frozenset(),
        now: float | None = None,
    ) -> StepScratch:
        """A step's batch (`_vllm.BatchView`) is known: finished requests are forgotten, new
        ones get their state; a request preempted or resumed lost its blocks (its draft
        KV, and any window being drafted: it drafts again), and a window whose request is
        scheduled again is dropped too."""
        for req_id in finished | (new & self.states.keys()):  # (a known id new again: a session's next turn)
            if (state := self.states.pop(req_id, None)) is not None:
                self.finished[req_id] = state.counts
                if len(self.finished) > FINISHED_KEPT:
                    self.finished.popitem(last=False)
            self.windows.pop(req_id, None)
        for req_id in resumed & self.states.keys():
            self.states[req_id].draft_kv_len = self.states[req_id].draft_ahead = 0
        # (a window out for judgment is in the batch to be judged)
        scheduled = {r for r in batch.req_ids if r in self.windows and not self.windows[r].judging}
        for req_id in resumed | preempted | scheduled:
            if self.windows.pop(req_id, None) is not None:
                self.states[req_id].draft_kv_len = self.states[req_id].draft_ahead = 0
                self.stats.windows_dropped += 1
        for i, req_id in enumerate(batch.req_ids):
            if req_id not in self.states:
                state = RequestState(self.options(batch.extra_args[i], bool(batch.wants_logprobs[i])))
                if self.policy is not None and state.judging:
                    state.adaptive = RequestPolicy(key=(round(state.options.threshold, 4), state.options.guard))
                self.states[req_id] = state
        self._time_step(batch, now)
        self.host.new_step()
        self.step = StepScratch(batch, StepReport(open=frozenset(self.windows)))
        return self.step

    def _time_step(self, batch, now: float | None) -> None:
        """The last step's time, with what it ran, to the window policy's cost model; this
        step's target work counted."""
        if self.policy is None or now is None:
            return
        drafter_seconds = self.drafter_clock.take()
        if self._step_start is not None:
            self.policy.step_done(
                now - self._step_start, self._step_x, rows=self._rows, drafter_seconds=drafter_seconds
            )
        scheduled = int(batch.num_scheduled.sum())
        self._step_x = np.zeros(len(WINDOW_COST_FEATURES))
        self._step_x[:3] = (1.0, float(scheduled > 0), scheduled)
        self._step_start, self._rows = now, batch.num_reqs

    def _decide_windows(self, view) -> None:
        """Adaptive requests with no move in flight get their next one from the policy: a
        window of some length, or the token-level arm for a while; those on the token-level
        arm draft the k the policy chooses for them together (the draft model's drafts
        only: a token proposer's cost is not timed apart)."""
        token_level = []
        for i, req_id in enumerate(view.req_ids):
            state = self.states[req_id]
            r = state.adaptive
            if r is None or state.arm_window or state.phase is not Phase.DRAFT:
                continue
            room = int(view.max_tokens[i] - view.output_len[i] - 1) if view.max_tokens[i] else self.window
            decision = self.policy.decide(r, room)
            state.counts.policy[decision.why] = state.counts.policy.get(decision.why, 0) + 1
            if decision.window:
                state.arm_window, state.arm_parts = decision.window, decision.parts
                self.stats.window_opened(decision.window)
                self.stats.policy_probes += int(decision.probe)
            else:
                self.stats.policy_token_level_steps += 1
                if not view.prefilling[i]:
                    token_level.append(state)
        if token_level and self.token_proposer is None:
            k = self.policy.choose_token_k([s.adaptive for s in token_level])
            for state in token_level:
                state.token_k = k
            self.stats.token_level_k_chosen(k)

    @property
    def drafting_windows(self) -> dict[str, OpenWindow]:
        """The open windows the drafter advances: all but those out for judgment."""
        return {r: w for r, w in self.windows.items() if not w.judging}

    def row_states(self) -> RowStates:
        """What each batch row of the step drafts, from its state (nothing where its window
        goes on after a judged part: the window's own row drafts)."""
        if self.policy is not None:
            self._decide_windows(self.step.batch)
        req_ids = self.step.batch.req_ids
        states = [self.states[r] for r in req_ids]
        return RowStates(
            wants=np.array(
                [0 if r in self.windows else s.draft_len(self.config, self.window) for r, s in zip(req_ids, states)],
                dtype=np.int64,
            ),
            judging=np.array([s.judging for s in states], dtype=bool),
            kv_len=np.array([s.draft_kv_len for s in states], dtype=np.int64),
            ahead=np.array([s.draft_ahead for s in states], dtype=np.int64),
        )

    def plan(self, keeps_kv: bool) -> tuple[RowStates, proposers.ProposerPlan]:
        """The drafter runs this step: its row states and who drafts for whom (proposers.py)."""
        self.step.drafted = True
        rows = self.row_states()
        who = proposers.plan(rows.wants, rows.judging, self.token_proposer, keeps_kv)
        return dataclasses.replace(rows, wants=who.draft_model_wants), who

    def drafted(self, rows: DraftRows | None, kv_len: np.ndarray | None, chunks: np.ndarray) -> np.ndarray:
        """The drafter ran over `rows` (None: not at all this step); `kv_len` [B + O] the
        rows' draft KV after it, `chunks` [len(rows.window_rows), n] on the host this step's
        drafts of the window rows. Advances the windows, sets the report's open windows and
        returns the batch rows' draft lengths [B] (0 for a window left open)."""
        states = [self.states[r] for r in self.step.batch.req_ids]
        if rows is None:
            for state in states:  # (the credit needs this step's tokens, which it did not read)
                state.draft_ahead = 0
            return np.zeros(len(states), dtype=np.int64)
        B = rows.num_batch
        for i, state in enumerate(states):
            state.draft_kv_len = int(kv_len[i])
            state.draft_ahead = max(0, int(rows.wants[i]) - 1)  # the KV of the draft tokens it is given
        lens, done = advance_windows(rows, chunks, self.windows, self._judgeable if self.config.judge_chunks else None)
        for r in rows.window_rows:
            self.stats.note_window_chunk(int(rows.wants[r]))
        for r in np.flatnonzero(lens < rows.wants[:B]):
            states[r].draft_ahead = 0  # its window is open: no draft this step
        for req_id, window in done.items():
            state = self.states[req_id]
            state.draft_kv_len, state.draft_ahead = window.start, len(window.draft) - 1
        self.step.report = StepReport(
            drafts={r: w.draft for r, w in done.items()}, open=frozenset(self.drafting_windows)
        )
        self.step.draft_lens = dict(zip(rows.req_ids[:B], lens.tolist()))
        return lens

    def _judgeable(self, req_id: str, window: OpenWindow) -> bool:
        """Chunked judging: the window's draft holds a boundary short of its end (and, under
        adaptive, the policy chose to judge this window in parts)."""
        state = self.states[req_id]
        if state.adaptive is not None and not state.arm_parts:
            return False
        draft = np.asarray(window.draft, dtype=np.int64)
        return self.rule.select(draft, offset=window.taken, holistic=False).shape[0] > 0

    def plan_whole_batch(self, prefix_caching: bool) -> int:
        """vLLM's own proposer drafts for the whole batch (a drafter that cannot run over
        chosen rows): the tokens it drafts for every row, 0 to skip it. It consumes the
        step's tokens to keep the draft KV in sync and cannot catch up later, so it is
        skipped only once no request here drafts again and no later request can hit this
        step's blocks in the prefix cache (they would hold no draft KV)."""
        states, _ = self.plan(keeps_kv=False)
        self.step.draft_lens = dict(zip(self.step.batch.req_ids, states.wants.tolist()))
        if self.config.spec_tokens == 0 and not self.will_draft() and not prefix_caching:
            return 0
        return max(1, min(int(states.wants.max(initial=0)), self.window))

    def token_proposed(self, who: proposers.ProposerPlan, lens: np.ndarray) -> None:
        """The token proposer drafted `lens` [B] tokens; its rows get them, up to what each wants."""
        for i in np.flatnonzero(who.token_level):
            self.step.draft_lens[self.step.batch.req_ids[i]] = min(int(lens[i]), int(who.wants[i]))

    def new_tokens(self, sampled) -> list[np.ndarray]:
        """Each row's tokens from this step (accepted draft tokens, then the sampled one)
        on the host: as `sampled()` recorded them, or fetched from the device tensor
        `sampled` [B, W+1] here (at most once a step)."""
        if self.step.sampled is None:
            (self.step.sampled,) = self.host.fetch(sampled)
        return [row[row >= 0] for row in self.step.sampled]

    def report_drafts(self, req_ids, drafts, live) -> None:
        """The batch rows' drafts as the drafter wrote them ([B] lists, vLLM's copy) onto the
        step's report, each cut to its length and its first stop token; `live`: the
        requests the runner still holds."""
        stops = dict(zip(self.step.batch.req_ids, self.step.batch.stops))
        for req_id, draft in zip(req_ids, drafts):
            n = self.step.draft_lens.get(req_id, 0)
            if n and req_id in live:
                self.step.report.drafts[req_id] = cut_at_stop(draft[:n], stops[req_id])

    def sampled(
        self, judged: JudgedRequests, batch: DraftBatch, result: StepResult | None, sampled: np.ndarray
    ) -> None:
        """The step's outcome: counters and phase changes of the judged requests, and the
        tokens the target wrote for requests it is rewriting (REWRITE phase: they count
        towards the next draft; a request judged this step starts counting from the next)."""
        if result is not None:
            self._apply(judged.req_ids, batch, result)
        done = set(judged.req_ids)
        view = self.step.batch
        for i, req_id in enumerate(view.req_ids):
            state = self.states.get(req_id)
            if req_id in done or state is None:
                continue
            tokens = sampled[i][sampled[i] >= 0]
            if state.phase is Phase.REWRITE:
                state.after_tokens(tokens.tolist(), self.sentence_end)
            elif state.adaptive is not None and not state.arm_window and tokens.shape[0]:
                # the token-level arm: its acceptance, and the back-off counted in tokens
                if k := len(view.spec_tokens[i]):
                    self.policy.token_level_verified(state.adaptive, k, int(tokens.shape[0]) - 1)
                self.policy.tokens_out(state.adaptive, int(tokens.shape[0]))
        self.step.sampled = sampled

    # -- requests ---------------------------------------------------------------

    def options(self, extra_args: dict | None, wants_logprobs: bool) -> RequestOptions:
        """A request's PARSE options from its extra_args (validated at admission; a bad
        one turns PARSE off for it)."""
        try:
            opts = request_options(extra_args, self.config)
        except ParseConfigError:
            opts = dataclasses.replace(request_options(None, self.config), enabled=False)
        if wants_logprobs:
            # Logprobs of semantically accepted tokens are not produced: such requests get
            # token-level speculation only.
            opts = dataclasses.replace(opts, enabled=False)
        return opts

    def draft_batch(self, num_draft, drafts, logits_start, logits, allowed_mask) -> tuple[DraftBatch, JudgedRequests]:
        """The DraftBatch of the requests this step judges, and who they are, from the step's
        scheduled drafts: `num_draft` [B], `drafts` [Σd] row after row, `logits_start` [B]
        the logits row of each row's last token, `logits` [N, vocab]; `allowed_mask` the
        sampler's [B, vocab] allowed-token mask, or None."""
        view = self.step.batch
        batch = judged_drafts(
            view,
            num_draft,
            drafts,
            logits_start,
            np.array([self.judging(r) for r in view.req_ids], dtype=bool),
            [self.states[r].options for r in view.req_ids],
            logits,
        )
        if allowed_mask is not None and batch.num_reqs:
            batch.forbidden = allowed_mask[self.host.to_device(batch.row)[0]]
        if self.config.judge_chunks:
            windows = [self.windows.get(view.req_ids[i]) for i in batch.row]
            batch.partial = np.array([w is not None and w.judging and not w.complete for w in windows], dtype=bool)
            batch.window_offset = np.array([w.taken if w is not None else 0 for w in windows], dtype=np.int64)
        return batch, self.judged_requests(batch)

    def judged_requests(self, batch: DraftBatch) -> JudgedRequests:
        """Who the step's DraftBatch rows are (and, when judgments are recorded, the tokens
        each had before its draft)."""
        view = self.step.batch
        context = []
        if self.config.record_judgments:
            context = [view.token_ids[i, :n].copy() for i, n in zip(batch.row, batch.cached_len)]
        return JudgedRequests(req_ids=[view.req_ids[i] for i in batch.row], context=context)

    def judging(self, req_id: str) -> bool:
        return self.states[req_id].judging

    def will_draft(self) -> bool:
        """Whether some request of the step drafts a window now or later (a drafter that
        runs over the whole batch must keep up with its tokens)."""
        return any(self.states[r].will_draft for r in self.step.batch.req_ids)

    # -- the step -------------------------------------------------------------

    def settings(self, vocab_size: int, max_model_len: int) -> StepSettings:
        return StepSettings(
            rule=self.rule,
            two_stage=self.config.two_stage,
            vocab_size=vocab_size,
            suffix_len=self.template.suffix_len,
            max_model_len=max_model_len,
        )

    def judge(self, copies: CopyBatch, batch: DraftBatch, judged: JudgedRequests) -> np.ndarray:
        """One verification call through the verifier over copies of `batch`'s
        drafts; the judgments' log-odds [C]. A recorded judgment names its copy's
        request, boundary and token ids (`judged`)."""
        j = self.verifier.judge(copies)
        n = int(copies.req_row.shape[0])
        logit, evidence = j.logit, None
        if self.reads_evidence and n:
            # the head's evidence term, on the host (judge_head.ReadOut.evidence_logit)
            evidence = self.copy_evidence(copies, batch)
            logit = logit + self.read_out.evidence_logit(evidence)
        self.stats.verification_passes += j.passes
        self.stats.copies += n
        self.stats.suffix_tokens += n * self.template.suffix_len
        self._step_x[5] += j.passes
        self._step_x[6] += n * self.template.suffix_len
        if self.config.record_judgments:
            k_of = {int(r): k for k, r in enumerate(batch.row)}
            for c in range(n):
                k = k_of[int(copies.req_row[c])]
                boundary = int(copies.prefix_len[c]) - int(batch.cached_len[k])
                self.judgments.append(
                    {
                        "req_id": judged.req_ids[k],
                        "boundary": boundary,
                        "token_ids": judged.context[k].tolist() + batch.draft_of(k)[:boundary].tolist(),
                        "p_yes": float(1.0 / (1.0 + np.exp(-logit[c]))),
                        "logit": float(logit[c]),
                        "evidence": None if evidence is None else evidence[c].tolist(),
                        "logprob_yes": float(j.logprob_yes[c]),
                        "logprob_no": float(j.logprob_no[c]),
                        "hidden": None if j.hidden is None else j.hidden[c],
                        "requests_kv_unchanged": j.requests_kv_unchanged,
                    }
                )
        return logit

    def count_token_level(self, num_draft: np.ndarray, judged_rows: np.ndarray, accepted: np.ndarray) -> None:
        """Drafts verified token by token only (not judged), [B] each, counted by the
        proposer that wrote them."""
        plain = num_draft > 0
        plain[judged_rows] = False
        req_ids = self.step.batch.req_ids
        for i in np.flatnonzero(plain):
            if (state := self.states.get(req_ids[i])) is not None:
                state.counts.token_level += int(accepted[i])
        if plain.any():
            self.stats.token_level(
                proposers.writer(self.token_proposer),
                int(plain.sum()),
                int(num_draft[plain].sum()),
                int(accepted[plain].sum()),
            )

    def _apply(self, req_ids: list[str], batch: DraftBatch, result: StepResult) -> None:
        stats = self.stats
        for k, req_id in enumerate(req_ids):
            text_len = int(result.text_len[k])
            state = self.states[req_id]
            window = self.windows.get(req_id)
            if result.commit[k]:
                self._commit(k, req_id, batch, result, window)
                continue
            taken_before = 0
            if window is not None and window.judging:  # the window's last judgment: it ends here
                taken_before = self.windows.pop(req_id).taken
                if self.policy is not None and text_len:
                    self.policy.part_judged(text_len)
            if state.adaptive is not None:
                # the window is done (the policy decides the next move): what it took
                if text_len:
                    self.policy.window_judged(
                        state.adaptive,
                        state.arm_window,
                        taken_before + min(int(result.accepted[k]), text_len),
                        rejected=bool(result.rejected[k]),
                    )
                state.arm_window = 0
            if text_len == 0:
                continue  # nothing was offered (placeholder drafts, or a stop first)
            l_tok = int(batch.l_tok[k])
            self._alpha_seen(state, text_len, l_tok)
            stats.drafts += 1
            stats.draft_tokens += text_len
            stats.tokens_accepted_token_level += l_tok
            counts = state.counts
            counts.draft_tokens += text_len
            counts.token_level += l_tok
            if not result.judged[k]:  # token-level verification took it whole
                stats.drafts_accepted_whole += 1
                continue
            accepted = int(result.accepted[k])
            stats.tokens_accepted_semantic += max(0, accepted - l_tok)
            stats.guard_cuts += int(result.guard_cut[k])
            counts.drafts_judged += 1
            counts.semantic += max(0, accepted - l_tok)
            counts.rejections += int(result.rejected[k])
            if result.rejected[k]:
                stats.reject_at(max(0, int(result.first_fail[k])))
                stats.draft_tokens_discarded += text_len - accepted
            elif accepted >= text_len:
                stats.drafts_accepted_whole += 1
            before = state.phase
            state.after_judged_draft(
                self.config,
                bool(result.rejected[k]),
                guard_cut=bool(result.cut[k]),
                accepted=accepted,
                window=self.window,
            )
            if state.phase is Phase.REWRITE and before is not Phase.REWRITE:
                stats.rounds += 1

    def _commit(self, k: int, req_id: str, batch: DraftBatch, result: StepResult, window: OpenWindow) -> None:
        """A judged part of a window passed: the request took draft[:accepted] of it and the
        window goes on after them (its phase, and under adaptive its move, unchanged)."""
        accepted, l_tok = int(result.accepted[k]), int(batch.l_tok[k])
        window.commit(accepted)
        if self.policy is not None:
            self.policy.part_judged(int(result.text_len[k]))
        state = self.states[req_id]
        # what the part offers past `accepted` is offered again with the next part: seen then
        self._alpha_seen(state, accepted, l_tok)
        stats, counts = self.stats, state.counts
        stats.chunk_commits += 1
        stats.draft_tokens += accepted  # (the rest of this part is offered again with the next)
        stats.tokens_accepted_token_level += l_tok
        stats.tokens_accepted_semantic += accepted - min(l_tok, accepted)
        counts.draft_tokens += accepted
        counts.token_level += l_tok
        counts.semantic += accepted - min(l_tok, accepted)
        stats.drafts += 1
        counts.drafts_judged += int(result.judged[k])

    def _alpha_seen(self, state: RequestState, offered: int, l_tok: int) -> None:
        """A window's `offered` draft tokens, the first `l_tok` of them the target's own: the
        same drafter's acceptance as on the token-level arm, so α's evidence too (a window of
        W tokens holds many token-level steps' worth). Not where another proposer drafts
        for the token-level arm."""
        if state.adaptive is not None and self.token_proposer is None and offered:
            self.policy.token_level_verified(state.adaptive, offered, min(l_tok, offered))

    # -- counters -------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = ParseStats()
        self._exported = ParseStats()
        self.finished.clear()
        for state in self.states.values():
            state.counts = RequestCounts()

    def request_stats(self) -> dict[str, dict]:
        """Each request's counters, by vLLM's request id: the last FINISHED_KEPT finished
        ones and those in flight (a request's last step is seen finished only at the next)."""
        live = {req_id: state.counts for req_id, state in self.states.items()}
        return {req_id: dataclasses.asdict(c) for req_id, c in {**self.finished, **live}.items()}

    def export(self) -> None:
        """Add what the counters gained since the last export to Prometheus."""
        self._prom.add(self.stats.minus(self._exported))
        self._exported = self.stats.copy()

    def scratch_ids(self) -> np.ndarray:
        """The scratch KV block ids held back from the scheduler (empty on the kernel path)."""
        scratch = getattr(self.verifier, "scratch_ids", None)
        return np.zeros(0, dtype=np.int64) if scratch is None else np.asarray(scratch)

    def audit(self, num_reqs: int, held: set[int]) -> None:
        if self.kv_audit is not None:
            self.kv_audit.record(num_reqs, len(held), len(held.intersection(self.scratch_ids().tolist())))
