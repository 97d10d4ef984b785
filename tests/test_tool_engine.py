"""The control protocol's `append` on the real SGLang engine (tiny dense and MoE models): environment tokens
appended to a held response, which continues from them; their source kept (version -2, no log-prob); the
continuation's log-probs and the routes of every position, the appended ones included, equal a float32 HF
forward; a truncate inside them cuts them like any token; bad appends refused with nothing changed."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import hf_forward, reset_server, run, same_routes

from sglang_ext.client import ControlError, ServerConnection, SubmitRequest
from sglang_ext.protocol import ENV_VERSION, UNKNOWN_VERSION, ErrorCode, WireSamplingParams

pytest_plugins = ["engine_fixtures"]
pytestmark = pytest.mark.engine

TOL = 1e-4
PROMPT = np.array([5, 20, 30, 40, 41], np.int32)
ONE_TOKEN = WireSamplingParams(temperature=1.0, stop_token_ids=list(range(128)))  # every launch samples one token


@pytest.fixture(params=["dense", "moe"])
def served(request):
    return request.getfixturevalue(f"{request.param}_server")


async def _finished(conn, after: int, rid: str):
    """The next finish event of `rid` (and the sequence number to acknowledge)."""
    for _ in range(120):
        batch, last = await conn.events(after, wait_s=1.0)
        for i, out in enumerate(batch.outputs()):
            if out.rid == rid:
                return out, int(batch.seqs[i])
        after = max(after, last)
    raise AssertionError(f"{rid} did not finish")


def _check_against_hf(served, fetched, prompt):
    """Policy tokens' log-probs and (MoE) every position's routes equal HF's forward over the whole sequence."""
    tokens = fetched.token_ids
    policy = fetched.versions != ENV_VERSION
    lp, routes = hf_forward(served.model, prompt, tokens)
    assert np.abs(lp[policy] - fetched.logprobs[policy]).max() <= TOL
    assert np.isnan(fetched.logprobs[~policy]).all()
    if served.kind == "moe":
        got = np.concatenate([fetched.prompt_routed_experts, fetched.routed_experts])
        assert got.shape[0] == len(prompt) + len(tokens) - 1
        assert same_routes(got, routes).all(), "routes of the appended positions are the engine's prefill of them"


def test_append_continues_a_response_stopped_at_a_call_from_its_environment_tokens(served):
    async def main():
        await reset_server(served)
        conn = await ServerConnection(served.endpoint, curve=served.curve, timeout_s=120).start()
        try:
            await conn.submit([SubmitRequest("a", PROMPT, 40)], ONE_TOKEN)
            first, seq = await _finished(conn, 0, "a")
            assert first.finish_reason == "stop" and len(first.token_ids) == 1
            env = np.array([60, 61, 62, 63], np.int32)  # a tool's output, as the controller tokenized it
            reply = await conn.append({"a": env})
            assert reply["launched"] == ["a"] and reply["tokens"] == 4
            nxt, seq = await _finished(conn, seq, "a")
            assert nxt.offset == 5 and len(nxt.token_ids) == 1  # continued after the environment tokens
            if served.kind == "moe":  # the launch re-captured every route, the appended positions' too
                assert nxt.prefix_routed_experts is not None and len(nxt.prefix_routed_experts) == 5
                assert nxt.prompt_routed_experts is not None
            batch, body = await conn.fetch(["a"])
            (fetched,) = batch.outputs()
            assert fetched.token_ids[1:5].tolist() == env.tolist() and body["states"] == ["finished"]
            assert fetched.versions.tolist() == [0, ENV_VERSION, ENV_VERSION, ENV_VERSION, ENV_VERSION, 0]
            _check_against_hf(served, fetched, PROMPT)

            # a second tool turn, then a cut inside it: tokens, log-probs, versions and routes cut together
            await conn.append({"a": np.array([70, 71], np.int32)})
            _, seq = await _finished(conn, seq, "a")
            await conn.truncate({"a": 7})  # keeps [t0, env x4, t1, 70]: the cut is inside the second output
            batch, body = await conn.fetch(["a"])
            (cut,) = batch.outputs()
            assert len(cut.token_ids) == 7 and cut.versions[-1] == ENV_VERSION
            assert body["states"][0] in ("running", "finished")  # revived, launched at once from the cut prefix
            again, seq = await _finished(conn, seq, "a")
            assert again.offset == 7
            batch, _ = await conn.fetch(["a"])
            _check_against_hf(served, batch.outputs()[0], PROMPT)
        finally:
            await conn.close()

    run(main())


def test_append_to_a_paused_response_waits_for_resume_and_bad_appends_change_nothing(served):
    async def main():
        await reset_server(served)
        conn = await ServerConnection(served.endpoint, curve=served.curve, timeout_s=120).start()
        try:
            await conn.pause()
            await conn.submit([SubmitRequest("p", PROMPT, 12, prefix_ids=np.array([7, 8], np.int32))], ONE_TOKEN)
            await conn.submit([SubmitRequest("q", PROMPT, 6)], ONE_TOKEN)
            for bad, code in [
                ({"nope": [60]}, ErrorCode.UNKNOWN_RESPONSE),
                ({"p": [60], "q": [500]}, ErrorCode.INVALID),  # outside the vocabulary
                ({"p": [60], "q": list(range(60, 66))}, ErrorCode.INVALID),  # leaves q no budget
            ]:
                with pytest.raises(ControlError) as e:
                    await conn.append(bad)
                assert e.value.code == code
            batch, body = await conn.fetch(["p", "q"])
            assert [len(o.token_ids) for o in batch.outputs()] == [2, 0]  # nothing was appended to p
            reply = await conn.append({"p": np.array([60, 61], np.int32)})
            assert reply["launched"] == []  # paused: it waits for resume
            await conn.resume()
            out, _ = await _finished(conn, 0, "p")
            assert out.offset == 4 and len(out.token_ids) == 1
            batch, _ = await conn.fetch(["p"])
            (fetched,) = batch.outputs()
            assert fetched.versions[:4].tolist() == [UNKNOWN_VERSION] * 2 + [ENV_VERSION] * 2
            # a generating response is refused
            await conn.submit([SubmitRequest("r", PROMPT, 64)], WireSamplingParams(temperature=1.0))
            with pytest.raises(ControlError) as e:
                await conn.append({"r": [60]})
            assert e.value.code in (ErrorCode.RESPONSE_RUNNING, ErrorCode.INVALID)  # running, or already done
            assert (await conn.health())["ok"]
        finally:
            await conn.close()

    run(main())
