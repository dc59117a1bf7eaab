"""How long a request's next window is, or none: the choice `on_reject: adaptive` makes each
time a request could open a window.

Two arms. A **window** of w tokens: w draft-model steps, then the target's forward over the
window and the verification pass, yielding the prefix the judge (or token-level
acceptance) takes plus the token the target samples after it. The **token-level arm**:
each step, `spec_tokens` draft tokens verified token by token (or the target alone),
yielding the accepted ones plus one. The policy picks the arm, and the window length, with
the higher expected tokens per second (goodput, as SmartSpec and vLLM's RFC #44336 choose
k), from plain numbers:

  what the judge takes: a per-token survival rate ρ (each judged token kept with
  probability ρ, independently): E[taken | w] = ρ(1 - ρ^w)/(1 - ρ). Estimated per request
  from its windows (a window that took `a` of its tokens and was rejected saw a survivals
  and one failure; one taken whole saw w survivals and no failure: the geometric MLE
  ρ = Σ a / (Σ a + rejections), with the engine's own estimate over the requests of the
  same τ and guard as a prior worth `PRIOR_TOKENS` tokens).

  what a window and a step cost: `CostModel`, a linear model of the engine's step time
  in the tokens a step runs through the target, the drafter and the verification pass,
  fitted online (recursive least squares with forgetting) to the step times the engine
  sees: a GPU step costs about the same for 1 or 100 tokens, a CPU step grows with them,
  and the fit tells which this machine is.

  what the token-level arm yields: a per-token acceptance rate α, estimated as ρ is (a draft
  of k tokens whose first a were accepted saw a survivals and, if a < k, one failure), per
  request with the engine's as a prior: E[accepted | k] = α(1 - α^k)/(1 - α).

The token-level arm's k is chosen too, once a step for all its rows (`choose_token_k`): 0 (the
target alone), the powers of two below `spec_tokens`, or `spec_tokens`, whichever gives its
rows the most tokens per second. The drafter's passes are shared by the rows that draft, so the
choice is the batch's, not each request's. The drafter is timed apart from the rest of the step
(`CostModel.update`'s `drafter_seconds`): steps that always draft k tokens could not tell the
drafter's cost from the target's otherwise. Where drafting costs more than it saves (a CPU at
batch 8, where the target's tokens cost compute), the arm is the target alone; at batch 1, or
where a forward costs whatever its tokens (a GPU), it drafts. Both estimates start optimistic
(drafting free, α = OPTIMISTIC_ALPHA), so an engine drafts until its own steps say otherwise.

Judged in parts (`judge_chunks`, windows.py), a window costs what is drafted up to its first
failing boundary plus the part that held it, however long it was to be: a window of w
drafts E[drafted | w] = min(w, E[taken | w] + (1 - ρ^w) · part) tokens and is judged about
E[drafted] / part times (`part`: draft tokens per judgment, the engine's mean), each time a
target forward and a verification pass. Its goodput only grows with w, so judged in parts a
window is as long as the request has room for, up to W. Whether to judge in parts is the
policy's too (`Decision.parts`): parts waste less draft where drafting costs (a CPU), and
cost a forward and a pass each, where forwards cost whatever their tokens (a GPU) a few
whole windows may pay more. With `judge_chunks` the policy weighs the token-level arm, whole
windows and a window judged in parts, and takes the best; a rejection still sends the
request to the token-level arm for a back-off, after which the same choice is made again
(no forced probe: a part's waste is already bounded).

No window opens before the cost model has learnt from `COST_STEPS` steps that ran the
target's forward and, where the draft model writes the token-level arm's drafts (and they
are counted: not a token proposer's, nor vLLM's whole-batch proposer's), the drafter
(`costs_learnt`): until then a window's drafting is priced at the prior's nothing, and the
first request would open windows that the engine's own steps would have shown not to pay (on
this CPU at batch 1, a first request's windows took it 40.7 s against k 4's 26.1 s:
docs/adaptive-windows.md). The wait is the first request's first few steps, on the
token-level arm, which runs at its own speed meanwhile; where windows pay (a GPU), the
learnt costs say so and the first window opens then. Given step costs
(`adaptive_step_costs`) need no wait. Where only windows run the drafter (k 0, a token
proposer) its cost is learnt from the first windows, priced free until then.

Judged whole, windows start at `MIN_WINDOW`; one taken whole is followed by one twice as
long while windows pay (a request whose windows are all taken reaches W, as Hugging Face's
schedule grows its draft on full acceptance), otherwise the best-paying length up to twice
the last. (A longer first window, or the judge's rate read optimistically until tried,
would find windows that pay only when long, but where none pays, as on a CPU at batch 1,
trying them costs more than k 4 gains back: docs/adaptive-windows.md.) After a window is
rejected, or whenever the token-level arm wins, the request stays with the token-level arm
for a back-off, counted in output tokens, that doubles with every window rejected in a
row; when it ends the request re-probes with a window of MIN_WINDOW tokens, whatever the
judge's estimate says, as long as some window would pay if the judge took every token (a
probe tests the judge; where the costs alone rule windows out there is nothing to test,
and the back-off starts again). So a request whose judge never accepts pays at most
MIN_WINDOW drafted tokens per probe, and probes at output tokens b, 3b, 7b, ... (b = `FIRST_BACKOFF`): over
an answer of N tokens at most MIN_WINDOW * (log2(N / b + 1) + 1) draft tokens on windows
(`exploration_bound`).

Pure: plain numbers in, a decision out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MIN_WINDOW = 16  # the shortest window, and the probe after a back-off
FIRST_BACKOFF = 16  # output tokens of the token-level arm after the first rejected window
PRIOR_TOKENS = 32.0  # how much the engine's estimate weighs in a request's, in judged tokens
OPTIMISTIC_RHO = 0.98  # the engine's survival rate before any window was judged
PRIOR_PART = 8  # draft tokens per judged part before any part was judged (chunked judging)
OPTIMISTIC_ALPHA = 0.9  # the engine's token-level acceptance rate before any draft was verified
SPAN_TOKENS = 2  # tokens a window's drafter call writes the KV of each step (its last two: windows.py)
PRIOR_DRAFT_TOKENS = 8.0  # how much the engine's α weighs in a request's, in verified draft tokens
# Per step on the target alone (k 0), a request's own token-level record is worth this much
# of itself: drafting nothing, it gathers no evidence, and a few unlucky early drafts would
# otherwise keep it off the drafter for good; forgotten, its α returns to the engine's.
ALPHA_FORGET = 0.9
COST_STEPS = 8  # learnt steps of the target's forward (and the drafter's) before a first window
# What a step ran, the cost model's inputs: the step itself (host work), whether the target
# ran its forward, the tokens through it, the drafter's sequential forwards (a w-token draft
# takes w, however many rows share them) and the tokens through them (rows x positions),
# the verification passes (each a forward of the target) and their tokens, and the drafter's
# calls (each with its own host work: 80 ms here on a CPU, as much as a forward, so a window
# drafted 2 tokens a call pays it every 2 tokens, a k 4 step every 4). A GPU step is mostly
# the forwards' fixed costs (weights read once, whatever the tokens); a CPU step grows with
# the tokens; the fit tells which this machine is.
FEATURES = (
    "step",
    "target_forward",
    "target_tokens",
    "draft_forwards",
    "draft_tokens",
    "verify_passes",
    "verify_tokens",
    "draft_calls",
)


def expected_taken(rho: float, w: int) -> float:
    """E[tokens taken of a w-token window] when each is kept with probability rho in a row."""
    rho = min(max(rho, 0.0), 1.0 - 1e-9)
    return rho * (1.0 - rho**w) / (1.0 - rho)


def expected_drafted(rho: float, w: int, part: float) -> float:
    """E[draft tokens a w-token window judged in parts of `part` tokens drafts]: what it
    takes, and where a boundary fails, the part that held it."""
    rho = min(max(rho, 0.0), 1.0 - 1e-9)
    return min(float(w), expected_taken(rho, w) + (1.0 - rho**w) * part)


def backoff_tokens(failed_in_row: int) -> int:
    """Output tokens on the token-level arm after the `failed_in_row`-th window rejected in a row."""
    return FIRST_BACKOFF * 2 ** (failed_in_row - 1)


def exploration_bound(answer_tokens: int, min_window: int = MIN_WINDOW, first_backoff: int = FIRST_BACKOFF) -> int:
    """The most draft tokens a request spends on windows over an answer of `answer_tokens`
    tokens when every window it opens is rejected (module docstring)."""
    probes = 1 + int(math.floor(math.log2(answer_tokens / first_backoff + 1)))
    return min_window * probes


# The drafter's FEATURES, fitted to the drafter's own time; the rest to the step's time less it.
DRAFTER = np.array([FEATURES.index(f) for f in ("draft_forwards", "draft_tokens", "draft_calls")])
REST = np.array([i for i in range(len(FEATURES)) if i not in DRAFTER])


# A verification pass is a forward of the target over its copies: priced as one (TARGET's
# coefficients) until the engine has timed a pass of its own.
TARGET = np.array([FEATURES.index(f) for f in ("target_forward", "target_tokens")])
VERIFY = np.array([FEATURES.index(f) for f in ("verify_passes", "verify_tokens")])

# The most the fit's variance may grow to in any direction. Forgetting inflates it in directions
# no recent step ran (a verification pass while no window opens), without bound: after some
# 35,000 steps the covariance overflows and the fit turns NaN. Capped at the unknown forward's prior.
P_MAX = 1e6


class CostModel:
    """Step time ≈ θ · x over FEATURES, fitted by recursive least squares with forgetting
    (`forget` per step) from a weak prior: every token free, the step's own host work near
    free, a target forward's fixed cost unknown. Steps that only decode run one step and one
    forward each, so they cannot tell the two apart; the prior gives their common cost to
    the forward, which a window's drafting steps (no forward) do not pay; once a window
    runs, those steps tell the host's work (less the drafter's, timed apart) from it. (A
    prior giving it to the step would charge every drafting step a target forward: windows
    look 2x dearer at batch 1, and none opens to correct it.) The drafter's part (DRAFTER) is
    fitted to the drafter's own time, the rest (REST) to the step's time less it: two
    independent fits, each learning only from steps that ran some of its features. A step
    much slower than predicted (an engine that sat idle between steps) is not learnt from,
    unless it ran a feature no step learnt from before (a first window's drafting step,
    predicted at nearly nothing). `fixed` (seconds by FEATURES name,
    parse.adaptive_step_costs): θ given, never fitted."""

    def __init__(self, forget: float = 0.98, prior_weight: float = 1.0, fixed: dict[str, float] | None = None):
        self.forget = forget
        self.theta = np.zeros(len(FEATURES))
        self.P = np.eye(len(FEATURES)) / prior_weight  # block-diagonal: DRAFTER and REST
        self.P[1, 1] = P_MAX  # a target forward's fixed cost is unknown until the first step
        self.runs = np.zeros(len(FEATURES), dtype=np.int64)  # learnt steps that ran each feature
        self.steps = 0
        self.fixed = fixed is not None
        if fixed is not None:
            self.theta = np.array([float(fixed.get(name, 0.0)) for name in FEATURES])

    def update(self, x: np.ndarray, seconds: float, drafter_seconds: float = 0.0) -> None:
        """One step of `seconds` that ran x (FEATURES), `drafter_seconds` of them in the drafter."""
        if self.fixed:
            return
        x = np.asarray(x, dtype=np.float64)
        new = bool(np.any(x[~self.seen] != 0))
        if self.steps >= 8 and not new and seconds > 20 * max(self.cost(x), 1e-6):
            return
        self.runs += x != 0
        for idx, y in ((REST, seconds - drafter_seconds), (DRAFTER, drafter_seconds)):
            if x[idx].any():
                self._fit(idx, x[idx], y)
        self.steps += 1

    @property
    def seen(self) -> np.ndarray:
        """[len(FEATURES)] bool: the features some learnt step ran."""
        return self.runs > 0

    def knows(self, names: tuple[str, ...], steps: int) -> bool:
        """Whether every feature in `names` was run by at least `steps` learnt steps (given
        costs: always)."""
        return self.fixed or all(self.runs[FEATURES.index(n)] >= steps for n in names)

    def _fit(self, idx: np.ndarray, x: np.ndarray, y: float) -> None:
        block = np.ix_(idx, idx)
        P = self.P[block]
        Px = P @ x
        gain = Px / (self.forget + x @ Px)
        self.theta[idx] += gain * (y - x @ self.theta[idx])
        P = (P - np.outer(gain, Px)) / self.forget
        # kept symmetric, positive semi-definite and bounded: eigenvalues in [0, P_MAX] (the
        # subtraction's rounding, grown by 1 / forget a step in directions no step runs,
        # would otherwise turn P indefinite and the fit NaN)
        vals, vecs = np.linalg.eigh((P + P.T) / 2)
        self.P[block] = (vecs * np.clip(vals, 0.0, P_MAX)) @ vecs.T

    def as_dict(self) -> dict:
        """What the model holds: seconds by FEATURES name (negative ones as 0: a valid
        parse.adaptive_step_costs, which `cost` reads as given), fixed or fitted, and the
        steps it learnt from."""
        seconds = {name: float(max(t, 0.0)) for name, t in zip(FEATURES, self.theta)}
        return {"seconds": seconds, "fixed": self.fixed, "steps": self.steps}

    def cost(self, x: np.ndarray) -> float:
        """Predicted seconds of x: each fit's (REST's, DRAFTER's) at least 0. Coefficients are
        read as fitted, negative ones too: where two features move together (a drafter
        forward and its tokens, at batch 1) the fit may trade one against the other, and
        only their sum, which the steps pin down, means anything; clipped one by one, that
        sum was lost (windows priced 2x off)."""
        x = np.asarray(x, dtype=np.float64)
        if self.fixed:
            return float(self.theta @ x)
        theta = self.theta
        if not self.seen[VERIFY].any():  # no pass timed yet: the prior's nothing would be a free judgment
            theta = theta.copy()
            theta[VERIFY] = theta[TARGET]
        return sum(max(float(theta[idx] @ x[idx]), 0.0) for idx in (REST, DRAFTER))


@dataclass
class ArmStats:
    """A request's record (or the engine's, over all requests)."""

    judged_tokens: float = 0.0  # Σ tokens windows kept (the survivals)
    rejections: float = 0.0  # windows rejected
    windows: int = 0
    token_accepted: float = 0.0  # Σ draft tokens the token-level arm accepted (the survivals)
    token_failures: float = 0.0  # its drafts not accepted whole

    def rho(self, prior: float, prior_tokens: float = PRIOR_TOKENS) -> float:
        return (self.judged_tokens + prior_tokens * prior) / (self.judged_tokens + self.rejections + prior_tokens)

    def alpha(self, prior: float, prior_tokens: float = PRIOR_DRAFT_TOKENS) -> float:
        return (self.token_accepted + prior_tokens * prior) / (self.token_accepted + self.token_failures + prior_tokens)


# Why a decision went as it did (Decision.why).
BACKING_OFF = "backing off"  # token-level for a while after a rejection or a token-level choice
LEARNING_COSTS = "learning costs"  # token-level until the cost model knows this engine's steps
NO_ROOM = "no room"  # max_tokens or the context leaves no token for a window
PROBE = "probe"  # the back-off after a rejected window is over: a MIN_WINDOW window, judged whole
WINDOW_PAYS = "window pays"  # a whole window's expected tokens per second beat the token-level arm's
PARTS_PAY = "window in parts pays"  # a window judged in parts beat both
TOKEN_LEVEL_PAYS = "token-level pays"  # the token-level arm beat every window
WHY = (BACKING_OFF, LEARNING_COSTS, NO_ROOM, PROBE, WINDOW_PAYS, PARTS_PAY, TOKEN_LEVEL_PAYS)


@dataclass
class Decision:
    window: int  # tokens of the window to open (0: the token-level arm)
    probe: bool = False  # a re-probe after a back-off
    parts: bool = False  # judged in parts as it is drafted (judge_chunks)
    why: str = ""  # the reason, counted per request (RequestCounts.policy): one of WHY


@dataclass
class RequestPolicy:
    """One request's adaptive state."""

    key: tuple = ()  # what the engine's prior for it is kept by: its τ and guard
    stats: ArmStats = field(default_factory=ArmStats)
    last_window: int = 0  # the last window's length (0: none yet)
    last_whole: bool = False  # the last window was taken whole
    failed_in_row: int = 0  # windows rejected in a row
    backoff_left: int = 0  # output tokens of the token-level arm before the next decision
    probes: int = 0


class WindowPolicy:
    """The engine's policy: its cost model, the engine-wide record, and the decision."""

    def __init__(
        self,
        window: int,
        spec_tokens: int,
        chunk: int,
        verify_tokens_per_window: float,
        sizes=None,
        step_costs: dict[str, float] | None = None,
        judge_chunks: bool = False,
        token_drafts_counted: bool = True,
    ):
        self.window = window  # W, the longest window
        self.spec_tokens = spec_tokens  # the token-level arm's longest k (0: the target alone)
        self.token_ks = token_lengths(spec_tokens)  # the k it may choose
        self.token_k = spec_tokens  # its k now (choose_token_k)
        self.chunk = chunk  # draft tokens per engine step of a window (0: the whole window)
        self.verify_tokens = verify_tokens_per_window  # copies x suffix tokens of a judgment
        self.judge_chunks = judge_chunks  # windows judged in parts as they are drafted
        self.part = float(max(chunk, PRIOR_PART))  # draft tokens per judged part, averaged
        self.sizes = sizes or window_sizes(window)
        self.costs = CostModel(fixed=step_costs)  # step_costs: parse.adaptive_step_costs
        # the draft model writes the token-level arm's drafts and its passes are counted (False:
        # a token proposer drafts them, or vLLM's proposer runs over the whole batch)
        self.token_drafts_counted = token_drafts_counted
        # The engine's record, by request key (τ and guard: a judge takes far more at τ 0
        # than at 0.9), the prior of a request's own.
        self.engine: dict[tuple, ArmStats] = {}
        self.batch = 1.0  # requests per step, averaged

    def prior(self, r: RequestPolicy) -> ArmStats:
        return self.engine.setdefault(r.key, ArmStats())

    # -- what the engine sees --------------------------------------------------------

    def step_done(self, seconds: float, x: np.ndarray, rows: int, drafter_seconds: float = 0.0) -> None:
        """An engine step took `seconds` running x (FEATURES) for `rows` requests,
        `drafter_seconds` of them in the drafter."""
        if seconds > 0:
            self.costs.update(x, seconds, drafter_seconds)
        if rows:
            self.batch = 0.9 * self.batch + 0.1 * rows

    def window_judged(self, r: RequestPolicy, window: int, taken: int, rejected: bool) -> None:
        """A window of `window` tokens the judge (or token-level acceptance) took `taken`
        tokens of; rejected or taken whole (a cut is neither: it counts as its survivals)."""
        for s in (r.stats, self.prior(r)):
            s.judged_tokens += taken
            s.rejections += int(rejected)
            s.windows += 1
        r.last_window = window
        r.last_whole = not rejected and taken >= window
        if rejected:
            r.failed_in_row += 1
            r.backoff_left = backoff_tokens(r.failed_in_row)
        else:
            r.failed_in_row = 0

    def part_judged(self, tokens: int) -> None:
        """A part of a window of `tokens` draft tokens went to the judge (chunked judging)."""
        self.part = 0.9 * self.part + 0.1 * max(tokens, 1)

    def token_level_verified(self, r: RequestPolicy, k: int, accepted: int) -> None:
        """A token-level draft of k tokens, the first `accepted` of them accepted."""
        for s in (r.stats, self.prior(r)):
            s.token_accepted += accepted
            s.token_failures += int(accepted < k)

    def tokens_out(self, r: RequestPolicy, n: int) -> None:
        """The request gained n output tokens on the token-level arm."""
        r.backoff_left = max(0, r.backoff_left - n)

    # -- the choice ------------------------------------------------------------------

    def costs_learnt(self) -> bool:
        """Whether the cost model has learnt enough of this engine's steps to price a window:
        `COST_STEPS` steps that ran the target's forward and, if the draft model drafts for
        the token-level arm (its k now, counted), the drafter (module docstring)."""
        drafter = self.token_k and self.token_drafts_counted
        needed = ("target_forward", "draft_forwards") if drafter else ("target_forward",)
        return self.costs.knows(needed, COST_STEPS)

    def rho(self, r: RequestPolicy) -> float:
        return r.stats.rho(self.prior(r).rho(OPTIMISTIC_RHO))

    def window_cost(self, w: int, rho: float | None = None) -> np.ndarray:
        """FEATURES of one window of w tokens, as this request's share: the engine steps it
        spans (it opens in a step of the batch, is drafted a chunk a step while the others
        decode, and its judgment is the first step of the request's next move), a share of
        one target forward, the target's tokens over it, its w drafter forwards and the
        tokens they run (its w drafts, and each step's call writing the KV of its last
        SPAN_TOKENS tokens, as `ParseController.count_drafter` counts a step's), its
        verification pass, and a drafter call a step. Judged in parts (given the survival
        rate `rho`): what it is expected to draft (module docstring), and a target forward
        and a verification pass per part."""
        if rho is None:
            steps = math.ceil(w / self.chunk) if self.chunk else 1
            return np.array(
                [steps / self.batch, 1 / self.batch, w + 1, w, w + SPAN_TOKENS * steps, 1, self.verify_tokens, steps]
            )
        drafted = expected_drafted(rho, w, self.part)
        parts = max(1.0, drafted / self.part)
        steps = drafted / self.chunk if self.chunk else 1.0
        return np.array(
            [(steps + parts) / self.batch, parts / self.batch, drafted + parts, drafted,
             drafted + SPAN_TOKENS * steps, parts, parts * self.verify_tokens, steps]
        )  # fmt: skip

    def alpha(self, r: RequestPolicy) -> float:
        """The request's token-level acceptance rate, with the engine's as its prior."""
        return r.stats.alpha(self.prior(r).alpha(OPTIMISTIC_ALPHA))

    def token_level_cost(self, k: int | None = None, accepted: float = 0.0) -> np.ndarray:
        """FEATURES of one step of the token-level arm at k (default: its k now), as this
        request's share: the step, the target's forward and the drafter's k sequential
        forwards and call are the batch's (every row on the arm drafts k, in one pass:
        `choose_token_k`), its k + 1 target tokens and its drafter tokens its own (its
        `accepted` tokens and the target's, then its k drafts: `token_level_step_cost`'s)."""
        k = self.token_k if k is None else k
        drafted = accepted + 1 + k if k else 0.0
        return np.array([1 / self.batch, 1 / self.batch, k + 1, k / self.batch, drafted, 0, 0, (k > 0) / self.batch])

    def token_level_step_cost(self, k: int, accepted: list[float]) -> np.ndarray:
        """FEATURES of one step of the token-level arm at k for rows expecting to accept
        `accepted` [n] tokens each: one target forward over n(k + 1) tokens and, if k > 0, k
        drafter forwards, in one call, over each row's new tokens (its accepted ones and the
        target's) and its k drafts."""
        n = len(accepted)
        drafted = sum(a + 1 for a in accepted) + n * k if k else 0.0
        return np.array([1, 1, n * (k + 1), k, drafted, 0, 0, k > 0], dtype=np.float64)

    def choose_token_k(self, rows: list[RequestPolicy]) -> int:
        """The token-level arm's k for this step's `rows` (the requests on it), shared by
        them: the k of `token_ks` with the most tokens per second over the rows, each
        yielding E[accepted | its α, k] + 1 tokens (ties: the shorter k). On k 0 (the target
        alone) each row keeps ALPHA_FORGET of its own token-level record, which drafting
        nothing it cannot renew."""
        if rows:
            alphas = [self.alpha(r) for r in rows]
            best = None
            for k in self.token_ks:
                accepted = [expected_taken(a, k) for a in alphas]
                g = (sum(accepted) + len(rows)) / max(self.costs.cost(self.token_level_step_cost(k, accepted)), 1e-12)
                if best is None or g > best[0] * (1 + 1e-9):
                    best = (g, k)
            self.token_k = best[1]
            if self.token_k == 0:
                for r in rows:
                    r.stats.token_accepted *= ALPHA_FORGET
                    r.stats.token_failures *= ALPHA_FORGET
        return self.token_k

    def goodput_window(self, rho: float, w: int, parts: bool = False) -> float:
        """Expected tokens per second of a window of w tokens, judged whole or in parts."""
        cost = self.window_cost(w, rho if parts else None)
        return (expected_taken(rho, w) + 1.0) / max(self.costs.cost(cost), 1e-12)

    def goodput_token_level(self, r: RequestPolicy, k: int | None = None) -> float:
        """Expected tokens per second of the request on the token-level arm at k (default: its k now)."""
        k = self.token_k if k is None else k
        accepted = expected_taken(self.alpha(r), k) if k else 0.0
        return (accepted + 1.0) / max(self.costs.cost(self.token_level_cost(k, accepted)), 1e-12)

    def decide(self, r: RequestPolicy, room: int) -> Decision:
        """The request's next move, `room`: the most tokens a window could hold now (its
        max_tokens and the context). A window taken whole is followed by one twice as long
        (up to W), if a window still pays; otherwise the best-paying length up to twice the
        last one."""
        if r.backoff_left > 0 or room < 1:
            return Decision(0, why=BACKING_OFF if room >= 1 else NO_ROOM)
        if not self.costs_learnt():
            return Decision(0, why=LEARNING_COSTS)
        cap = min(self.window, room)
        if r.failed_in_row and not self.judge_chunks:
            # the back-off is over: probe, if a judge that took every token would make the
            # window pay (a probe tests the judge; where the costs alone rule windows out,
            # as on a CPU at batch 1, there is nothing to test)
            token_level = self.goodput_token_level(r)
            if any(self.goodput_window(1.0, n) > token_level for n in [n for n in self.sizes if n <= cap] or [cap]):
                r.probes += 1
                return Decision(min(MIN_WINDOW, cap), probe=True, why=PROBE)
            r.backoff_left = backoff_tokens(r.failed_in_row)
            return Decision(0, why=TOKEN_LEVEL_PAYS)
        if r.last_whole:
            lengths = [min(2 * r.last_window, cap)]
        else:
            limit = min(cap, 2 * r.last_window if r.last_window else MIN_WINDOW)
            lengths = [w for w in self.sizes if w <= limit] or [limit]
        # (length, judged in parts) -> goodput; judged in parts, the longest (its waste is a part)
        moves = [(w, False) for w in lengths] + ([(cap, True)] if self.judge_chunks else [])
        rho = self.rho(r)
        best, best_g = (0, False), self.goodput_token_level(r)
        for w, parts in moves:
            if (g := self.goodput_window(rho, w, parts)) > best_g:
                best, best_g = (w, parts), g
        if best[0] == 0:
            r.backoff_left = FIRST_BACKOFF  # token-level for a while, then decide again
        probe = bool(best[0] and r.failed_in_row)
        r.probes += int(probe)
        why = (PARTS_PAY if best[1] else WINDOW_PAYS) if best[0] else TOKEN_LEVEL_PAYS
        return Decision(best[0], probe=probe, parts=best[1], why=why)


def token_lengths(spec_tokens: int) -> list[int]:
    """The token-level arm's choices of k: 0 (the target alone), the powers of two below
    `spec_tokens`, and `spec_tokens`."""
    ks, k = [0], 1
    while k < spec_tokens:
        ks.append(k)
        k *= 2
    return ks + ([spec_tokens] if spec_tokens else [])


def window_sizes(window: int) -> list[int]:
    """MIN_WINDOW, doubling, up to W (W itself included)."""
    sizes, w = [], MIN_WINDOW
    while w < window:
        sizes.append(w)
        w *= 2
    return sorted(set(sizes + [window]))
