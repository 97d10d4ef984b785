"""Benchmark two-stage verification on a packed batch with long-tailed response lengths.

Compares, in one run on one device:
  verify     rollverify.verify.two_stage_verify on the whole batch
  floor      reading the same input bytes once (a sum over old, new log-probs and versions): the memory floor
  reference  the per-token Python reference (rollverify/verify_reference.py), timed on a subsample of whole
             responses and extrapolated per token (it is far too slow for the full batch)

Targets: verify <= 3x the floor, and >= 100x faster than the reference. Times are best-of-N wall-clock
(the machine may be shared; medians are printed too) and, on CPU, best-of-N CPU time of this thread, which
a shared machine disturbs far less (waiting for a core does not count; contention for memory still does).
Prints a table and writes JSON. ``--profile`` adds where verify's time goes: each operation's CPU time per
call (cProfile on the thread's CPU clock), the passes it makes over the data and the bytes they touch.

    python tools/bench_verify.py                      # 1024 responses, mean ~8K, max 32K tokens, CPU
    python tools/bench_verify.py --threads 1 --repeats 20 --profile
    python tools/bench_verify.py --device cuda        # the same on a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from rollverify.verify import D_S, D_T, two_stage_verify
from rollverify.verify_reference import reference_verify


def make_batch(responses: int, mean_len: int, max_len: int, max_segments: int, seed: int):
    """Log-normal lengths (sigma 0.7) clipped to [1, max_len]; 1..max_segments versions per response.

    Most tokens drift a little (|gap| ~ 0.005); a third of the responses drift more in their latest
    segment, and about 1 token in 20K has a large gap, so both stages have work to do.
    """
    rng = np.random.default_rng(seed)
    sigma = 0.7
    lengths = np.clip(rng.lognormal(math.log(mean_len) - sigma**2 / 2, sigma, responses), 1, max_len).astype(np.int64)
    n = int(lengths.sum())
    old = -rng.exponential(1.0, n).astype(np.float32)
    gap = rng.normal(0.0, 0.005, n).astype(np.float32)
    versions = np.empty(n, np.int64)
    pos = 0
    for length in lengths:
        k = int(rng.integers(1, max_segments + 1))
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(k - 1, length - 1), replace=False))
        seg = np.zeros(length, np.int64)
        np.add.at(seg, cuts, 1)
        seg = np.cumsum(seg)
        versions[pos : pos + length] = 100 - seg[-1] + seg  # oldest segment first, newest = version 100
        if rng.random() < 1 / 3:
            last = seg == seg[-1]
            gap[pos : pos + length][last] *= 4
        pos += length
    spikes = rng.random(n) < 5e-5
    gap[spikes] = rng.choice([-3.0, 2.0], spikes.sum())
    return old, old + gap, versions, lengths


def timed(fn, sync) -> tuple[float, float]:
    """Wall-clock and this thread's CPU seconds of one call."""
    sync()
    start, cpu = time.perf_counter(), time.thread_time()
    fn()
    sync()
    return time.perf_counter() - start, time.thread_time() - cpu


def profile(verify, calls: int, n: int) -> list[dict]:
    """verify's CPU time per operation (cProfile on the thread's CPU clock, per verify call), largest first."""
    import cProfile
    import pstats

    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(calls):
        verify()
    prof.disable()
    rows = []
    for (file, line, name), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        rows.append({"op": where, "calls_per_verify": ncalls / calls, "ms_per_verify": tottime / calls * 1e3,
                     "ns_per_token": tottime / calls / n * 1e9})
    return sorted(rows, key=lambda r: -r["ms_per_verify"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--responses", type=int, default=1024)
    p.add_argument("--mean-len", type=int, default=8192)
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--max-segments", type=int, default=6)
    p.add_argument("--d-s", type=float, default=D_S)
    p.add_argument("--d-t", type=float, default=D_T)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ref-tokens", type=int, default=300_000, help="reference subsample size (whole responses)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--block", type=int, default=None, help="tokens per streamed block (default: automatic)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also print verify's CPU time per operation")
    p.add_argument("--out", default="runs/bench_verify.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    old_np, new_np, versions_np, lengths_np = make_batch(
        args.responses, args.mean_len, args.max_len, args.max_segments, args.seed
    )
    old, new, versions, lengths = (torch.from_numpy(a).to(device) for a in (old_np, new_np, versions_np, lengths_np))
    n = old.numel()
    input_bytes = sum(x.numel() * x.element_size() for x in (old, new, versions, lengths))

    def verify():
        return two_stage_verify(old, new, versions, lengths, args.d_s, args.d_t, block=args.block)

    def floor():
        return old.sum(), new.sum(), versions.sum(), lengths.sum()

    start = time.perf_counter()
    verify()  # warm-up; on CPU its first large batch also compiles the row-sum kernel
    first_call_s = time.perf_counter() - start
    floor()
    t_verify, t_floor, c_verify, c_floor = [], [], [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        wall, cpu = timed(floor, sync)
        t_floor.append(wall)
        c_floor.append(cpu)
        wall, cpu = timed(verify, sync)
        t_verify.append(wall)
        c_verify.append(cpu)
    result = verify()

    # Reference on a subsample of whole responses; it must agree with the vectorised result there.
    k = int(np.searchsorted(np.cumsum(lengths_np), args.ref_tokens)) + 1
    k = min(k, len(lengths_np))
    m = int(lengths_np[:k].sum())
    start = time.perf_counter()
    ref_keep = reference_verify(
        old_np[:m].tolist(), new_np[:m].tolist(), versions_np[:m].tolist(), lengths_np[:k].tolist(), args.d_s, args.d_t
    )
    t_ref_sub = time.perf_counter() - start
    agrees = ref_keep == result.keep_lengths[:k].tolist()
    t_ref = t_ref_sub / m * n

    best_v, best_f = min(t_verify), min(t_floor)
    cpu_v, cpu_f = min(c_verify), min(c_floor)
    report = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "first_call_s": first_call_s,
        "load_average_1min": os.getloadavg()[0],
        "responses": len(lengths_np),
        "tokens": n,
        "mean_length": float(lengths_np.mean()),
        "max_length": int(lengths_np.max()),
        "segments": int(result.segment_starts.numel()),
        "input_bytes": input_bytes,
        "d_s": args.d_s,
        "d_t": args.d_t,
        "repeats": args.repeats,
        "verify_s_min": best_v,
        "verify_s_median": statistics.median(t_verify),
        "floor_s_min": best_f,
        "floor_s_median": statistics.median(t_floor),
        "floor_GBps": input_bytes / best_f / 1e9,
        "verify_cpu_s_min": cpu_v,
        "floor_cpu_s_min": cpu_f,
        "x_floor_cpu": cpu_v / cpu_f if cpu_f > 0 else math.nan,
        "reference_subsample_tokens": m,
        "reference_subsample_s": t_ref_sub,
        "reference_s_extrapolated": t_ref,
        "reference_agrees_on_subsample": agrees,
        "x_floor": best_v / best_f,
        "x_faster_than_reference": t_ref / best_v,
        "acceptance_rate": result.acceptance_rate,
        "kept_whole_rate": result.kept_whole_rate,
        "target_x_floor_le_3": best_v / best_f <= 3.0,
        "target_x_reference_ge_100": t_ref / best_v >= 100.0,
    }
    ms = 1e3
    print(f"batch: {report['responses']} responses, {n:,} tokens (mean {report['mean_length']:.0f}, "
          f"max {report['max_length']}), {report['segments']} segments, {input_bytes / 2**20:.0f} MiB input; "
          f"device {device}, {report['threads']} threads (load average {report['load_average_1min']:.1f}); "
          f"acceptance {result.acceptance_rate:.3f}; first call {first_call_s:.1f} s (compiles on CPU)")
    print(f"{'':34s}{'best ms':>10s}{'median ms':>11s}{'ratio':>10s}")
    print(f"{'verify (two_stage_verify)':34s}{best_v * ms:10.2f}{statistics.median(t_verify) * ms:11.2f}{'':>10s}")
    print(f"{'memory floor (read inputs once)':34s}{best_f * ms:10.2f}{statistics.median(t_floor) * ms:11.2f}"
          f"{best_v / best_f:9.2f}x   target <= 3x: {'met' if report['target_x_floor_le_3'] else 'NOT met'}")
    if device.type == "cpu":
        print(f"{'CPU time of this thread: verify':34s}{cpu_v * ms:10.2f}{'':>11s}{'':>10s}")
        print(f"{'CPU time of this thread: floor':34s}{cpu_f * ms:10.2f}{'':>11s}{report['x_floor_cpu']:9.2f}x")
    print(f"{'per-token reference (extrapolated)':34s}{t_ref * ms:10.0f}{'':>11s}{t_ref / best_v:9.0f}x   "
          f"target >= 100x: {'met' if report['target_x_reference_ge_100'] else 'NOT met'}")
    print(f"reference timed on {m:,} tokens ({k} whole responses) in {t_ref_sub:.2f} s, extrapolated per token "
          f"to {n:,}; agrees with verify there: {agrees}")
    if args.profile:
        report["profile"] = profile(verify, max(3, args.repeats // 4), n)
        print(f"verify's CPU time per operation (cProfile, per verify call; {n * 8 / 2**20:.0f} MiB of log-probs "
              f"and {n * 8 / 2**20:.0f} MiB of versions read once):")
        for row in report["profile"][:14]:
            print(f"  {row['ms_per_verify']:8.2f} ms {row['ns_per_token']:6.3f} ns/token "
                  f"{row['calls_per_verify']:6.0f} calls  {row['op']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if not agrees:
        sys.exit("verify disagrees with the reference on the subsample")


if __name__ == "__main__":
    main()
