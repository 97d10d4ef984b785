"""sglang_ext without SGLang: wire format, response cache, model-folder checks, bind policy, and the server's
bookkeeping on a fake engine (accounting across pause/truncate/resume, crash recovery, bad input)."""

from __future__ import annotations

import concurrent.futures
import json
import random
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from engine_fixtures import FakeEngine, FakeServer, run

from rollverify.buffer import RolloutBuffer
from rollverify.types import Group
from sglang_ext.client import ControlError, ServerConnection, SubmitRequest
from sglang_ext.engine import ModelFolderError, inspect_model_folder
from sglang_ext.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    Output,
    OutputBatch,
    ProtocolError,
    WireSamplingParams,
    decode,
    encode,
    encode_outputs,
    error_header,
)
from sglang_ext.rollout_engine import SGLangRolloutEngine
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
        (b'{"proto": 1, "id": 4, "type": "' + b"t" * 65 + b'"}', "at most 64 characters", 4, None),
        (b'{"proto": 2, "id": 4, "type": "' + b"t" * 65 + b'"}', "not supported", 4, None),
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
            prompt_routed_experts=rng.integers(0, 8, (3, 2, 2)).astype(np.uint8) if i in (0, 2) else None,
            prefix_routed_experts=rng.integers(0, 8, (i, 2, 2)).astype(np.uint8) if i == 2 else None,
            seq=i,
        )
        for i, n in enumerate([0, 5, 3, 9])
    ]
    body, arrays = encode_outputs(outs)
    frames = _frames(Header(proto=1, id=1, type="pause", ok=True, body=body), arrays)
    # header + per-item ints (offsets, counts, totals, seqs, prompt and prefix route rows) + per-token arrays
    # (ids, log-probs, versions, routes, prompt and prefix routes): the same number of frames whatever the count
    assert len(frames) == 1 + 12
    back = OutputBatch.decode(decode(frames)).outputs()
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
        for f in ("prompt_routed_experts", "prefix_routed_experts"):
            assert (getattr(a, f) is None) == (getattr(b, f) is None)
            assert getattr(a, f) is None or np.array_equal(getattr(a, f), getattr(b, f))
    arrays["prefix_route_rows"] = np.array([-1, -1, 1, -1], np.int32)  # rows that do not reach the entry's offset
    arrays["prefix_routed_experts"] = arrays["prefix_routed_experts"][:1]
    with pytest.raises(ProtocolError, match="offsets") as e:
        OutputBatch.decode(decode(_frames(Header(proto=1, id=1, type="pause", ok=True, body=body), arrays)))
    assert e.value.code == ErrorCode.MALFORMED


def test_record_cuts_all_fields_together_and_reports_each_token_once():
    rs = RouteShape(2, 2, np.dtype(np.uint8))
    rec = new_record("a", np.array([1, 2, 3]), np.array([9, 9]), 20, WireSamplingParams(), rs)
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


IGNORE_EOS = WireSamplingParams(ignore_eos=True)


class Recorder:
    """What the loop does with the engine's chunks: append them to the buffer (the one controller copy, which
    checks lengths and budgets), counting finishes."""

    def __init__(self, buffer: RolloutBuffer) -> None:
        self.buffer = buffer
        self.finished: dict[str, int] = {}  # response id -> its length when it finished

    def take(self, chunks) -> list:
        for c in chunks:
            r = self.buffer.get(c.response_id)
            assert c.finish_reason is None or c.response_id not in self.finished, f"{c.response_id} finished twice"
            self.buffer.record(c.response_id, c.token_ids, c.logprobs, c.versions, c.routed_experts,
                               finish_reason=c.finish_reason, offset=c.offset, prompt_routes=c.prompt_routed_experts,
                               prefix_routes=c.prefix_routed_experts)
            if r.finished:
                self.finished[c.response_id] = r.num_tokens
        return list(chunks)

    def wait(self, engine, count: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.finished) < count:
            assert time.monotonic() < deadline, f"{len(self.finished)} of {count} finished"
            self.take(engine.wait_finished(0.2))


def fetch(endpoint: str):
    """Every response the server caches, over a connection of its own."""

    async def main():
        conn = await ServerConnection(endpoint, timeout_s=10).start()
        try:
            return (await conn.fetch())[0]
        finally:
            await conn.close()

    return run(main(), 30)


def same_as_server(buffer: RolloutBuffer, endpoint: str) -> int:
    batch = fetch(endpoint)
    for i, o in enumerate(batch.outputs()):
        r = buffer.get(o.rid)
        assert np.array_equal(o.token_ids, r.token_ids) and np.array_equal(o.logprobs, r.logprobs), o.rid
        assert np.array_equal(o.versions, r.versions) and np.array_equal(o.routed_experts, r.routed_experts)
        assert (batch.finish[i] is not None) == r.finished
    return len(batch)


def test_fake_accounting_through_cycles_and_server_crash():
    """Two servers, 60 responses, 4 pause/truncate/resume cycles, then one server dies: the engine names what it
    held and the buffer resubmits its unfinished responses. Every response finishes exactly once, its tokens
    exactly what the chunks delivered, and the servers' caches equal the buffer after every cut."""
    rng = random.Random(0)
    s0, s1 = FakeServer(FakeEngine(step_s=0.003)), FakeServer(FakeEngine(step_s=0.003))
    try:
        with SGLangRolloutEngine([s0.endpoint, s1.endpoint], processes=[s0, s1], poll_wait_s=0.2) as engine:
            buffer = RolloutBuffer()
            for g in range(15):
                buffer.add_group(Group.new(g, [3, 4, 5 + g % 7], 4, rng.randint(100, 300)))
            rec = Recorder(buffer)
            engine.submit(buffer.pending(), IGNORE_EOS)
            assert {engine.where[f"0-{j}"] for j in range(4)} == {engine.where["0-0"]}  # a group stays together
            assert {s.index for s in engine.where.values()} == {0, 1}
            for _ in range(4):
                time.sleep(0.05)
                rec.take(engine.wait_finished(0.0))
                deltas = rec.take(engine.pause())
                assert all(c.finish_reason is None for c in deltas)
                rec.take(engine.wait_finished(0.0))  # finished before the pause: delivered by now
                keep = {c.response_id: rng.randint(0, buffer.get(c.response_id).num_tokens) for c in deltas}
                buffer.apply_truncation(keep)
                engine.truncate(keep)
                assert sum(same_as_server(buffer, s.endpoint) for s in (s0, s1)) == 60
                engine.resume()
            # server 1 "crashes" mid-generation: what it generated since its last report is lost, nothing else
            time.sleep(0.03)
            s1.crash()
            held = {r.response_id: r.num_tokens for r in buffer.pending()}
            deltas = rec.take(engine.pause())  # server 1's exited "process" is noticed: server 0 pauses alone
            rec.take(engine.wait_finished(0.0))
            assert {engine.where[c.response_id].index for c in deltas} <= {0}
            lost = engine.lost()
            assert engine.faults[0]["lost"] == sorted(lost) and not engine.faults[0]["restarted"]
            again = [buffer.get(rid) for rid in lost if not buffer.get(rid).finished]
            assert again and all(r.num_tokens == held[r.response_id] for r in again)
            engine.submit(again, IGNORE_EOS)  # the loop's resubmission, from the buffer; they wait for resume
            assert {engine.where[r.response_id].index for r in again} == {0}
            engine.resume()
            rec.wait(engine, 60)
            for r in (r for g in buffer.groups.values() for r in g.responses):
                assert rec.finished[r.response_id] == r.num_tokens == r.max_new_tokens
                assert len(r.logprobs) == len(r.versions) == len(r.routed_experts) == r.num_tokens
                assert r.prompt_routed_experts.shape == (2, 2, 2)
    finally:
        s0.stop()
        s1.stop()


def test_fake_ids_of_a_lost_server_go_to_the_loop():
    """The engine forgets a lost server's responses, finished ones included: until the loop collects them a cut
    or a drop of one is skipped, afterwards it is an error; a cut one resubmitted resumes elsewhere."""
    s0, s1 = FakeServer(FakeEngine(step_s=0.002)), FakeServer(FakeEngine(step_s=0.002))
    try:
        with SGLangRolloutEngine([s0.endpoint, s1.endpoint], processes=[s0, s1], poll_wait_s=0.1) as engine:
            buffer = RolloutBuffer()
            for g in range(2):
                buffer.add_group(Group.new(g, [3, 4, 5], 2, 6))
            rec = Recorder(buffer)
            engine.submit(buffer.pending(), IGNORE_EOS)
            assert engine.where["1-0"].index == 1 and engine.where["0-0"].index == 0
            rec.wait(engine, 4)
            s1.crash()
            while not engine.faults:
                rec.take(engine.wait_finished(0.2))
            engine.truncate({"1-0": 2})  # lost, not yet collected: skipped
            engine.drop(["1-1"])
            assert engine.lost() == ["1-0"]
            with pytest.raises(KeyError, match="not on the rollout engine"):
                engine.drop(["1-0"])
            kept = buffer.get("1-0").token_ids[:2].copy()
            buffer.apply_truncation({"1-0": 2})
            engine.submit([buffer.get("1-0")], IGNORE_EOS)
            assert engine.where["1-0"].index == 0
            del rec.finished["1-0"]
            rec.wait(engine, 4)
            r = buffer.get("1-0")
            assert r.num_tokens == 6 and np.array_equal(r.token_ids[:2], kept)
    finally:
        s0.stop()
        s1.stop()


def test_fake_resume_reproduces_continuous_generation():
    """Truncate-then-resume continues from exactly the kept prefix (the fake engine is deterministic)."""
    with FakeServer(FakeEngine(step_s=0.002)) as s, SGLangRolloutEngine([s.endpoint], poll_wait_s=0.1) as engine:
        buffer = RolloutBuffer()
        buffer.add_group(Group.new(0, [7, 8, 9], 2, 40))
        rec = Recorder(buffer)
        engine.submit(buffer.pending(), IGNORE_EOS)
        time.sleep(0.03)
        rec.take(engine.pause())
        keep = {"0-1": buffer.get("0-1").num_tokens // 2}
        buffer.apply_truncation(keep)
        engine.truncate(keep)
        engine.resume()
        rec.wait(engine, 2)
        a, b = buffer.get("0-0"), buffer.get("0-1")
        assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.logprobs, b.logprobs)
        assert np.array_equal(a.routed_experts, b.routed_experts)


def test_fake_routes_are_those_of_the_latest_forward_after_a_weight_update():
    """A response resumed under new weights is re-prefilled: the routes of its prompt and of its kept prefix
    come back and replace the held ones, so every position the trainer replays has the routes of the engine's
    latest forward (those that computed the KV its later tokens were sampled from). A resume under the same
    weights sends none again."""
    import torch

    fake = FakeEngine(step_s=0.002)
    with FakeServer(fake) as s, SGLangRolloutEngine([s.endpoint], poll_wait_s=0.1) as engine:
        buffer = RolloutBuffer()
        buffer.add_group(Group.new(0, [7, 8, 9], 2, 400))
        rec = Recorder(buffer)
        engine.submit(buffer.pending(), IGNORE_EOS)
        time.sleep(0.03)
        first = rec.take(engine.pause())
        assert all(c.prompt_routed_experts is not None and c.prefix_routed_experts is None for c in first)
        keep = {"0-1": buffer.get("0-1").num_tokens // 2}
        buffer.apply_truncation(keep)
        engine.truncate(keep)
        held = {r.response_id: r.num_tokens for r in buffer.pending()}
        engine.update_weights(iter([[("lm_head.weight", torch.ones(128, 8))]]), version=1)  # new routes
        engine.resume()
        time.sleep(0.03)
        after = rec.take(engine.pause())
        assert {c.response_id: len(c.prefix_routed_experts) for c in after} == held
        for r in buffer.pending():
            seq = np.concatenate([r.prompt_ids, r.token_ids])
            want = np.stack([fake.route(p, seq[p]) for p in range(len(seq) - 1)])
            assert np.array_equal(np.concatenate([r.prompt_routed_experts, r.routed_experts]), want), r.response_id
            assert (r.versions[: held[r.response_id]] == 0).all() and (r.versions[held[r.response_id]:] == 1).all()
        engine.resume()  # same weights: the held routes are the latest forward's already
        time.sleep(0.03)
        again = rec.take(engine.pause())
        assert again and all(c.prompt_routed_experts is None and c.prefix_routed_experts is None for c in again)
        assert same_as_server(buffer, s.endpoint) == 2


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
        buffer = RolloutBuffer()
        buffer.add_group(Group.new(0, [5, 6], 3, 5))
        buffer.add_group(Group.new(1, [5, 6], 1, 500))
        with SGLangRolloutEngine([s.endpoint], poll_wait_s=0.1) as engine:
            engine.submit(buffer.groups[0].responses, IGNORE_EOS)
            Recorder(buffer).wait(engine, 3)
        with SGLangRolloutEngine([s.endpoint], poll_wait_s=0.1) as engine:
            engine.submit(buffer.groups[1].responses, IGNORE_EOS)
            # a barrier that waited for the first connection's events would never return: bounded only so that
            # such a regression fails instead of hanging the suite
            pool = concurrent.futures.ThreadPoolExecutor(1)
            try:
                deltas = pool.submit(engine.pause).result(timeout=300)
            finally:
                pool.shutdown(wait=False)
            assert [c.response_id for c in deltas] == ["1-0"] and engine.pool.servers[0].feed.last_seq == 3


def test_engine_revival_and_bfloat16_weights_on_fake_engine():
    """A finished response cut short lives again; a bfloat16 weight bucket commits; later tokens carry its
    version, kept ones keep theirs."""
    import torch

    engine_ = FakeEngine(step_s=0.002)
    with FakeServer(engine_) as s, SGLangRolloutEngine([s.endpoint], poll_wait_s=0.1) as engine:
        buffer = RolloutBuffer()
        buffer.add_group(Group.new(0, [5, 6], 1, 30))
        buffer.add_group(Group.new(1, [7], 1, 400))
        rec = Recorder(buffer)
        engine.submit(buffer.pending(), IGNORE_EOS)
        rec.wait(engine, 1)
        assert list(rec.finished) == ["0-0"]
        assert [c.response_id for c in rec.take(engine.pause())] == ["1-0"] and engine.wait_finished(0) == []
        keep = {"1-0": 1, "0-0": 10}
        buffer.apply_truncation(keep)
        engine.truncate(keep)
        engine.update_weights(iter([[("lm_head.weight", torch.ones(128, 8, dtype=torch.bfloat16))]]), version=3)
        assert engine_.updates == [1] and engine.health()[0]["version"] == 3
        engine.resume()
        rec.finished.clear()
        rec.wait(engine, 2)
        for rid, n, k in (("0-0", 30, 10), ("1-0", 400, 1)):
            r = buffer.get(rid)
            assert r.num_tokens == n and (r.versions[:1] == 0).all() and (r.versions[k:] == 3).all()


def test_a_tokens_version_means_one_thing_in_the_core_and_on_the_wire():
    """An environment token's version is one value in the controller's records and on the wire, and differs from
    the wire's 'unknown' and from every policy version; a carried response is submitted with its versions as
    they are."""
    from rollverify.types import ENV_VERSION as CORE_ENV_VERSION
    from rollverify.types import Response
    from sglang_ext.protocol import ENV_VERSION, UNKNOWN_VERSION
    from sglang_ext.rollout_engine import _request

    assert CORE_ENV_VERSION == ENV_VERSION < 0 and UNKNOWN_VERSION < 0 and ENV_VERSION != UNKNOWN_VERSION
    r = Response(group_id=0, index=0, prompt_ids=[1, 2], max_new_tokens=64)
    r.append([5, 6], [-0.5, -0.4], 3, finished=False)
    r.append_environment([7, 8, 9])
    r.append([10], [-0.1], 4, finished=False)
    assert r.versions.tolist() == [3, 3, ENV_VERSION, ENV_VERSION, ENV_VERSION, 4]
    req = _request(r)
    assert np.asarray(req.prefix_versions).tolist() == r.versions.tolist()

