"""The asynchronous schedule's conditional fallback: from `AsyncLoop` to the alternating `Loop`.

Once the acceptance the async steps measured stays low (the switch fires), the run continues on the alternating
loop (`algo.fallback: alternating`, with a fresh switch of its own) or on-policy (`on_policy`). `handover` stops
new launches, pauses the engines, verifies every carried response (the queue's and the in-flight ones) against
the current policy with the trainer's log-probs and cuts it to its verified prefix, so that the alternating
loop starts from the state its own verification would have left; for on_policy it then sends every group but
the B the next step completes back to its prompt, off the engines (as the alternating loop's own switch does).
The `Loop` then owns the same buffer and ledger.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rollverify.loop import Loop, shelve_backlog

if TYPE_CHECKING:
    from rollverify.async_loop import AsyncLoop


def fallback_loop(run: AsyncLoop, mode: str) -> Loop:
    """The alternating loop over `run`'s engine, trainer and weights: `mode` alternating keeps `algo.mode`
    (a rollverify run gets a fresh conditional switch), on_policy runs on_policy."""
    algo = replace(run.algo, schedule="alternating", mode="on_policy" if mode == "on_policy" else run.algo.mode)
    return Loop(run.cfg, algo, run.engine, run.trainer, run.make_group, run.reward, weights=run.weights)


def handover(run: AsyncLoop) -> Loop:
    """Stop `run`'s asynchronous schedule between steps and return the loop that continues it (see the module
    docstring)."""
    engine, buffer, ledger, feed = run.engine, run.buffer, run.ledger, run.feed
    feed.launching = False
    feed.record(engine.pause())
    feed.record(engine.wait_finished(0.0))
    feed.resubmit_lost()
    carried = buffer.carried_over()
    if carried:
        lps = run.trainer.compute_logprobs(carried, run.cfg.temperature)
        outcome = run.verifier.apply(carried, lps, run.version)
        cuts = {rid: k for rid, k in outcome.decisions.items() if k < buffer.get(rid).num_tokens}
        ledger.cut(buffer.apply_truncation(cuts))
        ledger.restarted += sum(1 for k in cuts.values() if k == 0)
        tracked = engine.response_ids()
        if on_engine := {rid: k for rid, k in cuts.items() if rid in tracked}:
            engine.truncate(on_engine)
    if run.algo.fallback == "on_policy":
        shelved, cut, restarted = shelve_backlog(buffer, run.cfg.batch_groups)
        ledger.cut(cut)
        ledger.restarted += restarted
        if off := shelved & engine.response_ids():
            engine.drop(sorted(off))
    loop = fallback_loop(run, run.algo.fallback)
    loop.buffer, loop.ledger = buffer, ledger
    loop.step, loop.version, loop.next_group_id = run.step, run.version, run.next_group_id
    ledger.check(buffer)
    return loop
