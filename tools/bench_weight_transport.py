"""Weight update per transport on CPU: sync time and the bytes that cross the host, per update and per server.

Starts `--servers` real servers on the tiny model and a Megatron-Core trainer (world size 1, in this process),
then pushes the trainer's weights `--repeats` times through each transport:

  in_memory    the local launcher's path: the trainer's buckets through this (driver) process, ZMQ frames to
               every server, staged in each server until the commit (`SGLangRolloutEngine.update_weights`)
  distributed  SGLang's weight-update group (gloo here, NCCL on GPUs): the source rank broadcasts flattened
               buckets; ZMQ carries only bucket metadata and the commit
  ipc          flattened buckets as serialized handles (torch shared memory here, CUDA IPC on GPUs)

and reports best-of-N and median sync time, the model's bytes, what crossed the driver and ZMQ (measured from
the connections' byte counters), and the same figures stated for the 8B config from its parameter count. The
machine may be shared: read the times as relative between transports.

    python tools/bench_weight_transport.py [--servers 2] [--repeats 5] [--json runs/bench/weight_transport.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sglang_ext.cpu_compat as cpu_compat  # noqa: E402

cpu_compat.activate()

QWEN3_8B_PARAMS = 8_190_735_360  # Qwen3-8B, tied embeddings off (HF config): the 8B config's model
BF16 = 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-kib", type=int, default=256)
    p.add_argument("--json", default="runs/bench/weight_transport.json")
    args = p.parse_args(argv)

    from megatron_bridge.loop_adapter import LoopTrainer
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig
    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model
    from rollverify.app.weight_transport import TransportSpec
    from sglang_ext.launch import launch_server
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    path = ensure_tiny_model(TinyModelSpec())
    bucket = args.bucket_kib << 10
    with ThreadPoolExecutor(args.servers) as pool:
        futures = [pool.submit(launch_server, path, engine_args={"max_total_tokens": 4096, "mem_fraction_static": 0.9},
                               startup_timeout_s=900.0) for _ in range(args.servers)]
    servers = [f.result() for f in futures]
    trainer = MegatronTrainer(path, TrainerConfig())
    loop_trainer = LoopTrainer(trainer, bucket)
    results: dict[str, dict] = {}
    try:
        with SGLangRolloutEngine([s.endpoint for s in servers], timeout_s=600.0) as engine:
            engine.pause()
            model_bytes = sum(t.numel() * t.element_size() for _, t in trainer.iter_hf_tensors())
            version = 0

            def in_memory() -> dict:
                before = sum(s.conn.bytes_out.get("update_weights", 0) for s in engine.pool.servers)
                engine.update_weights(loop_trainer.export_weights(), version)
                zmq = sum(s.conn.bytes_out.get("update_weights", 0) for s in engine.pool.servers) - before
                return {"driver_bytes": float(model_bytes), "zmq_bytes": float(zmq)}

            group = f"bench-{uuid.uuid4().hex[:8]}"

            def transport(kind: str):
                def run() -> dict:
                    spec = TransportSpec(kind, tuple(s.endpoint for s in servers), master_addr="127.0.0.1",
                                         group=group, timeout_s=600.0)
                    stats = trainer.send_weights(spec, version, bucket)
                    return {"driver_bytes": 0.0, "zmq_bytes": stats["sync_control_bytes"]}
                return run

            for name, fn in (("in_memory", in_memory), ("distributed", transport("distributed")),
                             ("ipc", transport("ipc"))):
                times, last = [], {}
                for _ in range(args.repeats + 1):  # the first is a warm-up (the group's rendezvous, imports)
                    version += 1
                    t0 = time.perf_counter()
                    last = fn()
                    times.append(time.perf_counter() - t0)
                times = times[1:]
                results[name] = {"best_s": min(times), "median_s": statistics.median(times), **last}
                print(f"{name:12s} best {min(times) * 1e3:7.1f} ms  median {statistics.median(times) * 1e3:7.1f} ms"
                      f"  driver {last['driver_bytes'] / 2**20:6.2f} MiB  zmq {last['zmq_bytes'] / 2**20:8.3f} MiB",
                      flush=True)
            engine.resume()
    finally:
        trainer.close()
        for s in servers:
            s.stop()
    n = args.servers
    per_server = {  # bytes that reach one server per update, and through which path
        "in_memory": f"{model_bytes} B over ZMQ/TCP from the driver (after {model_bytes} B trainer -> driver)",
        "distributed": f"{model_bytes} B over the weight-update group (gloo here, NCCL on GPUs); ZMQ: metadata",
        "ipc": "0 B: the server maps the trainer's buffer (shared memory here, CUDA IPC on GPUs); ZMQ: handles",
    }
    b8 = QWEN3_8B_PARAMS * BF16
    stated_8b = {
        "model_bytes_bf16": b8,
        "in_memory": {"driver_bytes": b8, "zmq_bytes_per_server": b8, "zmq_bytes_total_16_servers": 16 * b8},
        "distributed": {"driver_bytes": 0, "group_bytes_per_server": b8, "zmq_bytes": "metadata only (KiB)"},
        "ipc": {"driver_bytes": 0, "bytes_per_server": 0, "zmq_bytes": "IPC handles only (KiB)"},
    }
    out = {"servers": n, "repeats": args.repeats, "bucket_bytes": bucket, "model_bytes": model_bytes,
           "results": results, "per_server": per_server, "qwen3_8b": stated_8b,
           "note": "CPU, 2 cores shared with other work: times are relative between transports"}
    print(json.dumps({"model_bytes": model_bytes, "per_server": per_server}, indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
