"""The simulated SGLang servers behind `SimEngine`: each server's running batch, waiting queue and KV pool, and
the decode iterations between two events.

A server holds at most `CostModel.kv_capacity_tokens` tokens of KV (SGLang's ``max_total_num_tokens``) and
schedules as SGLang 0.5.23's scheduler does (managers/schedule_policy.py `PrefillAdder.add_one_req`,
managers/schedule_batch.py `retract_decode`, scheduler_components/new_token_ratio_tracker.py):

* a request waits in its server's queue, first come first served, until ``extend + min(max_new - output, CLIP)``
  is below the free KV less what the running requests are expected to still decode (``min(max_new - output,
  CLIP) x new_token_ratio`` each) and less what this admission pass has reserved already;
* when the next decode iteration does not fit, requests are retracted, the one with the fewest output tokens
  first (the longest input among equals), until it fits; a retracted request's KV is freed, it goes to the back
  of the queue and prefills its whole context again when admitted (``retract_prefill_s``);
* ``new_token_ratio`` starts at 0.7 on an idle server, falls by (0.7 - 0.098) / 600 per decode iteration to
  0.098, and after a retraction is set to (outputs + 20 per request) / (max_new_tokens + 1) of those left.

KV a server holds for a sequence that is not running (a turn waiting on a tool call, a verification's prefill)
sits in its radix cache: reused when the sequence comes back to that server, evictable meanwhile, so it takes
no room from the pool. Placement is least-loaded over running plus waiting requests.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from rollverify.sim.cost import (
    SGLANG_CLIP_MAX_NEW_TOKENS,
    SGLANG_INIT_NEW_TOKEN_RATIO,
    SGLANG_MIN_NEW_TOKEN_RATIO,
    SGLANG_NEW_TOKEN_RATIO_DECAY,
    SGLANG_RETRACT_DECODE_STEPS,
    CostModel,
)


@dataclass
class Tracked:
    group_id: int
    index: int
    prompt: int  # prompt tokens
    target: int  # units it reaches uncut
    length: int  # units generated (kept)
    reported: int  # units already returned in chunks
    limit: int = 0  # real tokens of its context at max_new_tokens (prompt + max_new_tokens units)
    slot: int = -1  # running slot, -1 when waiting, paused or finished
    queued: int = -1  # the server whose waiting queue holds it, -1 when none
    base: int = 0  # units it held when it reached its server (SGLang's input; what follows is its output)
    retracted: bool = False  # its KV was freed by a retraction: the next admission prefills it whole
    done: bool = False
    cache_server: int = -1  # server holding its prefilled KV under the current weights, -1 when none
    cached: int = 0  # real tokens of that KV (prompt + generated)
    calls: tuple[int, ...] = ()  # the units after which it calls a tool (ToolModel)
    wake: float | None = None  # waiting on a call: when it returns

    def stop_at(self) -> int:
        """Units at which its run ends: its next call, or its target."""
        return next((b for b in self.calls if b > self.length), self.target)


class Servers:
    """``cost.cluster.servers`` independent servers of ``cost.kv_capacity_tokens()`` tokens each (``capacity``
    overrides it; math.inf: no limit). Every running sequence gains one unit (``unit`` real tokens) per unit of
    decode iterations of its server; `decode` advances to the next event in closed form."""

    def __init__(self, cost: CostModel, unit: int, capacity: float | None = None) -> None:
        self.cost, self.unit = cost, unit
        self.n = cost.cluster.servers
        self.capacity = float(cost.kv_capacity_tokens() if capacity is None else capacity)
        self.credit = np.zeros(self.n)  # seconds a server has already spent towards its next iteration
        self.used = np.zeros(self.n)  # KV tokens of its running sequences
        self.nrun = np.zeros(self.n, np.int64)
        self.ratio = np.full(self.n, SGLANG_INIT_NEW_TOKEN_RATIO)
        self.queues: list[deque[tuple[str, Tracked]]] = [deque() for _ in range(self.n)]
        self.prefill_s = 0.0  # server-seconds of prefill on admission (retractions' included)
        self.retract_prefill_s = 0.0  # of which: retracted sequences prefilling their context again
        self.decode_iterations = 0.0  # server-iterations (real tokens of the longest running sequence)
        self.retractions = 0
        self.retracted_tokens = 0.0  # KV tokens those retractions freed (prefilled again on re-admission)
        self.admissions = 0
        self.queued_request_s = 0.0  # request-seconds spent waiting in a queue
        self.kv_peak = 0.0  # the largest share of a server's pool its running sequences held
        self._cap = 0
        self._grow(1024)

    # --- slots of running sequences ---------------------------------------------------------------------------

    def _grow(self, cap: int) -> None:
        old, self._cap = self._cap, cap

        def more(name: str, dtype) -> np.ndarray:
            return np.concatenate([getattr(self, name, np.zeros(0, dtype)), np.zeros(cap - old, dtype)])

        self.srv, self.rem = more("srv", np.int64), more("rem", np.int64)
        self.ctx, self.limit, self.base_ctx = more("ctx", np.float64), more("limit", np.float64), more("base_ctx", np.float64)
        self.active = more("active", bool)
        self.slot_rid: list[str | None] = [*getattr(self, "slot_rid", []), *([None] * (cap - old))]
        self.free = [*getattr(self, "free", []), *range(cap - 1, old - 1, -1)]

    def running(self, server: int) -> np.ndarray:
        return np.flatnonzero(self.active & (self.srv == server))

    def waiting(self) -> int:
        return sum(len(q) for q in self.queues)

    def place(self, rid: str, t: Tracked) -> None:
        """Queue a sequence on the server holding its KV, else on the least loaded (`fill_all` then admits what
        fits: the sequences that arrive together meet one admission pass, as in SGLang's waiting queue)."""
        if t.cache_server >= 0:
            server = t.cache_server
        else:
            server = int(np.argmin(self.nrun + np.array([len(q) for q in self.queues])))
        if not t.retracted:
            t.base = t.length
        t.queued = server
        self.queues[server].append((rid, t))

    def unqueue(self, t: Tracked) -> None:
        if t.queued >= 0:
            self.queues[t.queued] = deque(e for e in self.queues[t.queued] if e[1] is not t)
            t.queued = -1

    def clear(self) -> None:
        """Every queue emptied (a pause): the sequences wait off the servers, their estimates reset."""
        for q in self.queues:
            for _, t in q:
                t.queued = -1
            q.clear()
        self.ratio[:] = SGLANG_INIT_NEW_TOKEN_RATIO
        self.credit[:] = 0.0

    def fill_all(self) -> None:
        """An admission pass on every server with a waiting queue."""
        waiting = [i for i, q in enumerate(self.queues) if q]
        if not waiting:
            return
        reserve = np.zeros(self.n)
        if math.isfinite(self.capacity):  # what the running requests are expected to still decode
            act = np.flatnonzero(self.active)
            left = np.minimum(self.limit[act] - self.ctx[act], SGLANG_CLIP_MAX_NEW_TOKENS)
            reserve = np.bincount(self.srv[act], weights=left, minlength=self.n)
        for s in waiting:
            self._fill(s, float(reserve[s]))

    def fill(self, server: int) -> None:
        on = self.running(server)
        left = np.minimum(self.limit[on] - self.ctx[on], SGLANG_CLIP_MAX_NEW_TOKENS)
        self._fill(server, float(left.sum()))

    def _fill(self, server: int, reserve: float) -> None:
        """One admission pass of SGLang's PrefillAdder over the server's queue, in order, stopping at the first
        request that does not fit; ``reserve``: the running requests' min(max_new - output, CLIP), summed. A
        server with nothing running admits its first request whatever its size (SGLang's chunked prefill makes
        progress on an idle pool)."""
        q = self.queues[server]
        if not q:
            return
        first = self.nrun[server] == 0
        if first:
            self.ratio[server] = SGLANG_INIT_NEW_TOKEN_RATIO  # an idle scheduler resets its estimate
        free = self.capacity - self.used[server] - reserve * self.ratio[server]
        u = self.unit
        while q:
            rid, t = q[0]
            context = t.prompt + t.length * u
            extend = context - (min(t.cached, context) if t.cache_server == server else 0)
            max_new = min(t.limit - context, SGLANG_CLIP_MAX_NEW_TOKENS)
            if not first and not extend + max_new < free:
                break
            first = False
            free -= extend + 1 + max_new  # reserved for this pass at the full clipped max_new
            q.popleft()
            self._start(rid, t, server, context)

    def _start(self, rid: str, t: Tracked, server: int, context: int) -> None:
        if not self.free:
            self._grow(2 * self._cap)
        slot = self.free.pop()
        self.srv[slot], self.rem[slot], self.ctx[slot], self.active[slot] = server, t.stop_at() - t.length, context, True
        self.limit[slot], self.base_ctx[slot] = t.limit, t.prompt + t.base * self.unit
        self.slot_rid[slot], t.slot, t.queued = rid, slot, -1
        cached = min(t.cached, context) if t.cache_server == server else 0  # the radix cache's prefix
        prefill = self.cost.prefill(context) - self.cost.prefill(cached)
        t.cache_server, t.cached = -1, 0
        self.credit[server] -= prefill
        self.prefill_s += prefill
        if t.retracted:
            self.retract_prefill_s += prefill
            t.retracted = False
        self.used[server] += context
        self.nrun[server] += 1
        self.admissions += 1

    def release(self, t: Tracked) -> tuple[int, float]:
        """Take a running sequence off its server (its generated units recorded); returns its server and
        context."""
        slot = t.slot
        server, context = int(self.srv[slot]), float(self.ctx[slot])
        t.length = t.stop_at() - int(self.rem[slot])
        self.active[slot] = False
        self.slot_rid[slot] = None
        self.free.append(slot)
        self.used[server] -= context
        self.nrun[server] -= 1
        t.slot = -1
        return server, context

    # --- retraction --------------------------------------------------------------------------------------------

    def retract(self, tracked: dict[str, Tracked]) -> None:
        """On every server whose next unit of decode iterations does not fit, SGLang's `retract_decode`."""
        if not math.isfinite(self.capacity):
            return
        u = self.unit
        for server in np.flatnonzero(self.capacity - self.used < self.nrun * u):
            on = self.running(int(server))
            out = self.ctx[on] - self.base_ctx[on]
            order = on[np.lexsort((-self.base_ctx[on], out))]  # fewest outputs first, longest input among equals
            for i, slot in enumerate(order):
                if i and self.capacity - self.used[server] >= self.nrun[server] * u:
                    break
                if self.nrun[server] == 1:
                    raise RuntimeError(f"server {server}: one sequence of {self.ctx[slot]:.0f} tokens exceeds its KV "
                                       f"pool of {self.capacity:.0f} tokens")
                rid = self.slot_rid[slot]
                t = tracked[rid]
                _, context = self.release(t)
                t.retracted, t.cache_server, t.cached = True, -1, 0
                t.queued = int(server)
                self.queues[server].append((rid, t))
                self.retractions += 1
                self.retracted_tokens += context
            left = self.running(int(server))
            out = float((self.ctx[left] - self.base_ctx[left]).sum())
            max_new = float((self.limit[left] - self.base_ctx[left]).sum())
            self.ratio[server] = min(1.0, (out + SGLANG_RETRACT_DECODE_STEPS * left.size) / (max_new + 1))
            self.fill(int(server))

    # --- decode ----------------------------------------------------------------------------------------------

    def decode(self, limit: float) -> tuple[float, list[str]]:
        """Advance to the next moment a running sequence finishes or a server's pool fills, or by ``limit``
        seconds if that comes first; returns the seconds and the ids of the sequences that finished."""
        act = np.flatnonzero(self.active)
        srv, u = self.srv[act], self.unit
        b = np.bincount(srv, minlength=self.n).astype(np.float64)
        c = np.bincount(srv, weights=self.ctx[act], minlength=self.n)
        busy = b > 0
        # iteration time along a run of units is affine in the units done: alpha + beta * i (per unit of u tokens)
        alpha = self.cost.decode_iteration(b, c + b * (u - 1) / 2) * u
        beta = self.cost.decode_iteration(b, c + b * (u - 1) / 2 + b * u) * u - alpha
        first = np.full(self.n, np.iinfo(np.int64).max)
        np.minimum.at(first, srv, self.rem[act])
        m = np.where(busy, first, 0).astype(np.float64)
        if math.isfinite(self.capacity):  # units until the pool holds no further iteration
            with np.errstate(divide="ignore", invalid="ignore"):
                room = np.floor((self.capacity - self.used) / (b * u))
            m = np.where(busy, np.minimum(m, np.maximum(room, 0)), 0)
        need = m * alpha + beta * m * (m - 1) / 2 - self.credit
        dt = max(0.0, min(float(need[busy].min()), limit))
        avail = dt + self.credit
        k = _units_within(alpha, beta, avail)
        k = np.where(need <= dt, m, np.clip(k, 0, np.maximum(m - 1, 0)))  # those defining dt finish exactly
        k = np.where(busy, k, 0)
        # an idle server pays off prefill it owes as time passes, and banks no idle time
        self.credit = np.where(busy, avail - (k * alpha + beta * k * (k - 1) / 2), np.minimum(avail, 0.0))
        ki = k.astype(np.int64)
        self.rem[act] -= ki[srv]
        self.ctx[act] += ki[srv] * u
        self.used += k * b * u
        self.ratio = np.where(busy, np.maximum(self.ratio - k * u * SGLANG_NEW_TOKEN_RATIO_DECAY,
                                               SGLANG_MIN_NEW_TOKEN_RATIO), self.ratio)
        self.decode_iterations += float(k.sum()) * u
        self.queued_request_s += dt * self.waiting()
        if math.isfinite(self.capacity):
            self.kv_peak = max(self.kv_peak, float(self.used.max()) / self.capacity)
        return dt, [self.slot_rid[s] for s in act[self.rem[act] <= 0]]


def _units_within(alpha: np.ndarray, beta: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Largest k >= 0 with k * alpha + beta * k (k - 1) / 2 <= seconds (iteration times alpha + beta i)."""
    a = beta / 2
    b = alpha - beta / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        quad = (-b + np.sqrt(np.maximum(b * b + 4 * a * np.maximum(seconds, 0), 0))) / (2 * a)
        lin = np.maximum(seconds, 0) / alpha
    k = np.where(np.abs(a) > 1e-15 * np.maximum(alpha, 1e-30), quad, lin)
    return np.floor(np.nan_to_num(k, nan=0.0, posinf=0.0) + 1e-9)
