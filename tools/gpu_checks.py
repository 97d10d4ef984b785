"""tools/gpu_smoke.py's part G: what only a GPU can show about the colocated layout and the throughput paths,
each check under a minute on one H200. What the CPU tests already cover is not repeated here.

- colocated_handoff_85pct: a holder process takes 85 % of the GPU (as a server with `mem_fraction_static` 0.85
  does), releases it; a trainer process is built, steps, offloads; the holder takes its 85 % again. The trainer
  process's residual (its whole footprint as the holder sees it in `cudaMemGetInfo`: CUDA context, NCCL, the
  allocator's reserve) is held to the planner's per-process overhead (`rollverify.app.plan.PROCESS_OVERHEAD`).
- activation_bytes_{8b,30b_a3b}: bytes autograd keeps per token for one transformer layer at the Qwen3-8B and
  Qwen3-30B-A3B layer shapes (all 128 experts), bf16, with the paths the trainer selects on this GPU (TE spec,
  flash attention), against `rollverify.app.plan.layer_activation_bytes` (within 10 %).
- cuda_ipc_two_consumers: one bucket on the GPU serialized once per consumer (SGLang's one payload per TP rank),
  rebuilt by two consumer processes (checksums equal the producer's); after both drop it the producer's
  allocated and reserved memory are back where they were.
- attention_kernel: which packed-attention kernel a bf16 forward ran (`megatron_bridge.attention.KERNELS_RUN`),
  against the one the throughput paths chose (flash-attn 2 / flash-attn 4 / SDPA) and why.

The planner's figures come from `rollverify.app.plan` when it imports (it needs pydantic); on a machine with
only torch, transformers and megatron-core, write them beforehand where the project is installed
(`python tools/gpu_smoke.py --write-plan-figures plan_figures.json`, no GPU needed) and pass
`--plan-figures plan_figures.json`. Without either, the two comparisons are skipped (the measured figures are
still reported).
"""

from __future__ import annotations

import ast
import json
import math
import multiprocessing as mp
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("qwen3-8b", "qwen3-30b-a3b")


# ------------------------------------------------------------------------------------------ the planner's figures


def plan_figures() -> dict:
    """The planner's per-process overhead and per-layer activation bytes (tp 1, no recompute) at both shapes."""
    from megatron_bridge.model import ModelArch
    from rollverify.app import plan
    from rollverify.app.presets import ARCH_PRESETS

    lay = plan.TrainerLayout(tp=1, pp=1, dp=1)
    return {"process_overhead": int(plan.PROCESS_OVERHEAD),
            "layer_activation_bytes": {s: int(plan.layer_activation_bytes(ModelArch.from_hf_config(ARCH_PRESETS[s]),
                                                                          lay)) for s in SHAPES}}


def load_plan_figures(path: str | None) -> dict | None:
    """`plan_figures()` where the planner imports, else the JSON at `path` (None: neither)."""
    try:
        return plan_figures()
    except ImportError:
        pass
    if path is None:
        return None
    got = json.loads(Path(path).read_text())
    if not isinstance(got.get("process_overhead"), int) or set(got.get("layer_activation_bytes", {})) != set(SHAPES):
        raise ValueError(f"{path}: not a plan-figures file (write one with --write-plan-figures)")
    return got


def arch_of(name: str):
    """A preset architecture, read from rollverify/app/presets.py without importing the application package."""
    from megatron_bridge.model import ModelArch

    tree = ast.parse((ROOT / "rollverify" / "app" / "presets.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "ARCH_PRESETS")
    return ModelArch.from_hf_config(ast.literal_eval(node.value)[name])


# ------------------------------------------------------------------------------------------ colocated handoff


def _holder(conn, fraction: float) -> None:
    """A stand-in for a colocated server: takes `fraction` of the GPU on "take", frees it on "release", reports
    the device's free bytes on "free"."""
    import torch

    torch.zeros(1, device="cuda")
    total = torch.cuda.mem_get_info()[1]
    buf = None
    while True:
        cmd = conn.recv()
        try:
            if cmd == "take":
                buf = torch.empty(int(fraction * total), dtype=torch.uint8, device="cuda")
                conn.send(("ok", buf.numel()))
            elif cmd == "release":
                buf = None
                torch.cuda.empty_cache()
                conn.send(("ok", 0))
            elif cmd == "free":
                conn.send(("ok", torch.cuda.mem_get_info()[0]))
            else:
                conn.send(("ok", 0))
                return
        except Exception as e:  # noqa: BLE001 - an out-of-memory is this check's answer
            conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0]}"))


def _trainer_side(conn, path: str) -> None:
    """The trainer process: CUDA context, then on "build" a trainer that steps once and offloads everything."""
    import torch

    torch.zeros(1, device="cuda")
    conn.send(("ok", 0))
    conn.recv()
    try:
        import numpy as np

        from megatron_bridge.batch import TrainSequence
        from megatron_bridge.config import TrainerConfig
        from megatron_bridge.trainer import MegatronTrainer

        trainer = MegatronTrainer(path, TrainerConfig(device="cuda", lr=1e-5, micro_batch_tokens=4096), dtype="bfloat16")
        rng = np.random.default_rng(0)
        seqs = [TrainSequence(rng.integers(4, 1000, 256), rng.integers(4, 1000, 768), advantage=(-1.0) ** i,
                              rollout_logprobs=np.full(768, -2.0, np.float32)) for i in range(4)]
        trainer.train_step(seqs)
        released = trainer.offload()
        torch.cuda.empty_cache()
        conn.send(("ok", {"released": int(sum(released.values())), "allocated": torch.cuda.memory_allocated(),
                          "reserved": torch.cuda.memory_reserved()}))
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}"))
    conn.recv()


def _ask(conn, cmd: str, timeout_s: float = 120.0):
    conn.send(cmd)
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer to {cmd!r} within {timeout_s:.0f} s")
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(f"{cmd}: {value}")
    return value


def check_colocated_handoff(model_path: str, figures: dict | None, fraction: float = 0.85):
    """colocated_handoff_85pct (module docstring); returns (passed, figure, value, detail)."""
    import torch

    torch.cuda.empty_cache()  # this process's cache stays as it is through the check
    ctx = mp.get_context("spawn")
    h_conn, h_child = ctx.Pipe()
    t_conn, t_child = ctx.Pipe()
    holder = ctx.Process(target=_holder, args=(h_child, fraction), daemon=True)
    trainer = ctx.Process(target=_trainer_side, args=(t_child, model_path), daemon=True)
    holder.start()
    try:
        held = _ask(h_conn, "take")
        _ask(h_conn, "release")
        free_before = _ask(h_conn, "free")
        trainer.start()
        if not t_conn.poll(120):
            raise TimeoutError("the trainer process did not start within 120 s")
        t_conn.recv()
        free_ctx = _ask(h_conn, "free")
        t_conn.send("build")
        if not t_conn.poll(300):
            raise TimeoutError("the trainer was not built, stepped and offloaded within 300 s")
        status, stats = t_conn.recv()
        if status != "ok":
            raise RuntimeError(stats)
        residual = free_before - _ask(h_conn, "free")
        retake = _ask(h_conn, "take")
    finally:
        for conn, proc in ((t_conn, trainer), (h_conn, holder)):
            if proc.pid is None:  # never started
                continue
            try:
                conn.send("stop")
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    limit = figures["process_overhead"] if figures else None
    ok = retake == held and (limit is None or residual <= limit)
    gib = 2 ** 30
    figure = (f"holder took {held / gib:.1f} GiB ({fraction:.0%}), released; trainer built, stepped, offloaded "
              f"{stats['released'] / gib:.2f} GiB; holder took {retake / gib:.1f} GiB again; trainer process "
              f"residual {residual / gib:.2f} GiB (context {(free_before - free_ctx) / gib:.2f}, allocator reserve "
              f"{stats['reserved'] / gib:.2f})" + (f" <= plan's {limit / gib:.2f} GiB per process" if limit else
                                                    "; plan's overhead figure not available"))
    return ok if limit else None, figure, residual, {**stats, "residual": residual, "held": held,
                                                     "context": free_before - free_ctx}


# ------------------------------------------------------------------------------------------ activation bytes


def layer_saved_bytes(arch, device: str, tokens: int, paths) -> float:
    """Bytes autograd keeps per token for one layer of `arch` (a 2-layer minus a 1-layer model's distinct
    saved storages, parameters excluded), bf16, built with `paths`."""
    from dataclasses import replace

    import torch

    from megatron_bridge.model import PackedSequences, build_model, packed_forward, transformer_config

    def saved(layers: int) -> int:
        a = replace(arch, num_layers=layers, vocab_size=128)
        cfg = transformer_config(a, dtype=torch.bfloat16, routing_replay=False, init_weights=True, paths=paths)
        torch.manual_seed(0)
        model = build_model(a, cfg).to(device).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
            return t

        batch = PackedSequences.pack([torch.randint(0, 128, (tokens,))])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = packed_forward(model, batch, device)
        del out, model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        return sum(seen.values())

    return (saved(2) - saved(1)) / tokens


def check_activation_bytes(shape: str, device: str, figures: dict | None, tokens: int = 2048):
    from megatron_bridge.parallel import ParallelConfig, init_parallel
    from megatron_bridge.throughput import probe, select_paths

    arch = arch_of(shape)
    init_parallel(ParallelConfig(), device="cuda" if device.startswith("cuda") else "cpu")
    paths = select_paths(probe("cuda" if device.startswith("cuda") else "cpu"), moe=arch.moe,
                         distributed_optimizer=True)
    got = layer_saved_bytes(arch, device, tokens, paths)
    want = figures["layer_activation_bytes"][shape] if figures else None
    ratio = got / want if want else math.nan
    figure = (f"{shape} layer ({paths.layer_spec} spec, {paths.attention}): {got:.0f} B/token kept for the backward"
              + (f"; plan {want} B/token, ratio {ratio:.3f} (within 10 %)" if want else
                 "; plan's figure not available"))
    return (abs(ratio - 1) <= 0.10) if want else None, figure, got, {"measured": got, "plan": want,
                                                                      "paths": paths.line()}


# ------------------------------------------------------------------------------------------ CUDA IPC


def _consumer(conn, payload: bytes) -> None:
    import pickle

    import torch
    import torch.multiprocessing  # noqa: F401 - registers the tensor rebuild functions

    t = pickle.loads(payload)
    conn.send(float(t.double().sum()))
    conn.recv()  # drop it when told
    del t
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
    conn.send("dropped")
    conn.recv()


def check_cuda_ipc(device: str, nbytes: int = 64 << 20):
    """cuda_ipc_two_consumers (module docstring); on CPU the same plumbing over shared memory (no memory check)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing as tmp

    cuda = device.startswith("cuda")
    if not cuda:
        tmp.set_sharing_strategy("file_system")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    flat = torch.randn(nbytes // 4, device=device)
    want = float(flat.double().sum())
    payloads = []
    for _ in range(2):  # one payload per consumer, as SGLang's TP ranks each get their own
        buf = io.BytesIO()
        ForkingPickler(buf).dump(flat)
        payloads.append(buf.getvalue())
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    try:
        for p in payloads:
            a, b = ctx.Pipe()
            proc = ctx.Process(target=_consumer, args=(b, p), daemon=True)
            proc.start()
            conns.append(a)
            procs.append(proc)
        sums = []
        for c in conns:
            if not c.poll(120):
                raise TimeoutError("a consumer did not rebuild the payload within 120 s")
            sums.append(c.recv())
        for c in conns:
            c.send("drop")
            if not c.poll(60):
                raise TimeoutError("a consumer did not drop the payload within 60 s")
            c.recv()
        del flat
        if cuda:
            torch.cuda.ipc_collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            back_alloc, back_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    finally:
        for c, proc in zip(conns, procs, strict=True):
            try:
                c.send("stop")
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    same = all(abs(s - want) <= 1e-6 * max(1.0, abs(want)) for s in sums)
    if not cuda:
        return same, f"2 consumers rebuilt a {nbytes >> 20} MiB shared-memory bucket, checksums equal: {same}", None, {}
    back = back_alloc == base_alloc and back_res <= base_res + (2 << 20)
    return same and back, (f"2 consumers rebuilt a {nbytes >> 20} MiB CUDA bucket from their own payloads, "
                           f"checksums equal: {same}; producer allocated {base_alloc} -> {back_alloc} B, reserved "
                           f"{base_res} -> {back_res} B after both dropped it"), None, {
        "allocated": [base_alloc, back_alloc], "reserved": [base_res, back_res]}


# ------------------------------------------------------------------------------------------ attention kernel


def check_attention_kernel(model_path: str, device: str):
    """attention_kernel (module docstring): a bf16 forward of the trainer on `model_path`."""
    import numpy as np

    from megatron_bridge import attention
    from megatron_bridge.batch import TrainSequence
    from megatron_bridge.config import TrainerConfig
    from megatron_bridge.trainer import MegatronTrainer

    cuda = device.startswith("cuda")
    trainer = MegatronTrainer(model_path, TrainerConfig(device="cuda" if cuda else "cpu"),
                              dtype="bfloat16" if cuda else "float32")
    try:
        attention.KERNELS_RUN.clear()
        rng = np.random.default_rng(0)
        seqs = [TrainSequence(rng.integers(4, 100, 16), rng.integers(4, 100, 48)) for _ in range(3)]
        trainer.compute_logprobs(seqs)
        ran, paths = sorted(attention.KERNELS_RUN), trainer.paths
    finally:
        trainer.close()
    return ran == [paths.attention], f"ran {ran}; chosen: {paths.line()}", None, {"ran": ran, "paths": paths.line()}


def run_all(smoke, env, check_cls, model_path_fn) -> None:
    """Part G's checks through gpu_smoke's `Smoke` runner (`check_cls`: its Check)."""
    figures = load_plan_figures(env.plan_figures)

    def wrap(fn):
        def run():
            passed, figure, value, detail = fn()
            return check_cls("", passed, figure, value, detail=detail)

        return run

    if env.cuda:
        smoke.run("colocated_handoff_85pct", wrap(lambda: check_colocated_handoff(model_path_fn("0p6b"), figures)))
        for shape in SHAPES:
            smoke.run(f"activation_bytes_{shape.removeprefix('qwen3-').replace('-', '_')}",
                      wrap(lambda s=shape: check_activation_bytes(s, env.device, figures)))
    smoke.run("cuda_ipc_two_consumers", wrap(lambda: check_cuda_ipc(env.device, (64 << 20) if env.cuda else 1 << 20)))
    smoke.run("attention_kernel", wrap(lambda: check_attention_kernel(model_path_fn("0p6b"), env.device)))


def write_plan_figures(path: str) -> None:
    Path(path).write_text(json.dumps(plan_figures(), indent=1) + "\n")
    print(f"written: {path}")

