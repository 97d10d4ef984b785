"""Benchmark the control channel against SGLang's own abort and generate time.

For N live responses (16, 256, 1024 by default) it measures, one engine at a time (both sides use the
server's engine settings; the server's idle niceness applies to the channel side only, and tools/bench_idle.py
measures what it and SGLang's sleep_on_idle change):

  pause-and-collect  SGLang alone: abort every request and await every partial output (in-process Engine, the
                     server's engine configuration). Channel: `SGLangRolloutEngine.pause()`, i.e. the same abort
                     inside the server plus caching, packing, the ZMQ round trip, decoding the reply's arrays and
                     one view per response at the controller. Appending those to a `RolloutBuffer` (what the loop
                     does next) is timed apart ("buffer").
  resume             SGLang alone: generate from prompt + kept prefix, one new token each (prefill + first token,
                     the work a resume starts). Channel: N paused responses holding that prefix, then `resume()`
                     until every finish event has reached the controller.

Overhead = channel / SGLang - 1, of the medians over repeats and of the best (minimum) of each side, which on a
shared machine is the steadier figure; target <= 10 % at 1024 responses. The channel's time is
also split into its own work (server packing + client decoding, measured in place) and the two process hops
(request and reply), which on a loaded small machine are mostly OS scheduling latency. Bytes on the wire per
delivered token are counted at the client.

    python tools/bench_control.py [--moe] [--sizes 16 256 1024] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sglang_ext.cpu_compat as cpu_compat  # noqa: E402

cpu_compat.activate()

MAX_NEW = 2048  # "unbounded" within the tiny model's 4096-token context


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 128, length).tolist() for _ in range(n)]


# ---------------------------------------------------------------------------------------------- SGLang alone


async def sglang_generate(tm, rid: str, ids: list[int], max_new: int, routes: bool, start: int = 0):
    """The request the server makes for a response (same flags), straight to SGLang's tokenizer manager."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(
        input_ids=ids,
        sampling_params={"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=-1,
        return_routed_experts=routes,
        routed_experts_start_len=start,
        rid=rid,
    )
    gen = tm.generate_request(obj, None)
    try:
        return await gen.__anext__()
    finally:
        await gen.aclose()


async def sglang_round(tm, n: int, plen: int, run_s: float, xlen: int, routes: bool, tag: str) -> dict:
    ps = prompts(n, plen, 0)
    tasks = [
        asyncio.ensure_future(sglang_generate(tm, f"b{tag}-{i}", p, MAX_NEW, routes))
        for i, p in enumerate(ps)
    ]
    await asyncio.sleep(run_s)
    t0 = time.perf_counter()
    tm.abort_request(abort_all=True)
    _, pending = await asyncio.wait(tasks, timeout=0.05)
    while pending:
        tm.abort_request(abort_all=True)
        _, pending = await asyncio.wait(pending, timeout=0.2)
    pause_s = time.perf_counter() - t0
    tokens = sum(len(t.result()["output_ids"]) for t in tasks)
    xs = prompts(n, xlen, 1)
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(
            sglang_generate(tm, f"r{tag}-{i}", p + x, 1, routes, plen + xlen - 1)
            for i, (p, x) in enumerate(zip(ps, xs, strict=True))
        )
    )
    resume_s = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == 1 for o in outs)
    return {"pause_s": pause_s, "resume_s": resume_s, "tokens": tokens}


# ---------------------------------------------------------------------------------------------- channel


def channel_round(engine, n: int, plen: int, run_s: float, xlen: int, tag: str) -> dict:
    """One pause and one resume through the loop's rollout engine; the pause's chunks also go into a
    RolloutBuffer, as the loop records them (timed apart: `buffer_s`)."""
    from rollverify.buffer import RolloutBuffer
    from rollverify.types import Group, Response
    from sglang_ext.protocol import WireSamplingParams

    sampling = WireSamplingParams(ignore_eos=True)
    conn = engine.pool.servers[0].conn
    buffer = RolloutBuffer()
    for i, p in enumerate(prompts(n, plen, 0)):
        buffer.add_group(Group.new(i, p, 1, MAX_NEW))
    engine.submit(buffer.pending(), sampling)
    time.sleep(run_s)
    b0 = conn.bytes_in.get("pause", 0)
    t0 = time.perf_counter()
    chunks = engine.pause()
    pause_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for c in chunks:
        buffer.record(c.response_id, c.token_ids, c.logprobs, c.versions, c.routed_experts, offset=c.offset)
    buffer_s = time.perf_counter() - t0
    body = engine.last_pause[0]
    out = {
        "pause_s": pause_s,
        "buffer_s": buffer_s,
        "tokens": sum(len(c.token_ids) for c in chunks),
        "pause_bytes": conn.bytes_in.get("pause", 0) - b0,
        "server_engine_s": body["engine_s"],
        "server_handled_s": body["handled_s"],
        "client_s": body["client_decode_s"] + body["client_chunks_s"],
        "request_hop_s": body["hops_s"][0],
        "reply_hop_s": body["hops_s"][1],
        "await_events_s": body["client_await_events_s"],
    }
    engine.drop([r.response_id for r in buffer.pending()])
    engine.wait_finished(0.0)  # responses that finished before the pause (none with these budgets)
    xs = prompts(n, xlen, 1)
    resumed = [
        Response(n + i, 0, p, xlen + 1, token_ids=x, logprobs=np.zeros(xlen, np.float32), versions=np.zeros(xlen))
        for i, (p, x) in enumerate(zip(prompts(n, plen, 0), xs, strict=True))
    ]
    engine.submit(resumed, sampling)  # the engine is paused: they wait for resume
    e0 = conn.bytes_in.get("events", 0)
    t0 = time.perf_counter()
    engine.resume()
    done = 0
    while done < n:
        done += len(engine.wait_finished(600))
    out["resume_s"] = time.perf_counter() - t0
    out["event_bytes"] = conn.bytes_in.get("events", 0) - e0
    engine.drop([r.response_id for r in resumed])
    return out


# ---------------------------------------------------------------------------------------------- report


def summarize(n: int, base: list[dict], chan: list[dict]) -> dict:
    med = statistics.median

    def m(rows, key):
        return med(r[key] for r in rows)

    def b(rows, key):
        return min(r[key] for r in rows)

    toks = sum(c["tokens"] for c in chan)
    own = [c["server_handled_s"] - c["server_engine_s"] + c["client_s"] for c in chan]
    hops = [c["pause_s"] - c["server_handled_s"] - c["client_s"] for c in chan]
    return {
        "responses": n,
        "sglang_pause_s": m(base, "pause_s"),
        "channel_pause_s": m(chan, "pause_s"),
        "pause_overhead": m(chan, "pause_s") / m(base, "pause_s") - 1,
        "pause_overhead_best": b(chan, "pause_s") / b(base, "pause_s") - 1,
        "buffer_append_s": m(chan, "buffer_s"),
        "channel_pause_own_work_s": med(own),
        "channel_pause_hops_s": med(hops),
        "server_engine_pause_s": m(chan, "server_engine_s"),
        "request_hop_s": m(chan, "request_hop_s"),
        "reply_hop_s": m(chan, "reply_hop_s"),
        "await_events_s": m(chan, "await_events_s"),
        "sglang_resume_s": m(base, "resume_s"),
        "channel_resume_s": m(chan, "resume_s"),
        "resume_overhead": m(chan, "resume_s") / m(base, "resume_s") - 1,
        "resume_overhead_best": b(chan, "resume_s") / b(base, "resume_s") - 1,
        "tokens_per_pause": toks / len(chan),
        "pause_bytes_per_token": sum(c["pause_bytes"] for c in chan) / max(toks, 1),
        "event_bytes_per_token": sum(c["event_bytes"] for c in chan) / (n * len(chan)),
        "repeats": len(chan),
        "raw": {"sglang": base, "channel": chan},
    }


def table(rows: list[dict]) -> str:
    head = (
        "responses",
        "SGLang pause ms",
        "channel pause ms",
        "overhead",
        "best",
        "own work ms",
        "hops ms",
        "buffer ms",
        "SGLang resume ms",
        "channel resume ms",
        "overhead",
        "best",
        "B/token pause",
        "B/token event",
    )
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    for r in rows:
        lines.append(
            " | ".join(
                [
                    str(r["responses"]),
                    f"{r['sglang_pause_s'] * 1e3:.1f}",
                    f"{r['channel_pause_s'] * 1e3:.1f}",
                    f"{r['pause_overhead']:+.1%}",
                    f"{r['pause_overhead_best']:+.1%}",
                    f"{r['channel_pause_own_work_s'] * 1e3:.1f}",
                    f"{r['channel_pause_hops_s'] * 1e3:.1f}",
                    f"{r['buffer_append_s'] * 1e3:.1f}",
                    f"{r['sglang_resume_s'] * 1e3:.1f}",
                    f"{r['channel_resume_s'] * 1e3:.1f}",
                    f"{r['resume_overhead']:+.1%}",
                    f"{r['resume_overhead_best']:+.1%}",
                    f"{r['pause_bytes_per_token']:.1f}",
                    f"{r['event_bytes_per_token']:.1f}",
                ]
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moe", action="store_true", help="tiny Qwen3-MoE with routed experts (default: dense)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=16, help="kept prefix of each resumed response")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)

    import sglang as sgl

    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model
    from sglang_ext.client import ServerConnection
    from sglang_ext.engine import default_engine_kwargs
    from sglang_ext.launch import launch_server
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    model = ensure_tiny_model(TinyModelSpec(moe=a.moe))
    big = max(a.sizes)
    engine_args = {
        "max_total_tokens": max(65536, big * (a.prompt_len + a.prefix_len + 64)),
        "max_running_requests": big,
    }
    sizes = list(a.sizes)
    base: dict[int, list] = {n: [] for n in sizes}
    chan: dict[int, list] = {n: [] for n in sizes}

    kwargs = {
        **default_engine_kwargs(),
        **engine_args,
        "log_level": "error",
        "enable_return_routed_experts": a.moe,
    }
    engine = sgl.Engine(model_path=str(model), **kwargs)
    try:

        async def run_sglang():
            tm = engine.tokenizer_manager
            await tm.freeze_gc()  # as the server does after start (SGLang's own advice for serving)
            await sglang_round(tm, 8, a.prompt_len, 0.3, a.prefix_len, a.moe, "warm")  # one-off costs
            for rep in range(a.repeats):
                for n in sizes:
                    r = await sglang_round(
                        tm, n, a.prompt_len, 0.3 + n / 1024, a.prefix_len, a.moe, f"{n}-{rep}"
                    )
                    base[n].append(r)
                    print(
                        f"  SGLang  N={n}: pause {r['pause_s'] * 1e3:.0f} ms, resume {r['resume_s'] * 1e3:.0f} ms",
                        flush=True,
                    )

        engine.loop.run_until_complete(run_sglang())
    finally:
        engine.shutdown()

    server = launch_server(model, engine_args=engine_args)
    # The controller process holds torch and SGLang's modules (millions of objects): freeze them out of the
    # garbage collector's full passes, as the server does after start.
    gc.collect()
    gc.freeze()
    idle_rtt = []
    try:

        async def idle_round_trips():
            conn = await ServerConnection(server.endpoint).start()
            for _ in range(50):
                t0 = time.perf_counter()
                await conn.health()
                idle_rtt.append(time.perf_counter() - t0)
            await conn.close()

        asyncio.run(idle_round_trips())
        with SGLangRolloutEngine([server.endpoint], poll_wait_s=0.5) as engine:
            channel_round(engine, 8, a.prompt_len, 0.3, a.prefix_len, "warm")
            for rep in range(a.repeats):
                for n in sizes:
                    r = channel_round(engine, n, a.prompt_len, 0.3 + n / 1024, a.prefix_len, f"{n}-{rep}")
                    chan[n].append(r)
                    print(
                        f"  channel N={n}: pause {r['pause_s'] * 1e3:.0f} ms (engine {r['server_engine_s'] * 1e3:.0f},"
                        f" request hop {r['request_hop_s'] * 1e3:.1f}, reply hop {r['reply_hop_s'] * 1e3:.1f},"
                        f" client {r['client_s'] * 1e3:.1f}, events {r['await_events_s'] * 1e3:.1f};"
                        f" buffer {r['buffer_s'] * 1e3:.1f}), resume {r['resume_s'] * 1e3:.0f} ms",
                        flush=True,
                    )
    finally:
        server.stop()

    rows = [summarize(n, base[n], chan[n]) for n in sizes]
    result = {
        "model": str(model),
        "moe": a.moe,
        "prompt_len": a.prompt_len,
        "prefix_len": a.prefix_len,
        "cpus": os.cpu_count(),
        "load_avg_after": os.getloadavg(),
        "idle_round_trip_ms": statistics.median(idle_rtt) * 1e3,
        "rows": rows,
        "target": "channel adds <= 10% to SGLang's own time at 1024 responses",
    }
    print()
    print(table(rows))
    print(
        f"idle request round trip: {result['idle_round_trip_ms']:.2f} ms; load average after: {result['load_avg_after']}"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
