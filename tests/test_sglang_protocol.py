"""sglang_ext without SGLang: wire format, response cache, model-folder checks, bind policy, and the server's
bookkeeping on a fake engine (accounting across pause/truncate/resume, crash recovery, bad input)."""

from __future__ import annotations

import asyncio
import json
import random
import struct
import subprocess
import sys

import numpy as np
import pytest
from engine_fixtures import FakeEngine, FakeServer, run

from sglang_ext.client import DETACHED, ControlError, RolloutClient, ServerConnection, SubmitRequest
from sglang_ext.engine import ModelFolderError, inspect_model_folder
from sglang_ext.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    Output,
    ProtocolError,
    decode,
    decode_outputs,
    encode,
    encode_outputs,
    error_header,
)
from sglang_ext.server import ServeConfig, ServeConfigError, check_config, check_endpoint
from sglang_ext.store import RouteShape, State, new_record


def _frames(header: Header, arrays=None) -> list[bytes]:
    return [bytes(f) for f in encode(header, arrays)]


def test_frames_round_trip_raw_buffers():
    ids = np.arange(7, dtype=np.int32)
    lps = np.linspace(-1, 0, 7, dtype=np.float32)
    frames = _frames(Header(proto=PROTOCOL_VERSION, id=3, type="x", body={"a": 1}), {"ids": ids, "lps": lps})
    assert len(frames) == 3 and b"[0," not in frames[0]  # arrays are frames, not JSON lists
    msg = decode(frames)
    assert msg.header.id == 3 and msg.body == {"a": 1}
    assert np.array_equal(msg.array("ids", ["int32"], 1), ids)
    assert np.array_equal(msg.array("lps", ["float32"], 1), lps)
    with pytest.raises(ProtocolError, match="dtype int32"):
        msg.array("ids", ["float32"])


@pytest.mark.parametrize(
    "frames, code, words",
    [
        ([], ErrorCode.MALFORMED, "empty"),
        ([b"\xff\xfe not json"], ErrorCode.MALFORMED, "not UTF-8 JSON"),
        ([b"[1, 2]"], ErrorCode.MALFORMED, "JSON object"),
        ([b'{"proto": 99, "id": 1}'], ErrorCode.PROTOCOL_VERSION, "99"),
        ([b'{"proto": 1, "id": 1, "bogus": 2}'], ErrorCode.MALFORMED, "bogus"),
        (
            [b'{"proto": 1, "buffers": [{"name": "a", "dtype": "int32", "shape": [2]}]}'],
            ErrorCode.MALFORMED,
            "1 buffers but 0",
        ),
        (
            [b'{"proto": 1, "buffers": [{"name": "a", "dtype": "int32", "shape": [2]}]}', b"123"],
            ErrorCode.MALFORMED,
            "8 bytes but its frame has 3",
        ),
        (
            [b'{"proto": 1, "buffers": [{"name": "a", "dtype": "complex", "shape": [1]}]}', b"12345678"],
            ErrorCode.MALFORMED,
            "unknown dtype",
        ),
    ],
)
def test_malformed_frames_name_the_problem(frames, code, words):
    with pytest.raises(ProtocolError) as e:
        decode(frames)
    assert e.value.code == code and words in e.value.message


@pytest.mark.parametrize(
    "head, words, req_id, req_type",
    [
        (b"[" * 5000 + b"]" * 5000, "deeper than 16", None, None),
        (b'{"proto": 1, "id": 7, "type": "x", "body": ' + b'{"a":' * 20 + b"1" + b"}" * 20 + b"}", "deeper", None, None),
        (b'{"proto": 1, "id": ' + b"9" * 5000 + b', "type": "health"}', "5000 characters", None, "health"),
        (b'{"proto": 1, "id": 9223372036854775808, "type": "health"}', "int64", None, "health"),
        (b'{"proto": 1, "id": 2, "type": "events", "body": {"wait_s": NaN}}', "NaN", 2, "events"),
        (b'{"proto": 1, "id": 2, "type": "events", "body": {"wait_s": 1e999}}', "finite", 2, "events"),
        (b'{"proto": 1, "id": "a\\ud800", "type": "health"}', "lone surrogate", None, "health"),
        (b'{"proto": 1, "id": "a\xed\xa0\x80", "type": "health"}', "not UTF-8", None, None),
        (b'{"proto": 1, "id": 3, "type": "health", "ok": true}', "belong to replies", 3, "health"),
        (b'{"proto": 1, "id": true, "type": "health"}', "id", None, "health"),
        (b'{"proto": 1, "id": 1.0, "type": "health"}', "id", None, "health"),
        (b'{"proto": 1.0, "id": 4, "type": "health"}', "1.0", 4, "health"),
    ],
)
def test_header_limits_and_strict_types(head, words, req_id, req_type):
    with pytest.raises(ProtocolError) as e:
        decode([head], request=True)
    assert e.value.code in (ErrorCode.MALFORMED, ErrorCode.PROTOCOL_VERSION) and words in e.value.message
    assert (e.value.req_id, e.value.req_type) == (req_id, req_type)
    # an error reply to it encodes, with `id` present even when null
    reply = json.loads(encode(error_header(e.value.req_id, e.value.req_type, e.value))[0])
    assert reply["id"] == req_id and reply.get("type") == req_type


def test_serve_refuses_a_weights_version_beyond_int32():
    with pytest.raises(ServeConfigError, match="outside"):
        check_config(ServeConfig(model="m", version=2**31))
    check_config(ServeConfig(model="m", version=2**31 - 1))


def test_outputs_pack_into_constant_frames():
    rng = np.random.default_rng(0)
    outs = [
        Output(
            rid=f"r{i}",
            offset=i,
            token_ids=rng.integers(0, 100, n).astype(np.int32),
            logprobs=rng.standard_normal(n).astype(np.float32),
            versions=np.full(n, i, np.int32),
            total_len=i + n,
            finish_reason=None if i % 2 else "stop",
            routed_experts=rng.integers(0, 8, (n, 2, 2)).astype(np.uint8),
            prompt_routed_experts=rng.integers(0, 8, (3, 2, 2)).astype(np.uint8) if i == 0 else None,
            seq=i,
        )
        for i, n in enumerate([0, 5, 3, 9])
    ]
    body, arrays = encode_outputs(outs)
    frames = _frames(Header(proto=1, id=1, type="pause", ok=True, body=body), arrays)
    # header + per-item ints (offsets, counts, totals, seqs, prompt route rows) + per-token arrays (ids,
    # log-probs, versions, routes, prompt routes): the same number of frames whatever the count
    assert len(frames) == 1 + 10
    back = decode_outputs(decode(frames))
    for a, b in zip(outs, back, strict=True):
        assert (a.rid, a.offset, a.total_len, a.finish_reason, a.seq) == (
            b.rid,
            b.offset,
            b.total_len,
            b.finish_reason,
            b.seq,
        )
        for f in ("token_ids", "logprobs", "versions", "routed_experts"):
            assert np.array_equal(getattr(a, f), getattr(b, f))
        assert (a.prompt_routed_experts is None) == (b.prompt_routed_experts is None)


def test_record_cuts_all_fields_together_and_reports_each_token_once():
    from sglang_ext.protocol import SamplingParams

    rs = RouteShape(2, 2, np.dtype(np.uint8))
    rec = new_record("a", np.array([1, 2, 3]), np.array([9, 9]), 20, SamplingParams(), rs)
    assert rec.reported == 2 and len(rec.routes) == 2  # the prefix is the controller's already
    rec.append(
        np.array([4, 5, 6], np.int32), np.array([-1, -2, -3], np.float32), 3, np.ones((3, 2, 2), np.int32)
    )
    d = rec.take_delta()
    assert d.offset == 2 and list(d.token_ids) == [4, 5, 6] and list(d.versions) == [3, 3, 3]
    assert len(rec.take_delta().token_ids) == 0
    rec.state, rec.finish_reason = State.FINISHED, "length"
    rec.truncate(3)
    assert rec.state is State.PAUSED and rec.finish_reason is None and rec.reported == 3
    assert len(rec.tokens) == len(rec.logprobs) == len(rec.versions) == len(rec.routes) == 3
    with pytest.raises(ValueError):
        rec.truncate(4)


# ---------------------------------------------------------------------------------------------- model folders


def _copy_model(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_model_folder_problems_are_named(tmp_path, tiny_dense_path):
    cases = []
    cases.append((tmp_path / "nope", "does not exist"))
    f = tmp_path / "file.txt"
    f.write_text("x")
    cases.append((f, "is not a folder"))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((empty, "has no config.json"))
    badjson = _copy_model(tiny_dense_path, tmp_path / "badjson")
    (badjson / "config.json").write_text("{not json")
    cases.append((badjson, "config.json is not valid JSON"))
    noweights = _copy_model(tiny_dense_path, tmp_path / "noweights")
    (noweights / "model.safetensors").unlink()
    cases.append((noweights, "has no weights"))
    trunc = _copy_model(tiny_dense_path, tmp_path / "trunc")
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases.append((trunc, "truncated"))
    garbage = _copy_model(tiny_dense_path, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"xx")
    cases.append((garbage, "not a valid safetensors file"))
    mism = _copy_model(tiny_dense_path, tmp_path / "mism")
    cfg = json.loads((mism / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (mism / "config.json").write_text(json.dumps(cfg))
    cases.append((mism, "num_hidden_layers 3"))
    heads = _copy_model(tiny_dense_path, tmp_path / "heads")
    cfg = json.loads((heads / "config.json").read_text())
    cfg["head_dim"] = 8
    (heads / "config.json").write_text(json.dumps(cfg))
    cases.append((heads, "q_proj.weight of shape [32, 64]"))
    for path, words in cases:
        with pytest.raises(ModelFolderError) as e:
            inspect_model_folder(path)
        assert str(path) in str(e.value) and words in str(e.value), str(e.value)
    info = inspect_model_folder(tiny_dense_path)
    assert info.vocab_size == 128 and not info.is_moe and "lm_head.weight" in info.weights


def test_serve_refuses_open_address_without_keys(tmp_path, tiny_dense_path):
    with pytest.raises(ServeConfigError, match="not a loopback address and no CURVE keys"):
        check_endpoint(ServeConfig(model="m", control="tcp://0.0.0.0:5555"))
    with pytest.raises(ServeConfigError, match="not a loopback"):
        check_endpoint(ServeConfig(model="m", control="tcp://*:5555"))
    for ok in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:7", "ipc:///tmp/x"):
        check_endpoint(ServeConfig(model="m", control=ok))
    (tmp_path / "k").mkdir()
    (tmp_path / "s.key_secret").write_text("")
    check_endpoint(
        ServeConfig(
            model="m",
            control="tcp://0.0.0.0:5555",
            curve_secret_key=str(tmp_path / "s.key_secret"),
            curve_authorized_keys=str(tmp_path / "k"),
        )
    )
    # the command line says so and starts nothing
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_ext.server",
            "--model",
            str(tiny_dense_path),
            "--control",
            "tcp://0.0.0.0:5599",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "refusing to bind" in r.stderr and "CURVE" in r.stderr


# ---------------------------------------------------------------------------------------------- fake engine


def test_fake_accounting_through_cycles_and_server_crash():
    """Two servers, 60 responses, 4 pause/truncate/resume cycles, then one server dies and its responses move:
    every response finishes exactly once and its tokens are exactly what the deltas delivered."""
    random.seed(0)
    engines = [FakeEngine(step_s=0.003), FakeEngine(step_s=0.003)]
    s0, s1 = FakeServer(engines[0]), FakeServer(engines[1])
    try:

        async def main():
            async with RolloutClient([s0.endpoint, s1.endpoint], poll_wait_s=0.2) as c:
                reqs = [
                    SubmitRequest(
                        f"g{i // 4}-{i % 4}",
                        [3, 4, 5 + i % 7],
                        max_new_tokens=random.randint(20, 60),
                        group=f"g{i // 4}",
                    )
                    for i in range(60)
                ]
                await c.submit(reqs, {"ignore_eos": True})
                assert {c.responses[f"g0-{j}"].server for j in range(4)} == {
                    c.responses["g0-0"].server
                }  # a group stays together
                finished: dict[str, int] = {}

                def on_fin(out):
                    assert out.rid not in finished
                    finished[out.rid] = out.total_len

                c.on_finished = on_fin
                for cycle in range(4):
                    await asyncio.sleep(0.05)
                    deltas = await c.pause()
                    assert not set(deltas) & set(finished)
                    keep = {rid: random.randint(0, len(c.responses[rid].token_ids)) for rid in deltas}
                    await c.truncate(keep)
                    for srv in c.servers:
                        outs, body = await srv.conn.fetch()
                        for o in outs:
                            tr = c.responses[o.rid]
                            assert np.array_equal(o.token_ids, tr.token_ids) and np.array_equal(
                                o.logprobs, tr.logprobs
                            )
                            assert np.array_equal(o.routed_experts, tr.routed_experts)
                    await c.resume()
                    del cycle
                # server 1 "crashes" mid-generation: what it generated since its last report is lost, nothing else
                await asyncio.sleep(0.03)
                s1.crash()
                held = {
                    rid: len(tr.token_ids)
                    for rid, tr in c.responses.items()
                    if tr.server == 1 and not tr.finished
                }
                moved = await c.recover(1)
                assert set(moved) == set(held) and moved
                assert all(
                    c.responses[r].server == 0 and len(c.responses[r].token_ids) == held[r] for r in moved
                )
                while len(finished) < 60:
                    await c.next_finished(30)
                for r in reqs:
                    tr = c.responses[r.rid]
                    assert finished[r.rid] == len(tr.token_ids) == r.max_new_tokens
                    assert len(tr.logprobs) == len(tr.versions) == len(tr.routed_experts) == len(tr.token_ids)
                    assert tr.prompt_routed_experts.shape == (2, 2, 2)

        run(main(), 120)
    finally:
        s0.stop()
        s1.stop()


def test_fake_finished_responses_of_a_lost_server_stay_usable():
    """A finished response outlives its server: it can still be dropped, or cut, which revives it elsewhere."""
    s0, s1 = FakeServer(FakeEngine(step_s=0.002)), FakeServer(FakeEngine(step_s=0.002))
    try:

        async def main():
            async with RolloutClient([s0.endpoint, s1.endpoint], poll_wait_s=0.1) as c:
                reqs = [SubmitRequest(f"g{g}-{j}", [3, 4, 5], 6, group=f"g{g}") for g in range(2) for j in range(2)]
                await c.submit(reqs, {"ignore_eos": True})
                assert c.responses["g1-0"].server == 1
                for _ in reqs:
                    await c.next_finished(30)
                s1.crash()
                assert await c.recover(1) == []  # nothing was unfinished there
                assert c.responses["g1-0"].server == c.responses["g1-1"].server == DETACHED
                kept = c.responses["g1-0"].token_ids[:2].copy()
                await c.truncate({"g1-0": 2, "g1-1": 6})  # a cut revives; keeping everything changes nothing
                assert c.responses["g1-0"].server == 0 and c.responses["g1-1"].server == DETACHED
                out = await c.next_finished(30)
                tr = c.responses["g1-0"]
                assert out.rid == "g1-0" and len(tr.token_ids) == 6 and np.array_equal(tr.token_ids[:2], kept)
                await c.drop(["g1-1", "g1-0"])
                assert set(c.responses) == {"g0-0", "g0-1"}
                with pytest.raises(ControlError, match="not tracked"):
                    await c.drop(["g1-1"])

        run(main(), 60)
    finally:
        s0.stop()
        s1.stop()


def test_fake_resume_reproduces_continuous_generation():
    """Truncate-then-resume continues from exactly the kept prefix (the fake engine is deterministic)."""
    with FakeServer(FakeEngine(step_s=0.002)) as s:

        async def main():
            async with RolloutClient([s.endpoint], poll_wait_s=0.1) as c:
                await c.submit(
                    [SubmitRequest("ref", [7, 8, 9], 40), SubmitRequest("cut", [7, 8, 9], 40)],
                    {"ignore_eos": True},
                )
                await asyncio.sleep(0.03)
                await c.pause()
                n = len(c.responses["cut"].token_ids)
                await c.truncate({"cut": n // 2, "ref": len(c.responses["ref"].token_ids)})
                await c.resume()
                await c.next_finished(10)
                await c.next_finished(10)
                a, b = c.responses["ref"], c.responses["cut"]
                assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.logprobs, b.logprobs)
                assert np.array_equal(a.routed_experts, b.routed_experts)

        run(main(), 60)


def test_fake_bad_input_keeps_serving():
    with FakeServer(FakeEngine(step_s=0.002)) as s:

        async def main():
            conn = await ServerConnection(s.endpoint, timeout_s=10).start()
            try:
                from sglang_ext.client import _encode_submit

                body, arrays = _encode_submit([SubmitRequest("a", [5, 6], 10)], None, None)
                body["sampling"] = {"temperature": 0.5, "seed": 3}
                with pytest.raises(ControlError, match="sampling.seed") as e:
                    await conn.call("submit", body, arrays)
                assert e.value.code == ErrorCode.INVALID
                with pytest.raises(ControlError) as e:
                    await conn.call("frobnicate")
                assert e.value.code == ErrorCode.UNKNOWN_TYPE and "frobnicate" in e.value.message
                await conn.submit([SubmitRequest("a", [5, 6], 500)], {"ignore_eos": True})
                with pytest.raises(ControlError, match="1 are running; pause first") as e:
                    await conn.flush()
                assert e.value.code == ErrorCode.BUSY
                info = await conn.health()
                assert info["ok"]
            finally:
                await conn.close()

        run(main(), 60)


def test_fake_second_controller_pause_does_not_wait_for_old_events():
    """Events acknowledged by an earlier connection are not awaited by the pause barrier of a new one."""
    with FakeServer(FakeEngine(step_s=0.001)) as s:

        async def main():
            async with RolloutClient([s.endpoint], poll_wait_s=0.1) as c:
                await c.submit([SubmitRequest(f"old{i}", [5, 6], 5) for i in range(3)], {"ignore_eos": True})
                for _ in range(3):
                    await c.next_finished(10)
            async with RolloutClient([s.endpoint], poll_wait_s=0.1) as c:
                await c.submit([SubmitRequest("new", [5, 6], 500)], {"ignore_eos": True})
                deltas = await asyncio.wait_for(c.pause(), 5)
                assert list(deltas) == ["new"] and c.servers[0].last_seq == 3

        run(main(), 30)


def test_sync_client_and_weight_sink_on_fake_engine():
    """The synchronous wrapper the loop uses, and bfloat16 weight buckets through WeightSink."""
    import torch

    from sglang_ext.client import SyncRolloutClient, WeightSink

    engine = FakeEngine(step_s=0.002)
    with FakeServer(engine) as s, SyncRolloutClient([s.endpoint], poll_wait_s=0.1) as c:
        c.submit([SubmitRequest("a", [5, 6], 30), SubmitRequest("b", [7], 400)], {"ignore_eos": True})
        assert c.next_finished(10).rid == "a"
        deltas = c.pause()
        assert list(deltas) == ["b"] and c.finished_nowait() == []
        c.truncate({"b": 1, "a": 10})  # a finished response cut short lives again
        WeightSink(c).send([[("lm_head.weight", torch.ones(128, 8, dtype=torch.bfloat16))]], version=3)
        assert engine.updates == [1] and c.health()[0]["version"] == 3
        c.resume()
        done = {c.next_finished(10).rid for _ in range(2)}
        assert done == {"a", "b"}
        for rid, n in (("a", 30), ("b", 400)):
            tr = c.responses[rid]
            assert (
                len(tr.token_ids) == n
                and (tr.versions[:1] == 0).all()
                and (tr.versions[10 if rid == "a" else 1 :] == 3).all()
            )
