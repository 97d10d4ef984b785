"""What happens to carried-over responses after each optimizer step: one interface, one mode each (`MODES`).

  on_policy         no carry-over: the rollout phase waits for every launched group
  partial           carry everything over unverified
  staleness_filter  restart (from the prompt) responses whose oldest token is more than S versions old
  ops_filter        restart responses whose whole-response mean OPS >= gamma
  rollverify        keep the two-stage verified prefix (each stage switchable), with conditional
                    switching to on_policy once acceptance stays low
  spec_rl           SPEC-RL's cut: re-score each carried token, accept it with probability
                    min(1, p_new / p_old), keep the prefix before the first rejection

Every strategy maps (carried-over responses, the trainer's new log-probs, new policy version) to a
``VerifyOutcome``: a keep length per response plus the statistics the loop logs, whole, under ``verify/``.
Token OPS of the carried tokens is computed once per call, in ``Strategy.apply``, whenever new log-probs are
given: it feeds the ``ops_mean`` statistic, the drift by age (``drift/``, ``whatif/``: rollverify/calibration.py)
and the OPS-based decisions. RollVerify's thresholds are numbers or ``auto`` (set from that drift every step).

Strategies see policy tokens only (``VerifyBatch``): OPS, segments, both stages, acceptance and the switch
count them, environment tokens never cause a cut, and ``apply`` maps each keep length back to the whole
response (a cut at a policy token removes the environment tokens after it too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollverify.calibration import AUTO, AutoThresholds, drift_stats, empty_drift_stats, parse_threshold
from rollverify.types import Response, VerifyBatch
from rollverify.verify import D_S, D_T, VerifyResult, token_ops, two_stage_verify_ops

MODES = ("on_policy", "partial", "staleness_filter", "ops_filter", "rollverify", "spec_rl")
ESTIMATORS = ("window", "ema")
VERIFY_ON = ("trainer", "engine")  # who computes the new log-probs of carried tokens (rollverify/loop.py)
SCHEDULES = ("alternating", "async")  # rollverify/loop.py; rollverify/async_loop.py
ASYNC_MODES = ("rollverify", "partial")  # the modes the asynchronous schedule runs (partial: unverified baseline)
FALLBACKS = ("on_policy", "alternating")  # where the asynchronous schedule's conditional switch goes

NewLogprobs = Sequence[np.ndarray | Tensor] | Tensor | None


@dataclass
class AlgoConfig:
    """Algorithm settings (defaults: the paper's)."""

    mode: str = "rollverify"
    # sequence-level threshold on a segment's mean OPS, and token-level threshold: numbers (inf: stage off), or
    # "auto": set every verification from the measured one-version drift (rollverify/calibration.py)
    d_s: float | str = D_S
    d_t: float | str = D_T
    seq_stage: bool = True
    token_stage: bool = True
    staleness_s: int = 1  # staleness_filter: restart responses older than this many versions
    ops_gamma: float = 0.01  # ops_filter: restart responses whose mean OPS >= gamma
    conditional_switch: bool = True  # rollverify: switch to on_policy when acceptance stays low
    switch_window: int = 8
    switch_tau: float = 0.5
    switch_estimator: str = "window"  # or "ema"
    ema_alpha: float = 0.2
    # trainer: a forward pass on the trainer after the step; engine: the engines prefill the carried responses
    # under the new weights (which resuming them needs anyway) and return their log-probs
    verify_on: str = "trainer"
    adv_use_std: bool = True  # GRPO advantages: divide by the group's reward std (false: Dr. GRPO)
    # the new log-probs of the carried tokens even in the modes that do not verify (their ops_mean)
    monitor_ops: bool = True
    # alternating: rollout, train, verify, resync take turns (rollverify/loop.py); async: servers generate
    # continuously and the trainer takes finished groups from a queue (rollverify/async_loop.py)
    schedule: str = "alternating"
    # async: versions a trained token may lag the trainer's (a backstop: verification is the guard); a response
    # holding an older token restarts, so it must exceed the steps the longest response takes to generate
    max_staleness: int = 8
    queue_groups: int = 0  # async: finished groups waiting for the trainer at which no new group launches (0: B)
    # async: where the conditional switch goes once acceptance stays low: on_policy (as the alternating loop's
    # switch), or the alternating loop with a fresh switch of its own
    fallback: str = "on_policy"
    # on-policy tail batching (RollPacker's, on this project's shelving): a step that generates for on_policy (the
    # mode, or what the conditional switch falls to) launches tail_launch x B groups and trains the first B that
    # finish; the others go back to their prompts, their partial responses dropped, and wait; once B wait, a
    # long round generates exactly them (rollverify/loop.py)
    tail_batching: bool = False
    tail_launch: float = 1.5
    # spec_rl (SPEC-RL's lenience knobs): accept a token with probability min(1, exp(scale (delta + lenience)))
    # and, with p_min > 0, only where p_new >= p_min; delta = lp_new - lp_old. Its draws derive from spec_seed
    # and the policy version.
    spec_lenience: float = 0.0
    spec_scale: float = 1.0
    spec_p_min: float = 0.0
    spec_seed: int = 0

    def __post_init__(self) -> None:
        def bad(key: str, allowed: str) -> ValueError:
            return ValueError(f"algo.{key} must be {allowed}, got {getattr(self, key)!r}")

        if self.mode not in MODES:
            raise bad("mode", f"one of {MODES}")
        if isinstance(self.spec_lenience, bool) or not isinstance(self.spec_lenience, int | float) \
                or not 0 <= self.spec_lenience < math.inf:
            raise bad("spec_lenience", "a finite number >= 0 (0: SPEC-RL's exact rule)")
        if isinstance(self.spec_scale, bool) or not isinstance(self.spec_scale, int | float) \
                or not 0 < self.spec_scale < math.inf:
            raise bad("spec_scale", "a finite number > 0")
        if isinstance(self.spec_p_min, bool) or not isinstance(self.spec_p_min, int | float) \
                or not 0 <= self.spec_p_min <= 1:
            raise bad("spec_p_min", "a number in [0, 1] (0: off)")
        if isinstance(self.spec_seed, bool) or not isinstance(self.spec_seed, int):
            raise bad("spec_seed", "an integer")
        for key in ("d_s", "d_t"):
            setattr(self, key, parse_threshold(getattr(self, key), key))
        for key in ("ops_gamma",):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise bad(key, "a number >= 0 (inf turns it off)")
        for key in ("seq_stage", "token_stage", "conditional_switch", "adv_use_std", "monitor_ops", "tail_batching"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "true or false")
        if isinstance(self.staleness_s, bool) or not isinstance(self.staleness_s, int) or self.staleness_s < 0:
            raise bad("staleness_s", "an integer >= 0")
        if isinstance(self.switch_window, bool) or not isinstance(self.switch_window, int) or self.switch_window < 1:
            raise bad("switch_window", "an integer >= 1")
        if not isinstance(self.switch_tau, int | float) or not 0 <= self.switch_tau <= 1:
            raise bad("switch_tau", "a number in [0, 1]")
        if self.switch_estimator not in ESTIMATORS:
            raise bad("switch_estimator", f"one of {ESTIMATORS}")
        if not isinstance(self.ema_alpha, int | float) or not 0 < self.ema_alpha <= 1:
            raise bad("ema_alpha", "a number in (0, 1]")
        if self.verify_on not in VERIFY_ON:
            raise bad("verify_on", f"one of {VERIFY_ON}")
        if self.schedule not in SCHEDULES:
            raise bad("schedule", f"one of {SCHEDULES}")
        for key in ("max_staleness", "queue_groups"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, "an integer >= 0")
        if self.fallback not in FALLBACKS:
            raise bad("fallback", f"one of {FALLBACKS}")
        if isinstance(self.tail_launch, bool) or not isinstance(self.tail_launch, int | float) \
                or not 1 < self.tail_launch < math.inf:
            raise bad("tail_launch", "a number > 1 (groups launched per regular round, in batches of B)")
        if self.tail_batching and not self.falls_to_on_policy:
            raise ValueError(
                f"algo.tail_batching applies where the run generates on-policy: algo.mode on_policy, or rollverify "
                f"with algo.conditional_switch (what it switches to), or the asynchronous schedule's fallback; "
                f"algo.mode {self.mode!r} never does: set algo.tail_batching=false"
            )
        if self.schedule == "async" and self.mode not in ASYNC_MODES:
            raise ValueError(
                f"algo.mode {self.mode!r} has no meaning in algo.schedule: async (the trainer takes whatever groups "
                f"finished; nothing waits for a phase): use algo.mode rollverify (every trained token verified) or "
                f"partial (the unverified asynchronous baseline, bounded by algo.max_staleness), or "
                f"algo.schedule=alternating"
            )

    @property
    def falls_to_on_policy(self) -> bool:
        """Whether the run ever generates on-policy: the mode, the alternating switch's or the async fallback's."""
        return self.mode == "on_policy" or (self.mode == "rollverify" and self.conditional_switch)


@dataclass
class VerifyOutcome:
    """Keep lengths for the carried-over responses (aligned with the input order) and the step's stats;
    lengths count every token (environment ones included), the stats count policy tokens unless named env."""

    response_ids: list[str]
    lengths: np.ndarray  # [R] int64 tokens before
    keep_lengths: np.ndarray  # [R] int64 tokens to keep
    stats: dict[str, float]
    switched: bool = False
    switch_reason: str | None = None

    @property
    def decisions(self) -> dict[str, int]:
        """response_id -> keep length: the truncation decisions sent to the engines."""
        return dict(zip(self.response_ids, self.keep_lengths.tolist(), strict=True))


@dataclass
class ConditionalSwitch:
    """Switch to on_policy once the estimated acceptance rate falls below tau.

    ``window``: the mean of the last W acceptance rates, once W have been seen. ``ema``: an exponential
    moving average (weight ``ema_alpha`` on the newest), also only after W updates.
    """

    window: int = 8
    tau: float = 0.5
    estimator: str = "window"
    ema_alpha: float = 0.2
    history: list[float] = field(default_factory=list)
    ema: float | None = None
    updates: int = 0
    switched: bool = False
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")

    @property
    def estimate(self) -> float | None:
        if not self.updates:
            return None
        return float(np.mean(self.history)) if self.estimator == "window" else self.ema

    def update(self, acceptance_rate: float) -> bool:
        """Record one verification's acceptance rate; True exactly when this update switches."""
        if not 0 <= acceptance_rate <= 1:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate!r}")
        if self.switched:
            return False
        self.updates += 1
        self.history = [*self.history, float(acceptance_rate)][-self.window :]
        a = self.ema_alpha
        self.ema = acceptance_rate if self.ema is None else a * acceptance_rate + (1 - a) * self.ema
        estimate = self.estimate
        if self.updates >= self.window and estimate < self.tau:
            self.switched = True
            self.reason = (
                f"{self.estimator} acceptance estimate {estimate:.4f} < tau {self.tau} "
                f"after {self.updates} verifications (window {self.window})"
            )
            return True
        return False

    def would_switch(self, acceptance_rate: float) -> bool:
        """Whether `update(acceptance_rate)` would switch, leaving this switch as it is."""
        return ConditionalSwitch.from_state(self.to_state()).update(acceptance_rate)

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ConditionalSwitch:
        return cls(**state)


class Strategy:
    """Base: subclasses decide keep lengths; the base packs inputs, computes token OPS (once, when new
    log-probs are given) and the common stats."""

    mode = ""
    carries_over = True  # False: the rollout phase waits for every launched group
    needs_new_logprobs = False  # True: the trainer must compute new log-probs of carried-over tokens

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)

    def observe_floor(self, mismatch_ops_mean: float | None) -> None:
        """The latest optimizer step's same-version engine/trainer mismatch (mean OPS of the tokens sampled by
        the weights the trainer held); only thresholds set from the drift read it."""

    def apply(
        self, responses: Sequence[Response], new_logprobs: NewLogprobs = None, policy_version: int = 0
    ) -> VerifyOutcome:
        """Decide what to keep of each carried-over response, checked against ``policy_version``.

        new_logprobs: the trainer's log-probs of each response's tokens under the new policy, one array per
        response over all its tokens (or packed over all of them); required when ``needs_new_logprobs``,
        optional otherwise. Only the policy tokens' are read. When given, the token OPS D is computed here,
        once: the strategy decides from it and the stats report its mean over the finite values as ``ops_mean``.
        """
        batch = VerifyBatch.from_responses(responses, self.device)
        ops = new = None
        if new_logprobs is not None or self.needs_new_logprobs:
            new = batch.policy_only(_pack_new_logprobs(new_logprobs, batch))
            ops = token_ops(batch.logprobs, new)
        keep, stats, segments = self._decide(batch, new, ops, responses, policy_version)
        full_keep = batch.full_keep(keep.to(torch.int64)).cpu().numpy().astype(np.int64)
        lengths, keep = batch.lengths.cpu().numpy(), keep.cpu().numpy().astype(np.int64)
        full = batch.full_lengths.cpu().numpy()
        stats = {**_common_stats(responses, lengths, keep, policy_version), **_env_stats(full - lengths,
                 full_keep - keep), **_token_ops_stats(ops), **_drift(batch, ops, segments, policy_version), **stats}
        return VerifyOutcome(batch.response_ids, full, full_keep, stats)

    def _keep(
        self, batch: VerifyBatch, ops: Tensor | None, responses: Sequence[Response], version: int
    ) -> tuple[Tensor, dict[str, float]]:
        """Keep lengths [R] and the strategy's own stats; ``ops`` is the packed token OPS [N] or None."""
        raise NotImplementedError

    def _decide(
        self, batch: VerifyBatch, new: Tensor | None, ops: Tensor | None, responses: Sequence[Response], version: int
    ) -> tuple[Tensor, dict[str, float], VerifyResult | None]:
        """`_keep`, for strategies that also read the packed new log-probs ``new`` [N] (None when not given) or
        verify: the third item is their verification's result, whose segments the drift statistics reuse."""
        return *self._keep(batch, ops, responses, version), None

    def to_state(self) -> dict[str, Any]:
        """JSON-able state for checkpoints (only conditional switching has any)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        pass


class OnPolicy(Strategy):
    """Nothing is carried over; anything handed in anyway restarts from its prompt."""

    mode = "on_policy"
    carries_over = False

    def _keep(self, batch, ops, responses, version):
        return torch.zeros_like(batch.lengths), {}


class Partial(Strategy):
    """Plain partial rollout: keep every token, unverified."""

    mode = "partial"

    def _keep(self, batch, ops, responses, version):
        return batch.lengths, {}


class StalenessFilter(Strategy):
    """Restart responses whose staleness (version - min token version) exceeds S."""

    mode = "staleness_filter"

    def __init__(self, staleness_s: int, device: str | torch.device = "cpu") -> None:
        super().__init__(device)
        self.staleness_s = staleness_s

    def _keep(self, batch, ops, responses, version):
        stale = torch.tensor([r.staleness(version) > self.staleness_s for r in responses], dtype=torch.bool)
        return torch.where(stale.to(batch.lengths.device), 0, batch.lengths), {}


class OpsFilter(Strategy):
    """Restart responses whose whole-response mean OPS D(tau) >= gamma."""

    mode = "ops_filter"
    needs_new_logprobs = True

    def __init__(self, ops_gamma: float, device: str | torch.device = "cpu") -> None:
        super().__init__(device)
        self.ops_gamma = ops_gamma

    def _decide(self, batch, new, ops, responses, version):
        result = two_stage_verify_ops(ops, batch.versions, batch.lengths, math.inf, math.inf)
        drop = result.response_mean_ops >= self.ops_gamma
        return torch.where(drop, 0, batch.lengths), _ops_stats(result), result


class RollVerify(Strategy):
    """Keep each response's two-stage verified prefix (a stage is off when its threshold is inf). A threshold
    "auto" is set every verification from the drift it measures (`AutoThresholds`), before it verifies."""

    mode = "rollverify"
    needs_new_logprobs = True

    def __init__(self, d_s: float | str = D_S, d_t: float | str = D_T, device: str | torch.device = "cpu") -> None:
        super().__init__(device)
        self.d_s, self.d_t = d_s, d_t
        self.auto = None
        if AUTO in (d_s, d_t):
            self.auto = AutoThresholds(auto_s=d_s == AUTO, auto_t=d_t == AUTO, d_s=0.0 if d_s == AUTO else d_s,
                                       d_t=0.0 if d_t == AUTO else d_t)

    def observe_floor(self, mismatch_ops_mean):
        if self.auto is not None:
            self.auto.observe_floor(mismatch_ops_mean)

    def _decide(self, batch, new, ops, responses, version):
        if self.auto is None:
            result = two_stage_verify_ops(ops, batch.versions, batch.lengths, self.d_s, self.d_t)
            return result.keep_lengths, _ops_stats(result), result
        used = self.auto.update(ops, batch.versions, version)
        result = two_stage_verify_ops(ops, batch.versions, batch.lengths, used.d_s, used.d_t,
                                      seq_margin=used.seq_margin)
        return result.keep_lengths, {**_ops_stats(result), **self.auto.stats(used)}, result

    def to_state(self) -> dict[str, Any]:
        return {"auto": self.auto.to_state()} if self.auto is not None else {}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.auto is not None and "auto" in state:
            self.auto = AutoThresholds.from_state(state["auto"])


class SpecCut(Strategy):
    """SPEC-RL's cut of a previous response (ShopeeLLM/Spec-RL, `verl/utils/speculative_decoding.py`,
    ``spec_cut`` and ``spec_cut_with_knobs``), applied to carried-over responses: with delta = lp_new - lp_old
    per token and delta' = scale (delta + lenience), a token is accepted when delta' >= 0 or log U <= delta'
    (U uniform on (0, 1): probability min(1, exp(delta'))) and, with p_min > 0, only where lp_new >= log p_min;
    the response keeps the prefix before its first rejected token and regenerates from there. lenience is
    SPEC-RL's ``spec_bias`` (its trainer passes -|bias| as ``bias``: more lenient), scale its ``scale``. A
    non-finite delta is a rejection. The draws come from a generator seeded by (seed, policy version), one per
    carried token in the batch's order, so a run is reproducible."""

    mode = "spec_rl"
    needs_new_logprobs = True

    def __init__(self, lenience: float = 0.0, scale: float = 1.0, p_min: float = 0.0, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(device)
        self.lenience, self.scale, self.p_min, self.seed = lenience, scale, p_min, seed

    def _decide(self, batch, new, ops, responses, version):
        g = torch.Generator(device="cpu").manual_seed((self.seed * 1_000_003 + version) % 2**63)
        u = torch.rand(batch.num_tokens, generator=g, dtype=torch.float64).clamp_min(1e-12).to(new.device)
        delta = self.scale * ((new.double() - batch.logprobs.double()) + self.lenience)
        accept = torch.isfinite(delta) & ((delta >= 0) | (torch.log(u) <= delta))
        if self.p_min > 0:
            accept &= new.double() >= math.log(self.p_min)
        keep = first_false(accept, batch.lengths)
        return keep, {"spec_rejected_tokens": float((~accept).sum()),
                      "spec_accept_prob_mean": float(torch.exp(delta.clamp(max=0)).nan_to_num(0.0).mean())
                      if batch.num_tokens else 1.0}, None


def first_false(flags: Tensor, lengths: Tensor) -> Tensor:
    """Per response (``lengths`` [R] laid end to end over ``flags`` [N]), the index of its first False flag,
    or its length when every flag is True: the length of its all-True prefix."""
    if flags.numel() == 0:
        return torch.zeros_like(lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    pos = torch.arange(flags.numel(), device=flags.device) - starts[owner]
    pos = torch.where(flags, torch.iinfo(torch.int64).max, pos)
    first = torch.full_like(lengths, torch.iinfo(torch.int64).max).scatter_reduce(0, owner, pos, "amin")
    return torch.minimum(first, lengths)


class Switching(Strategy):
    """Wraps a carry-over strategy; after ``switch`` fires it behaves as on_policy for the rest of the run.

    The verification that triggers the switch still applies; the loop then keeps the verified prefixes of
    the B groups the next (on-policy) step completes and sends the rest of the backlog back to its prompts.
    """

    def __init__(self, inner: Strategy, switch: ConditionalSwitch) -> None:
        super().__init__(inner.device)
        self.inner, self.switch = inner, switch
        self.needs_new_logprobs = inner.needs_new_logprobs

    def observe_floor(self, mismatch_ops_mean):
        self.inner.observe_floor(mismatch_ops_mean)

    @property
    def mode(self) -> str:  # type: ignore[override]
        return OnPolicy.mode if self.switch.switched else self.inner.mode

    @property
    def carries_over(self) -> bool:  # type: ignore[override]
        return not self.switch.switched and self.inner.carries_over

    def apply(self, responses, new_logprobs=None, policy_version=0):
        if self.switch.switched:
            # on_policy's outcome under the wrapped strategy's statistics: the stages' figures stay in every
            # record, NaN (they judged nothing)
            outcome = OnPolicy(self.device).apply(responses, new_logprobs, policy_version)
            empty = self.inner.apply([], [] if self.inner.needs_new_logprobs else None, policy_version)
            outcome.stats = {**{k: float("nan") for k in empty.stats}, **outcome.stats}
        else:
            outcome = self.inner.apply(responses, new_logprobs, policy_version)
        if not self.switch.switched and outcome.stats["verified_tokens"] > 0 \
                and self.switch.update(outcome.stats["acceptance_rate"]):
            outcome.switched, outcome.switch_reason = True, self.switch.reason
        outcome.stats["switch_estimate"] = self.switch.estimate if self.switch.updates else float("nan")
        outcome.stats["switched"] = float(self.switch.switched)
        return outcome

    def to_state(self) -> dict[str, Any]:
        return {"switch": self.switch.to_state(), **({"inner": inner} if (inner := self.inner.to_state()) else {})}

    def load_state(self, state: dict[str, Any]) -> None:
        self.switch = ConditionalSwitch.from_state(state["switch"])
        self.inner.load_state(state.get("inner", {}))


def make_strategy(mode: str | None = None, cfg: AlgoConfig | None = None, device: str = "cpu") -> Strategy:
    """The strategy for ``mode`` (default ``cfg.mode``) with the settings of ``cfg``."""
    cfg = cfg or AlgoConfig()
    mode = mode or cfg.mode
    if mode == "on_policy":
        return OnPolicy(device)
    if mode == "partial":
        return Partial(device)
    if mode == "staleness_filter":
        return StalenessFilter(cfg.staleness_s, device)
    if mode == "ops_filter":
        return OpsFilter(cfg.ops_gamma, device)
    if mode == "spec_rl":
        return SpecCut(cfg.spec_lenience, cfg.spec_scale, cfg.spec_p_min, cfg.spec_seed, device)
    if mode == "rollverify":
        d_s = parse_threshold(cfg.d_s, "d_s") if cfg.seq_stage else math.inf
        d_t = parse_threshold(cfg.d_t, "d_t") if cfg.token_stage else math.inf
        strategy = RollVerify(d_s, d_t, device)
        if not cfg.conditional_switch:
            return strategy
        switch = ConditionalSwitch(cfg.switch_window, cfg.switch_tau, cfg.switch_estimator, cfg.ema_alpha)
        return Switching(strategy, switch)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


# --- helpers ----------------------------------------------------------------------------------------------


def _pack_new_logprobs(new_logprobs: NewLogprobs, batch: VerifyBatch) -> Tensor:
    if new_logprobs is None:
        raise ValueError("new_logprobs are required: one array of new-policy log-probs per carried-over response")
    if isinstance(new_logprobs, Tensor):
        packed = new_logprobs
    else:
        if len(new_logprobs) != len(batch.response_ids):
            raise ValueError(
                f"new_logprobs must hold one array per response ({len(batch.response_ids)}), got {len(new_logprobs)}"
            )
        lens = [len(x) for x in new_logprobs]
        if lens != batch.full_lengths.tolist():
            bad = next(i for i, (a, b) in enumerate(zip(lens, batch.full_lengths.tolist(), strict=True)) if a != b)
            raise ValueError(
                f"new_logprobs[{bad}] ({batch.response_ids[bad]}) must have one value per generated token "
                f"({batch.full_lengths[bad]}), got {lens[bad]}"
            )
        arrays = [torch.as_tensor(x, dtype=torch.float32).reshape(-1) for x in new_logprobs]
        packed = torch.cat(arrays) if arrays else torch.zeros(0)
    total = int(batch.full_lengths.sum())
    if packed.shape != (total,):
        raise ValueError(f"packed new_logprobs must be [N={total}] (every token of the responses), "
                         f"got {tuple(packed.shape)}")
    return packed.to(device=batch.logprobs.device, dtype=torch.float32)


def _common_stats(
    responses: Sequence[Response], lengths: np.ndarray, keep: np.ndarray, version: int
) -> dict[str, float]:
    """Counts over the verified responses; a rate or staleness over none is NaN (nothing to measure)."""
    verified, kept = int(lengths.sum()), int(keep.sum())
    staleness = np.array([r.staleness(version) for r in responses if r.num_tokens], dtype=np.float64)
    nonempty = lengths > 0
    nan = float("nan")
    return {
        "responses": float(len(responses)),
        "verified_tokens": float(verified),
        "kept_tokens": float(kept),
        "acceptance_rate": kept / verified if verified else nan,
        "kept_whole_rate": float(np.mean(keep[nonempty] == lengths[nonempty])) if nonempty.any() else nan,
        "restarted": float(np.sum(nonempty & (keep == 0))),
        "truncated": float(np.sum((keep > 0) & (keep < lengths))),
        "staleness_mean": float(staleness.mean()) if len(staleness) else nan,
        "staleness_max": float(staleness.max()) if len(staleness) else nan,
    }


def _env_stats(env: np.ndarray, env_kept: np.ndarray) -> dict[str, float]:
    """Environment tokens of the verified responses and how many the cuts kept (a cut removes those after it)."""
    return {"env_tokens": float(env.sum()), "env_kept_tokens": float(env_kept.sum())}


def _drift(batch: VerifyBatch, ops: Tensor | None, segments: VerifyResult | None, version: int) -> dict[str, float]:
    """Drift by age and the what-if acceptance curve (rollverify/calibration.py) whenever OPS was computed, over
    the segments of the strategy's own verification when it ran one."""
    if ops is None or not batch.num_tokens:
        return empty_drift_stats()
    if segments is None:
        segments = two_stage_verify_ops(ops, batch.versions, batch.lengths, math.inf, math.inf)
    return drift_stats(ops, batch.versions, segments, version)


def _token_ops_stats(ops: Tensor | None) -> dict[str, float]:
    """Mean token OPS of the carried tokens over the finite values (NaN when there are none or no OPS)."""
    if ops is None:
        return {}
    finite = ops[torch.isfinite(ops)]
    return {"ops_mean": float(finite.mean()) if finite.numel() else float("nan")}


def _ops_stats(result: VerifyResult) -> dict[str, float]:
    """OPS of the verified responses (means over finite values; non-finite ones are counted)."""
    resp = result.response_mean_ops[result.lengths > 0]
    finite = resp[torch.isfinite(resp)]
    seg = result.segment_mean_ops
    return {
        "ops_response_mean": float(finite.mean()) if finite.numel() else float("nan"),
        "ops_response_max": float(finite.max()) if finite.numel() else float("nan"),
        "ops_nonfinite_responses": float(resp.numel() - finite.numel()),
        "ops_segment_mean": float(seg[torch.isfinite(seg)].mean()) if seg.numel() else float("nan"),
        "segments": float(seg.numel()),
        "cut_by_seq_stage": float((result.seq_keep_lengths < result.lengths).sum()),
        "cut_by_token_stage": float((result.keep_lengths < result.seq_keep_lengths).sum()),
    }
