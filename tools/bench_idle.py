"""CPU use of an idle rollout server, and what the idle setting costs when work arrives.

For each setting it starts a real server on the tiny model: `busy` (SGLang's event loop spins while idle, the
server leaves its priority alone: `--idle-nice 0`), `idle_nice` (the server's default: SGLang's processes run at
niceness 19 while nothing generates) and `sleep_on_idle` (SGLang's own setting: the idle scheduler waits in a zmq
poll), and measures:

  idle_cpu_pct      CPU time of the whole process tree (server + SGLang's scheduler and detokenizer) over
                    `--idle-s` seconds of doing nothing, as % of one core
  contended_cpu_pct the same while one CPU-bound process per core runs beside it (the trainer between
                    rollouts), and `trainer_cpu_pct`, the CPU those processes got (of 100 % x cores)
  wake_ms           one short response submitted to an idle server: submit until its finish event (median)
  decode_tok_s      `--batch` responses of `--tokens` tokens each, submit to last finish (tokens per second)
  pause_ms          pause of `--batch` generating responses (abort and collect every partial output; median)

Best of `--repeats` for the throughput figures, median for latencies. The machine may be shared: run it when
it is quiet, and read the figures as relative between the settings.

    python tools/bench_idle.py [--moe] [--modes busy idle_nice sleep_on_idle] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sglang_ext.cpu_compat as cpu_compat  # noqa: E402

cpu_compat.activate()

MODES = {  # engine arguments, server arguments
    "busy": ({}, ["--idle-nice", "0"]),
    "idle_nice": ({}, []),
    "sleep_on_idle": ({"sleep_on_idle": True}, ["--idle-nice", "0"]),
}


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def contended_cpu_pct(pid: int, seconds: float) -> tuple[float, float]:
    """Server tree CPU % and the competitors' CPU % while one spinning process per core runs."""
    import multiprocessing as mp

    import psutil

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,)) for _ in range(os.cpu_count() or 1)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    comp = [psutil.Process(p.pid) for p in procs]

    def comp_s() -> float:
        return sum(c.cpu_times().user + c.cpu_times().system for c in comp)

    c0, k0, t0 = tree_cpu_s(pid), comp_s(), time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    server, trainer = 100.0 * (tree_cpu_s(pid) - c0) / dt, 100.0 * (comp_s() - k0) / dt
    stop.set()
    for p in procs:
        p.join()
    return server, trainer


def tree_cpu_s(pid: int) -> float:
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def idle_cpu_pct(pid: int, seconds: float) -> float:
    c0, t0 = tree_cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return 100.0 * (tree_cpu_s(pid) - c0) / (time.monotonic() - t0)


def work(endpoint: str, batch: int, tokens: int, repeats: int) -> dict:
    from rollverify.types import Response
    from sglang_ext.protocol import WireSamplingParams
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    sampling = WireSamplingParams(ignore_eos=True)
    out: dict = {"wake_ms": [], "decode_tok_s": [], "pause_ms": []}

    def finish(engine, responses) -> None:
        left = len(responses)
        while left:
            left -= sum(c.finish_reason is not None for c in engine.wait_finished(300))
        engine.drop([r.response_id for r in responses])

    with SGLangRolloutEngine([endpoint], poll_wait_s=0.2) as engine:
        for r in range(repeats):
            time.sleep(1.5)  # idle long enough for an idle scheduler to park
            wake = [Response(3 * r, 0, [5, 6, 7], 4)]
            t0 = time.perf_counter()
            engine.submit(wake, sampling)
            finish(engine, wake)
            out["wake_ms"].append(1e3 * (time.perf_counter() - t0))
            decode = [Response(3 * r + 1, i, [4 + i % 120, 6, 7], tokens) for i in range(batch)]
            t0 = time.perf_counter()
            engine.submit(decode, sampling)
            finish(engine, decode)
            out["decode_tok_s"].append(batch * tokens / (time.perf_counter() - t0))
            paused = [Response(3 * r + 2, i, [4 + (i * 7) % 120, 6, 7], 2048) for i in range(batch)]
            engine.submit(paused, sampling)
            time.sleep(0.5)
            t0 = time.perf_counter()
            engine.pause()
            out["pause_ms"].append(1e3 * (time.perf_counter() - t0))
            engine.drop([x.response_id for x in paused])
            engine.resume()
    return {
        "wake_ms": statistics.median(out["wake_ms"]),
        "decode_tok_s": max(out["decode_tok_s"]),
        "pause_ms": statistics.median(out["pause_ms"]),
        "raw": out,
    }


def measure(mode: str, moe: bool, a: argparse.Namespace) -> dict:
    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model
    from sglang_ext.launch import launch_server

    model = ensure_tiny_model(TinyModelSpec(moe=moe))
    engine_args, server_args = MODES[mode]
    with launch_server(model, engine_args=engine_args, args=server_args) as sp:
        time.sleep(a.settle_s)
        idle = [idle_cpu_pct(sp.pid, a.idle_s) for _ in range(a.repeats)]
        contended = [contended_cpu_pct(sp.pid, a.idle_s) for _ in range(a.repeats)]
        res = work(sp.endpoint, a.batch, a.tokens, a.repeats)
        time.sleep(a.settle_s)
        idle_after = idle_cpu_pct(sp.pid, a.idle_s)  # idle again after work (a parked loop must re-park)
    server, trainer = min(contended, key=lambda x: x[0])
    return {
        "mode": mode,
        "idle_cpu_pct": min(idle),
        "idle_cpu_pct_after_work": idle_after,
        "contended_cpu_pct": server,
        "trainer_cpu_pct": trainer,
        **res,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    rows = [measure(m, a.moe, a) for m in a.modes]
    for r in rows:
        print(
            f"{r['mode']:>14}: idle CPU {r['idle_cpu_pct']:6.1f} % (after work {r['idle_cpu_pct_after_work']:6.1f} %,"
            f" beside a CPU-bound load {r['contended_cpu_pct']:5.1f} %, the load got {r['trainer_cpu_pct']:5.1f} %)"
            f"  wake {r['wake_ms']:7.1f} ms  decode {r['decode_tok_s']:8.1f} tok/s  pause {r['pause_ms']:7.1f} ms"
        )
    if a.json:
        out = {"model": "moe" if a.moe else "dense", "cpus": os.cpu_count(), "load_avg_after": os.getloadavg()}
        Path(a.json).write_text(json.dumps({**out, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
