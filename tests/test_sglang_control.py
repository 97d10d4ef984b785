"""The control channel against the real SGLang engine on CPU (tiny dense and MoE models): pause, truncate,
resume, weight updates, routed experts, accounting at scale, bad input, authentication."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio
from engine_fixtures import hf_forward, reset_server, run, same_routes

from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model
from rollverify.buffer import RolloutBuffer
from rollverify.types import Group, Response
from sglang_ext.client import ControlError, CurveKeys, ServerConnection, SubmitRequest, _encode_submit
from sglang_ext.protocol import ErrorCode, WireSamplingParams, decode
from sglang_ext.rollout_engine import SGLangRolloutEngine

pytest_plugins = ["engine_fixtures"]  # the session servers, shared with the other sglang_ext tests
pytestmark = pytest.mark.engine

TOL = 1e-4


@pytest.fixture(params=["dense", "moe"])
def served(request):
    return request.getfixturevalue(f"{request.param}_server")


async def progress(c, min_tokens: int, timeout_s: float = 60.0) -> None:
    """Let the engine run until every live response holds at least `min_tokens`, pausing to look: first after
    20 ms, then at doubling intervals (up to 0.4 s), so a fast machine stops early instead of finishing them."""
    wait, deadline = 0.02, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(wait)
        await c.pause()
        live = [tr for tr in c.responses.values() if not tr.finished]
        if all(len(tr.token_ids) >= min_tokens for tr in live):
            return
        await c.resume()
        wait = min(2 * wait, 0.4)
    raise AssertionError(f"the engine made no progress in {timeout_s:.0f} s")


def check_hf(served, tr, temperature=1.0, model=None):
    lp, routes = hf_forward(model or served.model, tr.prompt_ids, tr.token_ids, temperature)
    assert np.abs(lp - tr.logprobs).max() <= TOL, f"{tr.rid}: max diff {np.abs(lp - tr.logprobs).max():.2e}"
    if served.kind == "moe":
        got = np.concatenate([tr.prompt_routed_experts, tr.routed_experts])
        assert got.shape[0] == len(tr.prompt_ids) + len(tr.token_ids) - 1
        assert same_routes(got, routes).all(), f"{tr.rid}: routes differ"
    return lp


def test_pause_returns_partial_outputs_equal_to_hf(served):
    async def main():
        await reset_server(served)
        async with served.client(poll_wait_s=0.2) as c:
            prompts = [[5, 6, 7], [30, 31, 32, 33, 34, 35, 36], [50], [70, 71, 72, 73]]
            await c.submit(
                [SubmitRequest(f"r{i}", p, 400, sampling={"ignore_eos": True}) for i, p in enumerate(prompts)]
            )
            await asyncio.sleep(0.5)
            deltas = await c.pause()
            assert set(deltas) == {"r0", "r1", "r2", "r3"} and all(not d.finished for d in deltas.values())
            assert all(d.offset == 0 for d in deltas.values())
            await c.resume()
            await progress(c, 4)  # several more pause/resume rounds: partial outputs accumulate
            outs, _ = await c.conn.fetch()
            for o in outs.outputs():
                tr = c.responses[o.rid]
                assert 4 <= len(tr.token_ids) < 400 and tr.finish_reason is None
                assert np.array_equal(o.token_ids, tr.token_ids) and np.array_equal(o.logprobs, tr.logprobs)
                assert len(tr.logprobs) == len(tr.versions) == len(tr.token_ids)
                check_hf(served, tr)

    run(main())


def test_truncate_then_resume_continues_from_the_kept_prefix(served):
    """Greedy: a response cut to k tokens and resumed equals continuous generation from that prefix."""

    async def main():
        await reset_server(served)
        greedy = {"temperature": 0.0, "ignore_eos": True}
        async with served.client(poll_wait_s=0.2) as c:
            await c.submit([SubmitRequest("ref", [9, 10, 11, 12], 40, sampling=greedy)])
            await c.next_finished(120)
            await c.submit(
                [SubmitRequest(f"cut{k}", [9, 10, 11, 12], 40, sampling=greedy) for k in ("0", "half")]
            )
            await progress(c, 6)
            n = len(c.responses["cuthalf"].token_ids)
            await c.truncate({"cut0": 0, "cuthalf": n // 2})
            assert len(c.responses["cut0"].token_ids) == 0 and len(c.responses["cuthalf"].token_ids) == n // 2
            await c.resume()
            for _ in range(2):
                await c.next_finished(120)
            ref = c.responses["ref"]
            for rid in ("cut0", "cuthalf"):
                tr = c.responses[rid]
                assert tr.finish_reason == "length" and np.array_equal(tr.token_ids, ref.token_ids)
                assert np.abs(tr.logprobs - ref.logprobs).max() <= TOL
                assert (tr.versions == 0).all()
                if served.kind == "moe":
                    assert same_routes(tr.routed_experts, ref.routed_experts).all()
                    assert np.array_equal(tr.prompt_routed_experts, ref.prompt_routed_experts)
                check_hf(served, tr, temperature=0.0)

    run(main())


def test_a_prefix_that_fills_its_budget_finishes_as_length_at_its_launch(dense_server):
    """A response paused with every budgeted token (SGLang's abort racing its length check), then checkpointed or
    moved off a lost server, is submitted whole: it finishes at its launch, keeping its tokens, generating none."""

    async def main():
        await reset_server(dense_server)
        async with dense_server.client(poll_wait_s=0.2) as c:
            await c.submit([SubmitRequest("full", [5, 6], 3, prefix_ids=[7, 8, 9])])
            out = await c.next_finished(60)
            tr = c.responses["full"]
            assert out.rid == "full" and len(out.token_ids) == 0  # nothing generated
            assert tr.finish_reason == "length" and tr.token_ids.tolist() == [7, 8, 9]
            await c.pause()  # a paused server holds it until the resume launches it
            await c.submit([SubmitRequest("held", [5, 6], 2, prefix_ids=[7, 8])])
            assert not c.responses["held"].finished
            await c.resume()
            out = await c.next_finished(60)
            tr = c.responses["held"]
            assert out.rid == "held" and tr.finish_reason == "length" and tr.token_ids.tolist() == [7, 8]

    run(main())


async def _finish_of(conn, rid: str, timeout_s: float = 60.0) -> list:
    """Poll the server's events, acknowledging none (as a driver killed meanwhile would have), until `rid`'s
    finish is there; its outputs."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, f"no finish of {rid} in {timeout_s:.0f} s"
        batch, _ = await conn.events(0, 1.0)
        if seen := [o for o in batch.outputs() if o.rid == rid]:
            return seen


def test_a_dropped_response_leaves_no_event_for_a_resubmitted_id(dense_server):
    """A killed driver's finished responses wait unacknowledged; the resumed driver drops them all and submits
    the same ids from its checkpoint: it reads only the new responses' finishes."""

    async def main():
        await reset_server(dense_server)
        async with dense_server.client(poll_wait_s=0.2) as c:
            conn = c.conn
            await conn.submit([SubmitRequest("d", [5, 6], 4, sampling={"ignore_eos": True})])
            seen = await _finish_of(conn, "d")
            assert seen[0].offset == 0 and len(seen[0].token_ids) == 4
            await conn.drop(all=True)
            batch, _ = await conn.events(0, 0.0)
            assert [o.rid for o in batch.outputs()] == []
            await conn.submit([SubmitRequest("d", [5, 6], 2, prefix_ids=[7], sampling={"ignore_eos": True})])
            seen = await _finish_of(conn, "d")
            assert [(o.offset, len(o.token_ids)) for o in seen] == [(1, 1)]

    run(main())


def test_a_reset_engine_reads_none_of_an_earlier_controllers_finishes(dense_server):
    """A driver killed with a finish unacknowledged; the resumed one connects (its feed delivers that finish at
    once), resets the server and submits the same id from its checkpoint: it reads only the new output."""

    async def earlier():
        await reset_server(dense_server)
        async with dense_server.client(poll_wait_s=0.2) as c:
            await c.conn.submit([SubmitRequest("0-0", [5, 6], 6, sampling={"ignore_eos": True})])
            await _finish_of(c.conn, "0-0")  # finished, read and never acknowledged

    run(earlier())
    with SGLangRolloutEngine([dense_server.endpoint], curve=dense_server.curve, poll_wait_s=0.1) as engine:
        deadline = time.monotonic() + 60
        while engine.pool.events.empty():  # the new feed has delivered the earlier finish
            assert time.monotonic() < deadline, "the feed delivered nothing in 60 s"
            time.sleep(0.02)
        engine.reset()
        response = Group.new(0, [5, 6], 1, 6).responses[0]
        response.append([7, 8], [-1.0, -1.0], 0)  # the checkpoint's copy: 2 tokens, unfinished
        engine.submit([response], WireSamplingParams(ignore_eos=True))
        chunks: list = []
        deadline = time.monotonic() + 60
        while not any(c.finish_reason for c in chunks):
            assert time.monotonic() < deadline, "no finish in 60 s"
            chunks += engine.wait_finished(1.0)
        assert [(c.response_id, c.offset, len(c.token_ids)) for c in chunks] == [("0-0", 2, 4)]
        engine.drop(["0-0"])


def test_a_weight_update_right_after_a_drop_waits_for_the_dropped_requests_to_end(dense_server):
    """Dropping running responses aborts their engine requests in the background; a weight load sent at once
    (a driver that restarts its trainer forgets its responses, then pushes) must meet an engine that runs none of
    them, or SGLang loads the weights and refuses to flush its cache."""

    async def main():
        await reset_server(dense_server)
        async with dense_server.client(poll_wait_s=0.2) as c:
            for round_ in range(3):
                reqs = [SubmitRequest(f"x{round_}-{i}", [30 + i, 31, 32], 400, sampling={"ignore_eos": True})
                        for i in range(8)]
                await c.submit(reqs)
                await progress(c, 2)
                await c.resume()  # every response is generating again
                await c.conn.drop(all=True)
                await c.update_weights_from_disk(dense_server.model, version=round_ + 1)
                assert (await c.health())["version"] == round_ + 1
            await c.submit([SubmitRequest("after", [40, 41, 42], 6, sampling={"ignore_eos": True})])
            await c.next_finished(120)
            tr = c.responses["after"]
            assert (tr.versions == 3).all()
            check_hf(dense_server, tr)

    run(main())


def _buckets(path, n=3):
    import torch
    from safetensors.numpy import load_file

    tensors = [
        (k, torch.from_numpy(v.copy())) for k, v in sorted(load_file(str(path / "model.safetensors")).items())
    ]
    return [tensors[i::n] for i in range(n)]


def test_weight_update_changes_later_logprobs_and_versions(dense_server):
    served = dense_server
    new_model = ensure_tiny_model(TinyModelSpec(seed=1))

    async def main():
        await reset_server(served)
        async with served.client(poll_wait_s=0.2) as c:
            reqs = [
                SubmitRequest(f"w{i}", [40 + i, 41, 42], 120, sampling={"ignore_eos": True}) for i in range(3)
            ]
            await c.submit(reqs)
            await progress(c, 3)
            before = {r.rid: len(c.responses[r.rid].token_ids) for r in reqs}
            assert all(k < 120 for k in before.values()), f"the scenario needs live responses: {before}"
            await c.update_weights(_buckets(new_model), version=1)  # three buckets, the last commits
            h = await c.health()
            assert h["version"] == 1
            await c.resume()
            for _ in reqs:
                await c.next_finished(120)
            for r in reqs:
                tr, k = c.responses[r.rid], before[r.rid]
                assert (
                    len(tr.token_ids) == 120 and (tr.versions[:k] == 0).all() and (tr.versions[k:] == 1).all()
                )
                old, _ = hf_forward(served.model, tr.prompt_ids, tr.token_ids)
                new, _ = hf_forward(new_model, tr.prompt_ids, tr.token_ids)
                assert np.abs(old[:k] - tr.logprobs[:k]).max() <= TOL  # kept tokens keep their log-probs
                assert np.abs(new[k:] - tr.logprobs[k:]).max() <= TOL  # later ones are the new policy's
                assert np.abs(old[k:] - tr.logprobs[k:]).max() > 1e-2
            # back to the base checkpoint, from disk, as version 2
            await c.pause()
            await c.update_weights_from_disk(served.model, version=2)
            await c.resume()
            await c.submit([SubmitRequest("after", [40, 41, 42], 12, sampling={"ignore_eos": True})])
            await c.next_finished(120)
            tr = c.responses["after"]
            assert (tr.versions == 2).all()
            check_hf(served, tr)

    run(main())


def test_routed_experts_keep_their_length_through_cycles(moe_server):
    served = moe_server
    rng = random.Random(1)

    async def main():
        await reset_server(served)
        async with served.client(poll_wait_s=0.2) as c:
            reqs = [
                SubmitRequest(f"m{i}", list(range(20, 20 + 2 + i)), 36, sampling={"ignore_eos": True})
                for i in range(5)
            ]
            await c.submit(reqs)
            for _ in range(3):
                await progress(c, 2)
                keep = {
                    rid: rng.choice([0, len(tr.token_ids) // 2, len(tr.token_ids)])
                    for rid, tr in c.responses.items()
                    if not tr.finished
                }
                await c.truncate(keep)
                outs, _ = await c.conn.fetch()
                for o in outs.outputs():
                    tr = c.responses[o.rid]
                    assert (
                        len(o.routed_experts)
                        == len(o.token_ids)
                        == len(tr.routed_experts)
                        == len(tr.token_ids)
                    )
                    assert np.array_equal(o.routed_experts, tr.routed_experts)
                await c.resume()
            while any(not tr.finished for tr in c.responses.values()):
                await c.next_finished(120)
            for r in reqs:
                tr = c.responses[r.rid]
                assert tr.routed_experts.shape == (36, 2, 2) and tr.prompt_routed_experts.shape == (
                    len(r.prompt_ids) - 1,
                    2,
                    2,
                )
                check_hf(served, tr)  # same weights throughout: spliced routes equal one HF forward's

    run(main())


def test_200_responses_through_5_cycles_exact_accounting(dense_server, moe_server):
    """Both servers behind one rollout engine, the loop's buffer as the controller's copy: nothing lost, nothing
    duplicated, server caches and buffer agree exactly."""
    rng = random.Random(0)
    servers = [dense_server, moe_server]
    for s in servers:
        run(reset_server(s))
    buffer = RolloutBuffer()
    for g in range(50):
        prompt = [rng.randrange(4, 128) for _ in range(rng.randint(2, 9))]
        buffer.add_group(Group(g, prompt, 4, [Response(g, i, prompt, rng.randint(8, 48)) for i in range(4)]))
    responses = [r for g in buffer.groups.values() for r in g.responses]
    delivered = cut = revived = 0
    finishes: dict[str, int] = {}

    def take(chunks):
        nonlocal delivered
        for c in chunks:
            buffer.record(c.response_id, c.token_ids, c.logprobs, c.versions, c.routed_experts,
                          finish_reason=c.finish_reason, offset=c.offset)  # checks offsets, lengths, budgets
            delivered += len(c.token_ids)
            if c.finish_reason is not None:
                finishes[c.response_id] = finishes.get(c.response_id, 0) + 1
        return chunks

    def fetch(s):
        async def main():
            conn = await ServerConnection(s.endpoint, curve=s.curve, timeout_s=60).start()
            try:
                return await conn.fetch()
            finally:
                await conn.close()

        return run(main())

    with SGLangRolloutEngine([s.endpoint for s in servers], curve=[s.curve for s in servers],
                             poll_wait_s=0.2) as engine:
        stats0 = [st["tokens_generated"] for st in engine.stats()]
        engine.submit(responses, WireSamplingParams(temperature=1.0))
        assert {s.index for s in engine.where.values()} == {0, 1}
        for cycle in range(5):
            time.sleep(0.3)
            deadline = time.monotonic() + 120
            while sum(finishes.values()) < 8 * (cycle + 1):  # some finish each cycle: revivals below
                assert time.monotonic() < deadline
                take(engine.wait_finished(1.0))
            for c in take(engine.pause()):
                assert c.finish_reason is None and finishes.get(c.response_id, 0) == 0, c.response_id
            take(engine.wait_finished(0.0))
            keep = {}
            for r in responses:
                if not r.finished and rng.random() < 0.5:
                    keep[r.response_id] = rng.randint(0, r.num_tokens)
                elif r.finished and rng.random() < 0.1 and r.num_tokens > 1:
                    keep[r.response_id] = r.num_tokens - 1  # a finished response cut short lives again
                    revived += 1
                    finishes[r.response_id] -= 1
            cut += buffer.apply_truncation(keep).total
            engine.truncate(keep)
            for i, s in enumerate(servers):
                batch, body = fetch(s)
                assert len(batch) == sum(1 for x in engine.where.values() if x.index == i)
                for o, state in zip(batch.outputs(), body["states"], strict=True):
                    r = buffer.get(o.rid)
                    assert np.array_equal(o.token_ids, r.token_ids) and np.array_equal(o.logprobs, r.logprobs)
                    assert np.array_equal(o.versions, r.versions)
                    assert (state == "finished") == r.finished
            engine.resume()
        deadline = time.monotonic() + 120
        while sum(finishes.values()) < len(responses):
            assert time.monotonic() < deadline
            take(engine.wait_finished(1.0))
        time.sleep(0.3)
        take(engine.wait_finished(0.0))
        assert all(v == 1 for v in finishes.values()) and len(finishes) == len(responses)
        generated = sum(st["tokens_generated"] for st in engine.stats()) - sum(stats0)
        assert generated == delivered, "every generated token reached the controller exactly once"
        assert delivered - cut == sum(r.num_tokens for r in responses)
        for r in responses:
            assert len(r.logprobs) == len(r.versions) == r.num_tokens <= r.max_new_tokens
            assert (r.finish_reason == "length") == (r.num_tokens == r.max_new_tokens) or r.token_ids[-1] == 1
            assert np.isfinite(r.logprobs).all() and (r.logprobs <= 0).all()
        assert revived > 0
        engine.drop([r.response_id for r in responses])
        assert all(st["live"] == 0 and st["finished"] == 0 for st in engine.stats())


# ---------------------------------------------------------------------------------------------- bad input


async def _raw(served, frames: list[bytes]):
    """Send hand-made frames on a fresh authenticated socket and decode the reply."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if served.curve is not None:
        sock.curve_serverkey = served.curve.server_public_key
        sock.curve_publickey = served.curve.client_public_key
        sock.curve_secretkey = served.curve.client_secret_key
    sock.connect(served.endpoint)
    try:
        await sock.send_multipart(frames)
        reply = await asyncio.wait_for(sock.recv_multipart(), 30)
        return decode(reply).header
    finally:
        sock.close()
        ctx.term()


def test_bad_input_gets_a_named_error_and_changes_nothing(dense_server):
    served = dense_server
    import torch

    async def main():
        await reset_server(served)
        conn = await ServerConnection(served.endpoint, curve=served.curve, timeout_s=60).start()
        try:
            await conn.submit(
                [SubmitRequest(f"b{i}", [10 + i, 11, 12], 200) for i in range(3)], {"ignore_eos": True}
            )
            await asyncio.sleep(0.3)
            await conn.pause()
            before = (await conn.fetch())[0].outputs()
            assert sum(len(o.token_ids) for o in before) > 0

            async def err(code, words, coro):
                with pytest.raises(ControlError) as e:
                    await coro
                assert e.value.code == code and words in e.value.message, e.value
                return e.value

            # frames
            for frames, code, words in [
                ([b"{not json"], ErrorCode.MALFORMED, "not UTF-8 JSON"),
                (
                    [
                        b'{"proto": 1, "id": 5, "type": "stats", "buffers": [{"name": "x", "dtype": "int32", "shape": [4]}]}',
                        b"1",
                    ],
                    ErrorCode.MALFORMED,
                    "16 bytes but its frame has 1",
                ),
                (
                    [
                        b'{"proto": 1, "id": 6, "type": "stats", "buffers": [{"name": "x", "dtype": "int32", "shape": [1]}]}'
                    ],
                    ErrorCode.MALFORMED,
                    "1 buffers but 0",
                ),
                ([b'{"proto": 2, "id": 7, "type": "stats"}'], ErrorCode.PROTOCOL_VERSION, "speaks 1"),
                (
                    [b'{"proto": 1, "id": 8, "type": "launch_missiles"}'],
                    ErrorCode.UNKNOWN_TYPE,
                    "launch_missiles",
                ),
            ]:
                h = await _raw(served, frames)
                assert h.ok is False and h.error["code"] == code and words in h.error["message"], h.error
            # responses
            await err(ErrorCode.UNKNOWN_RESPONSE, "'nope'", conn.truncate({"nope": 1, "b0": 0}))
            await err(ErrorCode.UNKNOWN_RESPONSE, "'nope'", conn.drop(["b1", "nope"]))
            await err(ErrorCode.UNKNOWN_RESPONSE, "'nope'", conn.fetch(["nope"]))
            n0 = len(before[0].token_ids)
            await err(
                ErrorCode.KEEP_OUT_OF_RANGE,
                f"keep length {n0 + 1} for response b0 is outside [0, {n0}]",
                conn.truncate({"b0": n0 + 1}),
            )
            await err(ErrorCode.KEEP_OUT_OF_RANGE, "keep length -1", conn.truncate({"b0": -1}))
            await err(ErrorCode.ALREADY_PAUSED, "already paused", conn.pause())
            await err(ErrorCode.DUPLICATE_RESPONSE, "b1", conn.submit([SubmitRequest("b1", [1, 2], 5)]))
            await err(ErrorCode.INVALID, "outside [0, 128)", conn.submit([SubmitRequest("x", [5, 500], 5)]))
            await err(
                ErrorCode.INVALID,
                "exceeds its budget max_new_tokens 2",
                conn.submit([SubmitRequest("x", [5], 2, prefix_ids=[7, 8, 9])]),
            )
            body, arrays = _encode_submit([SubmitRequest("x", [5, 6], 5)], None, None)
            body["sampling"] = {"temperature": 1.0, "frequency_penalty": 0.5}
            await err(ErrorCode.INVALID, "frequency_penalty", conn.call("submit", body, arrays))
            await err(
                ErrorCode.VERSION_MISMATCH,
                "expects weights version 7",
                conn.submit([SubmitRequest("x", [5], 5)], expect_version=7),
            )
            # weights: nothing is applied unless everything is valid
            good = [("model.norm.weight", torch.full((64,), 3.0))]
            await err(
                ErrorCode.WEIGHT_INVALID,
                "unknown weight name 'model.nope.weight'",
                conn.update_weights([("model.nope.weight", torch.zeros(4))], 1),
            )
            await err(
                ErrorCode.WEIGHT_INVALID,
                "has shape [3, 3] but the model's is [64]",
                conn.update_weights([("model.norm.weight", torch.zeros(3, 3))], 1),
            )
            await err(
                ErrorCode.WEIGHT_INVALID,
                "has dtype int32",
                conn.update_weights([("model.norm.weight", torch.zeros(64, dtype=torch.int32))], 1),
            )
            await err(ErrorCode.WEIGHT_SEQUENCE, "expected bucket 0", conn.update_weights(good, 1, bucket=1))
            await conn.update_weights(good, 1, bucket=0, commit=False)  # staged, valid
            await err(
                ErrorCode.WEIGHT_INVALID,
                "has shape [1]",
                conn.update_weights([("lm_head.weight", torch.zeros(1))], 1, bucket=1),
            )
            await err(
                ErrorCode.WEIGHT_SEQUENCE, "expected bucket 0", conn.update_weights(good, 1, bucket=2)
            )  # discarded
            moe_model = ensure_tiny_model(TinyModelSpec(moe=True))
            await err(ErrorCode.WEIGHT_INVALID, "missing weight", conn.update_weights_from_disk(moe_model, 1))
            await err(
                ErrorCode.WEIGHT_INVALID,
                "does not exist",
                conn.update_weights_from_disk("/no/such/folder", 1),
            )
            await err(ErrorCode.NOT_PAUSED, "not paused", (await conn.resume(), conn.resume())[1])
            await err(ErrorCode.BUSY, "pause first", conn.update_weights(good, 1))
            await err(ErrorCode.RESPONSE_RUNNING, "pause first", conn.truncate({"b0": 0}))
            await conn.pause()
            # still serving, old weights, the cache untouched (bar what the resume above generated)
            health = await conn.health()
            assert health["ok"] and health["version"] == 0
            after = (await conn.fetch())[0].outputs()
            for a, b in zip(before, after, strict=True):
                n = len(a.token_ids)
                assert np.array_equal(a.token_ids, b.token_ids[:n]) and np.array_equal(
                    a.logprobs, b.logprobs[:n]
                )
            await conn.drop(all=True)
            await conn.resume()
            await conn.submit([SubmitRequest("check", [40, 41, 42], 10)], {"ignore_eos": True})
            outs = []
            after_seq = (await conn.stats())["last_seq"] - 1
            while not outs:
                outs, _ = await conn.events(after=after_seq, wait_s=2.0)
                outs = [o for o in outs.outputs() if o.rid == "check"]
            lp, _ = hf_forward(served.model, np.array([40, 41, 42]), outs[0].token_ids)
            assert np.abs(lp - outs[0].logprobs).max() <= TOL and (outs[0].versions == 0).all()
        finally:
            await conn.close()

    run(main())


def test_curve_refuses_clients_without_the_right_key(dense_server, tmp_path):
    from zmq.auth import create_certificates

    served = dense_server
    _, stranger_secret = create_certificates(str(tmp_path), "stranger")
    stranger = CurveKeys(served.curve.server_public_key, *_keypair(stranger_secret))

    async def main():
        for keys in (None, stranger):
            conn = await ServerConnection(served.endpoint, curve=keys, timeout_s=3).start()
            try:
                with pytest.raises(ControlError) as e:
                    await conn.call("shutdown")
                assert e.value.code == "UNAVAILABLE"
            finally:
                await conn.close()
        conn = await ServerConnection(served.endpoint, curve=served.curve, timeout_s=30).start()
        try:
            assert (await conn.health())["ok"]
        finally:
            await conn.close()

    run(main())


def _keypair(secret_file):
    from zmq.auth import load_certificate

    return load_certificate(str(secret_file))
