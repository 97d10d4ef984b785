"""Benchmark the Megatron-Core trainer: ComputeProb tokens/s, train-step time, weight-sync time.

    python tools/bench_trainer.py                      # tiny dense and MoE, world size 1, this machine
    python tools/bench_trainer.py --world-size 2 --tp 2 --models dense
    python tools/bench_trainer.py --model-path /ckpt/Qwen3-8B --seqs 64 --prompt-len 512 --gen-len 3584
    python tools/bench_trainer.py --memory --json mem.json   # peak memory vs tokens per sequence (1K..16K)

Prints a table and writes JSON (--json). The same command runs on a GPU machine (bf16, NCCL) unchanged: the
trainer picks the device (TrainerConfig.device="auto"), world size > 1 spawns ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _batch(n: int, prompt_len: int, gen_len: int, vocab: int, arch, seed: int = 0):
    from megatron_bridge.batch import TrainSequence

    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        g = max(1, int(gen_len * (0.5 + rng.random())))  # long-tailed-ish lengths around gen_len
        s = TrainSequence(rng.integers(4, vocab, prompt_len), rng.integers(4, vocab, g),
                          advantage=1.0 if i % 2 else -1.0)
        if arch.moe:
            s.routed_experts = np.stack([rng.permutation(arch.num_experts)[:arch.top_k]
                                         for _ in range(s.num_inputs * arch.num_layers)]).reshape(
                s.num_inputs, arch.num_layers, arch.top_k).astype(np.int32)
        seqs.append(s)
    return seqs


def _timed(fn, repeats: int, sync=lambda: None) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench_one(name: str, path: str, args) -> dict:
    import torch

    from megatron_bridge.config import TrainerConfig
    from megatron_bridge.model import ModelArch
    from megatron_bridge.spawned import make_trainer
    from megatron_bridge.trainer import resolve_device
    from megatron_bridge.weight_sync import DiskSink, InMemorySink

    arch = ModelArch.from_hf_dir(path)
    cfg = TrainerConfig(tp=args.tp, ep=args.ep if arch.moe else 1, pp=args.pp, lr=1e-5,
                        micro_batch_tokens=args.micro_batch_tokens, device=args.device)
    sync = torch.cuda.synchronize if resolve_device(cfg.device) == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    trainer = make_trainer(path, cfg, world_size=args.world_size)
    t_init = time.perf_counter() - t0
    seqs = _batch(args.seqs, args.prompt_len, args.gen_len, arch.vocab_size, arch)
    n_in = sum(s.num_inputs for s in seqs)
    n_gen = sum(s.gen_ids.size for s in seqs)
    try:
        trainer.compute_logprobs(seqs[:2])  # warm-up
        t_lp, (lp, _) = _timed(lambda: trainer.compute_logprobs(seqs, replay=arch.moe), args.repeats, sync)
        for s, a in zip(seqs, np.split(lp, np.cumsum([s.gen_ids.size for s in seqs])[:-1]), strict=True):
            s.rollout_logprobs = a
        t_step, metrics = _timed(lambda: trainer.train_step(seqs), args.repeats, sync)
        t_mem, stats = _timed(lambda: trainer.sync_weights(InMemorySink(), version=1), args.repeats, sync)
        with tempfile.TemporaryDirectory() as d:
            t_disk, _ = _timed(lambda: trainer.sync_weights(DiskSink(Path(d) / "w", path), version=1),
                               args.repeats, sync)
    finally:
        trainer.close()
    return {
        "model": name, "path": str(path), "moe": arch.moe, "params_M": _param_count(arch) / 1e6,
        "world_size": args.world_size, "tp": cfg.tp, "ep": cfg.ep, "pp": cfg.pp,
        "device": cfg.resolved_device(), "dtype": str(cfg.resolved_dtype()).removeprefix("torch."),
        "seqs": len(seqs), "input_tokens": n_in, "generated_tokens": n_gen,
        "micro_batch_tokens": cfg.micro_batch_tokens,
        "init_s": t_init,
        "computeprob_s": t_lp, "computeprob_tokens_per_s": n_in / t_lp, "computeprob_gen_tokens_per_s": n_gen / t_lp,
        "train_step_s": t_step, "train_tokens_per_s": n_in / t_step,
        "sync_memory_s": t_mem, "sync_disk_s": t_disk, "sync_bytes": stats["sync_bytes"],
        "sync_memory_GBps": stats["sync_bytes"] / t_mem / 1e9,
        "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
    }


def _param_count(arch) -> int:
    from megatron_bridge.convert import _entries

    return sum(int(np.prod(s)) for e in _entries(arch) for s in e.hf_shapes)


# --memory: the tiny model, and a wider random one, both with a context long enough for the longest length
MEMORY_MODELS = {
    "tiny": dict(max_position_embeddings=32768),
    "wide": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=64, max_position_embeddings=32768),
}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_during(fn) -> tuple[int, object]:
    """(peak resident bytes above the resident size just before, result) of `fn()` in this process (Linux:
    glibc's free memory is returned first and the high-water mark reset through /proc/self/clear_refs)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kib("VmRSS")
    out = fn()
    return (_rss_kib("VmHWM") - before) * 1024, out


def _memory_worker(model: str, tokens: int, threads: int, recompute: str = "none") -> dict:
    """One (model, tokens per sequence) point in a fresh process: ComputeProb, then a train step, on one
    sequence of `tokens` inputs (a quarter prompt)."""
    import torch

    warnings.filterwarnings("ignore")
    if threads:
        torch.set_num_threads(threads)
    from megatron_bridge.batch import TrainSequence
    from megatron_bridge.config import TrainerConfig
    from megatron_bridge.model import ModelArch
    from megatron_bridge.trainer import MegatronTrainer
    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

    path = ensure_tiny_model(TinyModelSpec(**MEMORY_MODELS[model]))
    arch = ModelArch.from_hf_dir(path)
    trainer = MegatronTrainer(path, TrainerConfig(micro_batch_tokens=tokens, lr=1e-5, device="cpu",
                                                  recompute=recompute), dtype="float32")
    rng = np.random.default_rng(0)
    prompt = tokens // 4
    seq = TrainSequence(rng.integers(4, arch.vocab_size, prompt), rng.integers(4, arch.vocab_size, tokens - prompt + 1),
                        advantage=1.0)
    try:
        trainer.compute_logprobs([TrainSequence(seq.prompt_ids[:8], seq.gen_ids[:8])])  # warm-up
        t = time.perf_counter()
        lp_peak, (lp, _) = _peak_during(lambda: trainer.compute_logprobs([seq]))
        t_lp = time.perf_counter() - t
        seq.rollout_logprobs = lp
        t = time.perf_counter()
        step_peak, metrics = _peak_during(lambda: trainer.train_step([seq]))
        t_step = time.perf_counter() - t
    finally:
        trainer.close()
    return {"model": model, "tokens": tokens, "recompute": recompute, "params_M": _param_count(arch) / 1e6,
            "hidden": arch.hidden_size, "layers": arch.num_layers, "vocab": arch.vocab_size,
            "computeprob_peak_MiB": lp_peak / 2**20, "train_step_peak_MiB": step_peak / 2**20,
            "computeprob_s": t_lp, "train_step_s": t_step, "grad_norm": metrics["grad_norm"]}


def bench_memory(args) -> list[dict]:
    """Peak memory above the loaded trainer, per model and tokens per sequence; each point in a fresh process
    so that no allocator cache from an earlier point hides a later one's growth."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for model in args.memory_models.split(","):
        for tokens in (int(x) for x in args.lengths.split(",")):
            with ctx.Pool(1) as pool:
                rows.append(pool.apply(_memory_worker, (model, tokens, args.threads, args.recompute)))
            r = rows[-1]
            print(f"{model:>5} {tokens:>6} tokens: ComputeProb peak {r['computeprob_peak_MiB']:8.1f} MiB "
                  f"({r['computeprob_s']:.1f} s), train step peak {r['train_step_peak_MiB']:8.1f} MiB "
                  f"({r['train_step_s']:.1f} s)", flush=True)
    for model in args.memory_models.split(","):
        mine = [r for r in rows if r["model"] == model]
        lo, hi = mine[0], mine[-1]
        for key in ("computeprob_peak_MiB", "train_step_peak_MiB"):
            ratio = hi[key] / max(lo[key], 1e-9)
            for r in mine:
                r[key.replace("_MiB", "_growth")] = r[key] / max(lo[key], 1e-9)
            print(f"{model}: {key} {hi['tokens']}/{lo['tokens']} tokens = {ratio:.1f}x "
                  f"(tokens {hi['tokens'] / lo['tokens']:.0f}x; target <= 20x)")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="dense,moe", help="tiny models to bench: dense, moe (comma list)")
    p.add_argument("--model-path", default=None, help="bench this HF checkpoint instead of the tiny models")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=96)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads in this process (0: torch's default)")
    p.add_argument("--json", default=None, help="write results here (default: print only)")
    p.add_argument("--memory", action="store_true", help="peak memory vs tokens per sequence instead (CPU)")
    p.add_argument("--memory-models", default="tiny,wide", help=f"with --memory: of {', '.join(MEMORY_MODELS)}")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="with --memory: tokens per sequence")
    p.add_argument("--recompute", default="none", help="with --memory: activation recompute (none|selective|full)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    if args.memory:
        rows = bench_memory(args)
        if args.json:
            out = {"host": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "memory": rows}
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
            print(f"wrote {args.json}")
        return 0
    if args.model_path:
        targets = [(Path(args.model_path).name, args.model_path)]
    else:
        from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

        targets = [(m, str(ensure_tiny_model(TinyModelSpec(moe=m == "moe")))) for m in args.models.split(",")]
    rows = [bench_one(name, path, args) for name, path in targets]

    cols = [("model", "{}"), ("device", "{}"), ("dtype", "{}"), ("world_size", "{}"), ("input_tokens", "{}"),
            ("computeprob_tokens_per_s", "{:,.0f}"), ("train_step_s", "{:.3f}"), ("train_tokens_per_s", "{:,.0f}"),
            ("sync_memory_s", "{:.4f}"), ("sync_disk_s", "{:.4f}"), ("sync_bytes", "{:,.0f}")]
    table = [[c for c, _ in cols]] + [[f.format(r[c]) for c, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for i, row in enumerate(table):
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    out = {"host": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
