"""GPU smoke test of the trainer (part A) and of the SGLang rollout side (part B): one PASS/FAIL line per check.

    python tools/gpu_smoke.py --bundle build/gpu-smoke  # parts A, H and G on cuda:0, one command, within 8 minutes
    python tools/gpu_smoke.py --part B                  # part B: needs SGLang's GPU install
    python tools/gpu_smoke.py --bundle build/gpu-smoke --dry-run   # here, on CPU: every import it will need
    python tools/gpu_smoke.py --device cpu --quick      # the parts' logic on CPU with small shapes

On a bare GPU machine (Python 3.12, torch, transformers; no megatron-core, no SGLang, no network), `make
gpu-smoke-bundle` here first writes the folder it needs (tools/gpu_smoke_bundle.py: megatron-core's source, the
planner's figures, the tiny models; at most 60 MiB, carried with the checkout): `--bundle` puts its megatron-core
first on the import path and copies its models into the work folder, and nothing is installed. The run keeps its
own budget (`--budget-s`, 480 s): before each check it compares the time left with what the check may take
(`ESTIMATES`) and skips it when that does not fit, so one call ends inside the 8 minutes. The JSON (`--json`) is
rewritten after every check, so a run cut short still leaves what it measured. `--dry-run` checks, on this
machine, the bundle and every import the checks make, in processes that can import only what the GPU machine
has (torch, transformers and their dependencies, megatron from the bundle): the parts run on CPU with small
shapes, and the imports of what runs only on CUDA are resolved from the tools' source.

Part A needs only torch, transformers and megatron-core (any Python >= 3.11, torch >= 2.11, transformers 5.x;
nothing is pinned and nothing else is imported: the project modules it uses, `megatron_bridge` and
`rollverify.{tiny_model,verify,losses,config,strategies,types}`, import only those, numpy and PyYAML, which
transformers requires). Its checks:

- parity_{dense,moe,0p6b}_fp32, parity_0p6b_bf16: the tiny dense and MoE models and a random Qwen3 shaped like
  Qwen3-0.6B, trainer log-probs of every token against transformers on the same device (fp32: max |diff| <= 1e-4;
  bf16: mean |diff| <= 2e-3).
- train_step_bf16: one GRPO step of the 0.6B-shaped model in bf16: finite, positive grad norm; the distributed
  optimizer's main params are fp32 on the device and each bf16 weight is its main param rounded; the gradient
  Adam took is the clipped one (its first moment has norm (1 - beta1) * min(grad norm, grad_clip)).
- trainer_offload_reload: after the bf16 step, `MegatronTrainer.offload()` (parameters, gradients, optimizer
  state: megatron_bridge.offload) lowers `torch.cuda.memory_allocated` by >= 90 % of the bytes it reports
  released, `reload()` returns it to within 1 MiB, and weights (bitwise) and optimizer state come back unchanged.
- checkpoint_roundtrip: a stepped tiny model saved (Megatron-Core's distributed checkpoint, torch_dist) and
  loaded into a fresh trainer gives identical log-probs, and the HF export of the weights as loaded equals the
  model's safetensors bit for bit (the conversion both ways); it names the layer spec that ran (Transformer
  Engine's where TE imports on CUDA, whose parameter names and `_extra_state` then make both round trips).
- routing_replay_bitwise: the tiny MoE's free routes, recorded on the device and replayed, give bitwise the
  same log-probs.
- memory_vs_length: peak memory of a bf16 train step at 2K..32K tokens per sequence; linear when the 32K/2K
  ratio is <= 1.25 x the length ratio.
- verify_device_equals_cpu: `two_stage_verify` on the device returns the CPU's keep lengths and OPS.
- computeprob_throughput, train_step_mfu: tokens/s of ComputeProb and the model FLOP utilisation of a bf16
  train step of the 0.6B-shaped model (6 N per trained token + 2 N per recomputed old-log-prob token; the
  attention's S^2 term is left out, so the MFU is a lower bound).

Part G (tools/gpu_checks.py): a process holding 85 % of the GPU while the trainer is built (release, build,
offload, take again; the trainer process's residual against the planner's per-process overhead), per-layer
activation bytes at the Qwen3-8B and Qwen3-30B-A3B layer shapes against the planner's, one CUDA-IPC payload per
consumer rebuilt by two processes and the producer's memory back after they drop it, and which attention kernel
ran. On CPU only the IPC plumbing (shared memory) and the kernel choice run.

Part H (tools/gpu_host_checks.py): the host memory of a distributed-optimizer save against the host ledger, two
NCCL ranks on one GPU (where NCCL allows it), a Transformer Engine layer (where TE is installed) and the attention
kernels' own check.

Part B (SGLang on CUDA): `rollverify serve` on the tiny model; pause / truncate / resume of live responses; a
weight update through the colocated transport; the engine-versus-trainer log-prob floor in bf16 against `d_s`;
the GPU weight transports from a trainer on the same GPU (transport_ipc: CUDA IPC handles of flattened buckets;
transport_distributed: SGLang's weight-update group over NCCL), each followed by log-probs equal to the trainer's;
memory_release_resume: a server with SGLang's memory saver frees and retakes GPU memory (needs torch_memory_saver).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# part A must run where only torch, transformers and megatron-core are installed: none of the project's other
# dependencies may load, and of the project only these modules (which import nothing else)
HEAVY_PACKAGES = ("sglang", "sglang_ext", "sgl_kernel", "flashinfer", "vllm", "ray", "zmq", "wandb", "pydantic",
                  "pandas", "pyarrow", "datasets", "orjson", "uvloop", "fastapi")
PROJECT_MODULES = ("megatron_bridge", "rollverify", "rollverify.app", "rollverify.app.tiny_model", "rollverify.verify",
                   "rollverify.losses", "rollverify.sections", "rollverify.strategies", "rollverify.types",
                   "rollverify.devices", "rollverify.gpu_ledger", "rollverify.app.host_memory")
BUNDLED_MODELS = ("dense", "moe")  # in the bundle; the 0.6B-shaped model is made on the device (1.2 GB)
BUDGET_S = 480.0  # one call on the GPU machine is 600 s; its start and the transfers take the rest
# the most each check may take on one H100/H200 (a check is skipped when the budget has less left); 30 s otherwise
ESTIMATES = {"parity_0p6b_fp32": 120, "parity_0p6b_bf16": 60, "checkpoint_roundtrip": 60, "train_step_bf16": 60,
             "memory_vs_length": 90, "computeprob_throughput": 60, "train_step_mfu": 60,
             "colocated_handoff_85pct": 150, "activation_bytes_8b": 60, "activation_bytes_30b_a3b": 60,
             "cuda_ipc_two_consumers": 60, "attention_kernel": 60, "imports_part_a": 1}

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362e12, "B200": 2250e12, "GH200": 989e12}


@dataclass
class Check:
    name: str
    passed: bool | None  # None: skipped
    figure: str
    value: float | None = None
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)

    def line(self) -> str:
        status = "SKIP" if self.passed is None else ("PASS" if self.passed else "FAIL")
        return f"{status} {self.name}: {self.figure} ({self.seconds:.1f} s)"


class Smoke:
    """Runs checks in order within a time budget; a check that raises is a FAIL with the error as its figure. Before
    a check starts, the time left is held against what it may take (`estimate_s`, else `ESTIMATES`): a check that
    would not fit is skipped. After every check the JSON report (`json_path`) is written again."""

    def __init__(self, budget_s: float, only: set[str] | None = None, json_path: str | None = None,
                 info: dict | None = None) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.only = only  # None: every check
        self.checks: list[Check] = []
        self.json_path, self.info = json_path, dict(info or {})

    def wants(self, *names: str) -> bool:
        return self.only is None or any(n in self.only for n in names)

    def run(self, name: str, fn: Callable[[], Check], estimate_s: float | None = None) -> Check | None:
        if not self.wants(name):
            return None
        t = time.monotonic()
        need = ESTIMATES.get(name, 30) if estimate_s is None else estimate_s
        if t + need > self.deadline:
            c = Check(name, None, f"time budget: {max(0.0, self.deadline - t):.0f} s left, the check may take {need} s")
        else:
            watchdog = threading.Timer(max(2 * need, self.deadline - t), self._stuck, (name, t))
            watchdog.daemon = True
            watchdog.start()
            try:
                c = fn()
            except Exception as e:  # noqa: BLE001 - every failure is reported as this check's result
                c = Check(name, False, f"{type(e).__name__}: {e}", detail={"traceback": traceback.format_exc()})
            finally:
                watchdog.cancel()
            c.name = name
        c.seconds = time.monotonic() - t
        self.checks.append(c)
        print(c.line(), flush=True)
        self.write(complete=False)
        return c

    def _stuck(self, name: str, started: float) -> None:
        """A check still running past twice its estimate, or past the budget: its FAIL (with every thread's
        stack) goes into the report, and the process ends, so that the call ends inside its time."""
        stacks = "".join(f"thread {tid}:\n" + "".join(traceback.format_stack(frame))
                         for tid, frame in sys._current_frames().items())
        c = Check(name, False, f"did not finish within {time.monotonic() - started:.0f} s: stopped",
                  seconds=time.monotonic() - started, detail={"stacks": stacks[-20000:]})
        self.checks.append(c)
        print(c.line(), flush=True)
        self.write(complete=False)
        os._exit(3)

    def write(self, complete: bool) -> None:
        """The report so far (`complete`: every part ran or was skipped) at `json_path`."""
        if self.json_path is None:
            return
        info = {**self.info, "seconds": time.monotonic() - self.t0, "complete": complete}
        Path(self.json_path).write_text(json.dumps({"info": info, "checks": [asdict(c) for c in self.checks]},
                                                   indent=1, default=str) + "\n")


# ---------------------------------------------------------------------------------------------- shared helpers


@dataclass
class Env:
    device: str
    quick: bool
    workdir: Path
    plan_figures: str | None = None  # part G: the planner's figures where it does not import (gpu_checks)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()


def model_specs(quick: bool) -> dict:
    """TinyModelSpec keyword sets: the tiny dense and MoE models and the 0.6B-shaped random Qwen3 (its depth and
    vocabulary cut down with --quick)."""
    qwen3_0p6b = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                      num_kv_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True)
    if quick:
        qwen3_0p6b.update(vocab_size=1024, num_layers=2, hidden_size=256, intermediate_size=512, head_dim=64,
                          num_heads=4, num_kv_heads=2)
    return {"dense": dict(max_position_embeddings=40960), "moe": dict(moe=True), "0p6b": qwen3_0p6b}


def model_path(name: str, env: Env) -> str:
    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

    return str(ensure_tiny_model(TinyModelSpec(**model_specs(env.quick)[name])))


def random_sequences(n: int, vocab: int, prompt: int, gens: list[int], seed: int = 0):
    import numpy as np

    from megatron_bridge.batch import TrainSequence

    rng = np.random.default_rng(seed)
    return [TrainSequence(rng.integers(4, vocab, prompt), rng.integers(4, vocab, gens[i % len(gens)]),
                          advantage=1.0 if i % 2 else -1.0) for i in range(n)]


def make_trainer(path: str, env: Env, dtype: str, **kw):
    from megatron_bridge.config import TrainerConfig
    from megatron_bridge.trainer import MegatronTrainer

    kw.setdefault("micro_batch_tokens", 8192)
    kw.setdefault("lr", 1e-5)
    return MegatronTrainer(path, TrainerConfig(device="cuda" if env.cuda else "cpu", **kw), dtype=dtype)


def hf_logprobs(path: str, seqs, env: Env, dtype, routes: bool = False) -> list:
    """transformers' log-prob of each generated token, each sequence alone, on the device; with `routes` (MoE)
    its router top-k of every input position is stored on the sequence, for the trainer to replay (as it
    replays the engine's)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(env.device).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.gen_ids])[:-1]).view(1, -1).to(env.device)
            res = hf(ids, output_router_logits=routes)
            logp = torch.log_softmax(res.logits[0].float(), dim=-1)
            rows = torch.arange(s.prompt_ids.size - 1, s.prompt_ids.size - 1 + s.gen_ids.size, device=env.device)
            out.append(logp[rows, torch.from_numpy(s.gen_ids).to(env.device)].cpu().numpy())
            if routes:
                k = hf.config.num_experts_per_tok
                s.routed_experts = np.stack([r.view(ids.shape[1], -1).topk(k, dim=-1).indices.cpu().numpy()
                                             for r in res.router_logits], axis=1).astype(np.int32)
    del hf
    if env.cuda:
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------- part A checks


def check_parity(name: str, dtype: str, env: Env) -> Check:
    import numpy as np
    import torch

    from megatron_bridge.model import ModelArch

    path = model_path(name, env)
    arch = ModelArch.from_hf_dir(path)
    gens = [40, 300, 7, 900] if not env.quick else [20, 45, 7]
    seqs = random_sequences(4, arch.vocab_size, 17, gens, seed=1)
    # MoE: transformers' routes replayed (as the trainer replays the engine's): in bf16 the two frameworks' router
    # precisions (Megatron fp32, transformers bf16) otherwise pick different experts on near ties
    ref = np.concatenate(hf_logprobs(path, seqs, env, torch.float32 if dtype == "float32" else torch.bfloat16,
                                     routes=arch.moe))
    trainer = make_trainer(path, env, dtype)
    try:
        lp, _ = trainer.compute_logprobs(seqs, replay=arch.moe)
    finally:
        trainer.close()
    d = np.abs(lp.astype(np.float64) - ref)
    if dtype == "float32":
        return Check("", bool(d.max() <= 1e-4), f"max |lp - transformers| = {d.max():.2e} (<= 1e-4)", float(d.max()),
                     detail={"mean": float(d.mean()), "tokens": int(d.size)})
    # how far each bf16 result is from float32 (transformers): says which framework's rounding a gap comes from
    exact = np.concatenate(hf_logprobs(path, seqs, env, torch.float32, routes=arch.moe)).astype(np.float64)
    err_trainer, err_hf = float(np.abs(lp - exact).mean()), float(np.abs(ref - exact).mean())
    return Check("", bool(d.mean() <= 2e-3), f"mean |lp - transformers| = {d.mean():.2e} (<= 2e-3), "
                 f"max {d.max():.2e}; from fp32: trainer {err_trainer:.1e}, transformers {err_hf:.1e}",
                 float(d.mean()), detail={"max": float(d.max()), "tokens": int(d.size),
                                          "trainer_vs_fp32": err_trainer, "transformers_vs_fp32": err_hf})


def check_checkpoint(env: Env) -> Check:
    import numpy as np

    path = model_path("dense", env)
    seqs = random_sequences(4, 128, 9, [30, 12, 50, 5], seed=2)
    first = make_trainer(path, env, "float32", lr=1e-3)
    spec = first.paths.layer_spec  # transformer_engine where TE imports on CUDA: its modules' _extra_state too
    try:
        converted = export_errors(first, path)  # HF -> this spec -> HF, before any step: bit for bit
        lp0, _ = first.compute_logprobs(seqs)
        for s, a in zip(seqs, np.split(lp0, np.cumsum([s.gen_ids.size for s in seqs])[:-1]), strict=True):
            s.rollout_logprobs = a
        first.train_step(seqs)
        want, _ = first.compute_logprobs(seqs)
        ckpt = first.save_checkpoint(Path(tempfile.mkdtemp(dir=env.workdir)) / "ckpt")
    finally:
        first.close()
    second = make_trainer(path, env, "float32", lr=1e-3)
    try:
        second.load_checkpoint(ckpt)
        got, _ = second.compute_logprobs(seqs)
    finally:
        second.close()
    d = float(np.abs(got - want).max())
    moved = float(np.abs(want - lp0).max())
    return Check("", d == 0.0 and moved > 0 and not converted,
                 f"max |lp loaded - lp saved| = {d:.1e} (== 0; the step moved lp by {moved:.1e}); export of the "
                 f"loaded weights {'bit-exact' if not converted else 'differs: ' + ', '.join(converted[:5])}; "
                 f"layer spec {spec}", d, detail={"layer_spec": spec, "export_differs": converted})


def export_errors(trainer, path: str) -> list[str]:
    """The trainer's HF export of the weights it loaded from `path`, against `path`'s safetensors: the names that
    differ in value or dtype, are missing or are extra (empty: the conversion round-trips bit for bit)."""
    import torch
    from safetensors.torch import load_file

    ref: dict = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        ref.update(load_file(f))
    got = trainer.export_hf_state()
    bad = [f"missing {n}" for n in ref if n not in got] + [f"extra {n}" for n in got if n not in ref]
    return bad + [n for n, t in got.items() if n in ref and (t.dtype != ref[n].dtype
                                                              or not torch.equal(t.cpu(), ref[n]))]


def check_replay(env: Env) -> Check:
    import numpy as np

    from megatron_bridge import replay
    from megatron_bridge.model import ModelArch

    path = model_path("moe", env)
    arch = ModelArch.from_hf_dir(path)
    seq = random_sequences(1, arch.vocab_size, 11, [60], seed=3)[0]
    trainer = make_trainer(path, env, "float32")
    try:
        with replay.recording() as routes:
            free, _ = trainer.compute_logprobs([seq], replay=False)
        seq.routed_experts = np.stack([r.cpu().numpy() for r in routes], axis=1).astype(np.int32)
        replayed, _ = trainer.compute_logprobs([seq], replay=True)
    finally:
        trainer.close()
    same = bool(np.array_equal(free, replayed))
    return Check("", same, f"replayed == free routing bitwise: {same} (max diff "
                 f"{float(np.abs(free - replayed).max()):.1e}, {seq.routed_experts.shape[0]} tokens x "
                 f"{arch.num_layers} layers)")


def _peak_bytes(fn, env: Env) -> int:
    """Peak memory above the level just before `fn()`: the CUDA allocator's peak on a GPU, resident memory on
    CPU (Linux high-water mark, reset through /proc/self/clear_refs)."""
    import ctypes
    import gc

    import torch

    gc.collect()
    if env.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

    def kib(field_name):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field_name + ":"))

    before = kib("VmRSS")
    fn()
    return (kib("VmHWM") - before) * 1024


def check_memory(env: Env, trainer, arch) -> Check:
    import numpy as np

    lengths = [2048, 4096, 8192, 16384, 32768] if not env.quick else [256, 512, 1024]
    peaks = {}
    for n in lengths:
        seq = random_sequences(1, arch.vocab_size, n // 4, [n - n // 4 + 1], seed=n)[0]
        seq.rollout_logprobs = np.zeros(seq.gen_ids.size, np.float32)
        trainer.cfg.micro_batch_tokens = max(trainer.cfg.micro_batch_tokens, n)
        peaks[n] = _peak_bytes(lambda s=seq: trainer.train_step([s]), env)
    ratio = peaks[lengths[-1]] / max(peaks[lengths[0]], 1)
    bound = 1.25 * lengths[-1] / lengths[0]
    table = ", ".join(f"{n // 1024 if n >= 1024 else n}{'K' if n >= 1024 else ''}: {peaks[n] / 2**30:.2f} GiB"
                      for n in lengths)
    return Check("", ratio <= bound, f"train-step peak {table}; {lengths[-1]}/{lengths[0]} = {ratio:.1f}x "
                 f"(<= {bound:.0f}x)", ratio, detail={"peak_bytes": {str(k): v for k, v in peaks.items()}})


def check_verify(env: Env) -> Check:
    import torch

    from rollverify.verify import two_stage_verify

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 400, (64,), generator=g)
    n = int(lengths.sum())
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    drift = torch.repeat_interleave(torch.rand(len(lengths), generator=g, dtype=torch.float64) * 0.05, lengths)
    new = old + torch.randn(n, generator=g, dtype=torch.float64) * drift  # some responses kept, some cut
    versions = torch.cat([torch.sort(torch.randint(0, 4, (int(k),), generator=g)).values for k in lengths])
    cpu = two_stage_verify(old, new, versions, lengths, d_s=0.02, d_t=2.0)
    dev = two_stage_verify(*(t.to(env.device) for t in (old, new, versions, lengths)), d_s=0.02, d_t=2.0)
    same_keep = torch.equal(cpu.keep_lengths, dev.keep_lengths.cpu()) and \
        torch.equal(cpu.seq_keep_lengths, dev.seq_keep_lengths.cpu())
    ops = (cpu.segment_mean_ops - dev.segment_mean_ops.cpu()).abs().nan_to_num(0).max().item()
    return Check("", bool(same_keep and ops <= 1e-9), f"keep lengths equal: {same_keep}; max |segment OPS "
                 f"diff| = {ops:.1e} (<= 1e-9); kept {cpu.kept_tokens}/{n} tokens on {env.device}", ops)


def check_throughput(env: Env, trainer, arch, smoke: Smoke) -> None:
    """ComputeProb tokens/s and the train step's MFU on the same batch."""
    import numpy as np
    import torch

    n_seq, gen = (16, 1536) if not env.quick else (4, 100)
    seqs = random_sequences(n_seq, arch.vocab_size, 512 if not env.quick else 20, [gen], seed=5)
    tokens = sum(s.num_inputs for s in seqs)
    params = sum(p.numel() for p in trainer.model.parameters())
    trainer.compute_logprobs(seqs[:2])  # warm-up
    state = {}

    def computeprob() -> Check:
        env.sync()
        t = time.perf_counter()
        lp, _ = trainer.compute_logprobs(seqs)
        env.sync()
        dt = time.perf_counter() - t
        for s, a in zip(seqs, np.split(lp, np.cumsum([s.gen_ids.size for s in seqs])[:-1]), strict=True):
            s.rollout_logprobs = a
        state["lp"] = lp
        return Check("", bool(np.isfinite(lp).all()), f"{tokens / dt:,.0f} tokens/s ({tokens} tokens, "
                     f"{params / 1e6:.0f}M params, {dt:.2f} s)", tokens / dt)

    def mfu() -> Check:
        trainer.train_step(seqs)  # warm-up (optimizer state)
        env.sync()
        t = time.perf_counter()
        m = trainer.train_step(seqs)
        env.sync()
        dt = time.perf_counter() - t
        flops = 8.0 * params * tokens / dt
        name = torch.cuda.get_device_name() if env.cuda else platform.processor() or "cpu"
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        figure = f"{flops / 1e12:.1f} TFLOP/s model FLOPs ({dt:.2f} s/step, {tokens} tokens)"
        if peak:
            figure += f", MFU {flops / peak:.1%} of {name}'s {peak / 1e12:.0f} TFLOP/s bf16"
        ok = math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        return Check("", ok, figure, flops / peak if peak else None, detail={"grad_norm": m["grad_norm"],
                                                                           "device_name": name})

    smoke.run("computeprob_throughput", computeprob)
    smoke.run("train_step_mfu", mfu)


def check_train_step(env: Env, trainer, arch) -> Check:
    import numpy as np

    seqs = random_sequences(4, arch.vocab_size, 33, [200, 50, 400, 90], seed=4)
    lp, _ = trainer.compute_logprobs(seqs)
    for s, a in zip(seqs, np.split(lp, np.cumsum([s.gen_ids.size for s in seqs])[:-1]), strict=True):
        s.rollout_logprobs = a
    m = trainer.train_step(seqs)
    g = m["grad_norm"]
    main = main_param_figures(trainer)
    want = (1 - trainer.cfg.adam_beta1) * min(g, trainer.cfg.grad_clip)
    clip_err = abs(main["exp_avg_norm"] - want) / want if want > 0 else math.inf
    ok = (math.isfinite(g) and g > 0 and m["update_ok"] == 1.0 and main["main_fp32"] and main["weights_are_main"]
          and clip_err < 1e-3)
    return Check("", ok, f"grad norm {g:.4g} (finite, > 0), loss {m['loss']:.4g}, dtype {trainer.dtype}; main "
                 f"params fp32 on {main['main_device']}: {main['main_fp32']}, bf16 weights = rounded main params: "
                 f"{main['weights_are_main']}; Adam's first moment {main['exp_avg_norm']:.4g} vs "
                 f"(1 - beta1) * min(grad norm, clip {trainer.cfg.grad_clip}) = {want:.4g}", g,
                 detail={**main, "clip_rel_err": clip_err})


def check_offload(env: Env, trainer) -> Check:
    """The trainer's side of the colocated handoff (megatron_bridge.offload) on the device: after a step,
    offloading parameters, gradients and optimizer state lowers the allocated memory by at least 90 % of their
    bytes, reloading brings it back to within 1 MiB, and the weights and optimizer state are the same (bitwise
    for the weights, per-tensor float64 sums for the optimizer). On CPU the released storage bytes stand in for
    the allocator's figure."""
    import torch

    def held() -> int:
        if env.cuda:
            env.sync()
            return torch.cuda.memory_allocated()
        params = list(trainer.model.parameters())
        tensors = params + [getattr(p, "main_grad", None) for p in params] + [
            v for inner in _inner_optimizers(trainer) for g in inner.param_groups for v in g["params"]] + [
            v for inner in _inner_optimizers(trainer) for st in inner.state.values() for v in st.values()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                    if torch.is_tensor(t) and t.untyped_storage().nbytes()}
        return sum(storages.values())

    def optimizer_sums() -> list[float]:
        return [float(v.double().sum()) for inner in _inner_optimizers(trainer) for st in inner.state.values()
                for v in st.values() if torch.is_tensor(v)]

    weights = [p.detach().to("cpu", copy=True) for p in trainer.model.parameters()]
    sums = optimizer_sums()
    before = held()
    t0 = time.monotonic()
    out = trainer.offload()
    t_off = time.monotonic() - t0
    low = held()
    t0 = time.monotonic()
    trainer.reload()
    t_re = time.monotonic() - t0
    back = held()
    released = sum(out.values())
    same_w = all(torch.equal(p.detach().cpu(), w) for p, w in zip(trainer.model.parameters(), weights, strict=True))
    same_o = optimizer_sums() == sums
    fell, rose = before - low, back - low
    ok = fell >= 0.9 * released and abs(back - before) <= (1 << 20) and same_w and same_o
    what = "allocated" if env.cuda else "storage bytes"
    return Check("", ok, f"{what}: {before / 2**30:.2f} GiB -> offload {low / 2**30:.2f} GiB (fell "
                 f"{fell / 2**30:.2f} of {released / 2**30:.2f} GiB released, {t_off:.2f} s) -> reload "
                 f"{back / 2**30:.2f} GiB (rose {rose / 2**30:.2f}, {t_re:.2f} s); weights bitwise {same_w}, "
                 f"optimizer state {same_o}", fell / released if released else None,
                 detail={**out, "before": before, "offloaded": low, "reloaded": back})


def _inner_optimizers(trainer) -> list:
    return [o.optimizer for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]


def main_param_figures(trainer) -> dict:
    """After the trainer's first step at one DP rank: the distributed optimizer's main params (dtype, device),
    whether every weight equals its main param rounded to the weight's dtype, and the norm of Adam's first
    moment over all params."""
    import torch

    from megatron_bridge.model import unwrap

    parts = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    main_fp32, same, sq = True, True, 0.0
    device = None
    for part in parts:
        inner = part.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                main_fp32 &= p.dtype == torch.float32
                device = str(p.device)
                sq += float(inner.state[p]["exp_avg"].float().pow(2).sum())
    for p in unwrap(trainer.model).parameters():
        for part in parts:
            if p in part.model_param_group_index_map:
                group, order = part.model_param_group_index_map[p]
                mp = part.optimizer.param_groups[group]["params"][order]
                same &= bool(torch.equal(p.detach().reshape(-1), mp.detach().to(p.dtype).reshape(-1)))
    return {"main_fp32": main_fp32, "main_device": device, "weights_are_main": same, "exp_avg_norm": sq ** 0.5}


def forbidden_modules() -> list[str]:
    """Modules loaded so far that part A may not need (see HEAVY_PACKAGES and PROJECT_MODULES)."""
    bad = []
    for m in sys.modules:
        top = m.split(".")[0]
        if top in HEAVY_PACKAGES:
            bad.append(m)
        elif top == "rollverify" and m not in PROJECT_MODULES:
            bad.append(m)
    return sorted(bad)


def part_a(env: Env, smoke: Smoke) -> None:
    import torch

    from megatron_bridge.model import ModelArch

    bf16 = "bfloat16"
    for name in ("dense", "moe", "0p6b"):
        smoke.run(f"parity_{name}_fp32", lambda n=name: check_parity(n, "float32", env))
    smoke.run("parity_0p6b_bf16", lambda: check_parity("0p6b", bf16, env))  # the tiny models' bf16: CPU-covered
    smoke.run("checkpoint_roundtrip", lambda: check_checkpoint(env))
    smoke.run("routing_replay_bitwise", lambda: check_replay(env))
    smoke.run("verify_device_equals_cpu", lambda: check_verify(env))
    if smoke.wants("train_step_bf16", "trainer_offload_reload", "computeprob_throughput", "train_step_mfu",
                   "memory_vs_length"):
        path = model_path("0p6b", env)
        arch = ModelArch.from_hf_dir(path)
        trainer = make_trainer(path, env, bf16, logprob_chunk_tokens=1024)
        try:
            smoke.run("train_step_bf16", lambda: check_train_step(env, trainer, arch))
            smoke.run("trainer_offload_reload", lambda: check_offload(env, trainer))
            if smoke.wants("computeprob_throughput", "train_step_mfu"):
                check_throughput(env, trainer, arch, smoke)
            smoke.run("memory_vs_length", lambda: check_memory(env, trainer, arch))
        finally:
            trainer.close()
            if env.cuda:
                torch.cuda.empty_cache()
    extra = forbidden_modules()
    smoke.run("imports_part_a", lambda: Check("", not extra, "none of the project's other dependencies loaded "
                                                             f"({', '.join(HEAVY_PACKAGES[:6])}, ...): "
                                                             f"{extra or 'none'}"))


# ---------------------------------------------------------------------------------------------- part B


def part_b(env: Env, smoke: Smoke) -> None:
    """SGLang on the device through the project's server (`rollverify serve`) and client, in bf16."""
    from sglang_ext.launch import launch_server

    path = model_path("dense", env)
    dtype = "bfloat16" if env.cuda else "float32"
    args = ["--dtype", dtype, "--mem-fraction-static", "0.3" if env.cuda else "0.05", "--max-total-tokens", "65536"]
    server = None

    def serve() -> Check:
        nonlocal server
        t = time.monotonic()
        server = launch_server(path, args=args, log_path=env.workdir / "server.log")
        return Check("", True, f"rollverify serve up at {server.endpoint} in {time.monotonic() - t:.1f} s "
                     f"({dtype})", detail={"info": server.info})

    smoke.run("serve", serve)
    if server is None:
        return
    try:
        smoke.run("pause_truncate_resume", lambda: _pause_truncate_resume(server.endpoint))
        smoke.run("weight_update", lambda: _weight_update(server.endpoint, path, env))
        smoke.run("logprob_floor_vs_d_s", lambda: _logprob_floor(server.endpoint, path, env, dtype))
        for kind in ("ipc", "distributed"):
            smoke.run(f"transport_{kind}", lambda kind=kind: _transport(server.endpoint, path, env, dtype, kind))
    finally:
        server.stop()
    smoke.run("memory_release_resume", lambda: _memory_handoff(path, env, dtype, args))


def _record(buffer, chunks) -> None:
    for c in chunks:
        buffer.record(c.response_id, c.token_ids, c.logprobs, c.versions, c.routed_experts,
                      finish_reason=c.finish_reason, offset=c.offset)


def _finish(engine, buffer, responses, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(r.finished for r in responses):
        if time.monotonic() > deadline:
            raise TimeoutError(f"responses unfinished after {timeout_s:.0f} s")
        _record(buffer, engine.wait_finished(1.0))


def _pause_truncate_resume(endpoint: str) -> Check:
    """Greedy: responses paused mid-way, cut (to 0 and to half) and resumed equal one continuous generation."""
    import numpy as np

    from rollverify.buffer import RolloutBuffer
    from rollverify.types import Group
    from sglang_ext.protocol import WireSamplingParams
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    greedy = WireSamplingParams(temperature=0.0, ignore_eos=True)
    prompt = [9, 10, 11, 12, 13]
    buffer = RolloutBuffer()
    buffer.add_group(Group.new(0, prompt, 1, 200))
    buffer.add_group(Group.new(1, prompt, 2, 200))
    ref, cut0, cuthalf = buffer.get("0-0"), buffer.get("1-0"), buffer.get("1-1")
    with SGLangRolloutEngine([endpoint], poll_wait_s=0.2) as engine:
        engine.submit([ref], greedy)
        _finish(engine, buffer, [ref], 120)
        engine.submit([cut0, cuthalf], greedy)
        for _ in range(200):  # pause once both hold >= 20 tokens
            time.sleep(0.02)
            _record(buffer, engine.pause())
            _record(buffer, engine.wait_finished(0.0))
            n = cuthalf.num_tokens
            if min(n, cut0.num_tokens) >= 20:
                break
            engine.resume()
        keep = {"1-0": 0, "1-1": n // 2}
        buffer.apply_truncation(keep)
        engine.truncate(keep)
        engine.resume()
        _finish(engine, buffer, [cut0, cuthalf], 120)
        engine.drop(["0-0", "1-0", "1-1"])
    same = {r.response_id: float((r.token_ids == ref.token_ids).mean()) for r in (cut0, cuthalf)}
    lp = max(float(np.abs(r.logprobs - ref.logprobs).max()) for r in (cut0, cuthalf))
    ok = all(v == 1.0 for v in same.values())
    return Check("", ok, f"paused at {n} tokens, cut to 0 and {n // 2}, resumed: tokens equal to continuous "
                 f"generation {same}; max |lp diff| {lp:.1e}", min(same.values()))


def _weight_update(endpoint: str, path: str, env: Env) -> Check:
    """Push another model's weights (device tensors, as the trainer holds them) and see the engine use them:
    later tokens carry the new version and their log-probs are the new model's; then `path`'s weights again."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model
    from rollverify.buffer import RolloutBuffer
    from rollverify.types import Group
    from sglang_ext.protocol import WireSamplingParams
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    other = ensure_tiny_model(TinyModelSpec(seed=1, max_position_embeddings=40960))
    tensors = sorted((k, v.to(env.device)) for k, v in load_file(str(other / "model.safetensors")).items())
    buckets = [tensors[i::3] for i in range(3)]
    prompt = np.array([20, 21, 22, 23], np.int64)
    buffer = RolloutBuffer()
    buffer.add_group(Group.new(0, prompt, 1, 48))
    tr = buffer.get("0-0")
    with SGLangRolloutEngine([endpoint], poll_wait_s=0.2) as engine:
        engine.pause()
        t = time.perf_counter()
        engine.update_weights(iter(buckets), version=1)
        dt = time.perf_counter() - t
        engine.resume()
        engine.submit([tr], WireSamplingParams(temperature=1.0, ignore_eos=True))
        _finish(engine, buffer, [tr], 120)
        engine.drop(["0-0"])
        engine.pause()
        engine.pool.run(engine.pool.servers[0].conn.update_weights_from_disk(path, 2))  # back to the served model
        engine.resume()
    ref = hf_logprobs(str(other), [_as_train_sequence(prompt, tr.token_ids)], env, torch.float32)[0]
    d = float(np.abs(ref - tr.logprobs).mean())
    ok = bool((tr.versions == 1).all()) and d < 2e-2
    size = sum(v.numel() * v.element_size() for _, v in tensors)
    return Check("", ok, f"{size / 2**20:.1f} MiB in 3 buckets in {dt:.2f} s; versions after: "
                 f"{sorted(set(tr.versions.tolist()))}; mean |engine lp - new model (transformers fp32)| = "
                 f"{d:.1e} (< 2e-2)", d)


def _as_train_sequence(prompt, tokens):
    from megatron_bridge.batch import TrainSequence

    return TrainSequence(prompt, tokens)


def _logprob_floor(endpoint: str, path: str, env: Env, dtype: str, d_s: float = 0.02) -> Check:
    """The engine-versus-trainer log-prob gap at equal weights (both in `dtype`): the OPS floor a verification
    threshold d_s must stay above, or responses are cut for numerics alone."""
    import numpy as np

    from rollverify.buffer import RolloutBuffer
    from rollverify.types import Group
    from sglang_ext.protocol import WireSamplingParams
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 128, 16) for _ in range(32)]
    buffer = RolloutBuffer()
    for i, p in enumerate(prompts):
        buffer.add_group(Group.new(i, p, 1, 128))
    outs = [buffer.get(f"{i}-0") for i in range(len(prompts))]
    with SGLangRolloutEngine([endpoint], poll_wait_s=0.2) as engine:
        engine.submit(outs, WireSamplingParams(temperature=1.0, ignore_eos=True))
        _finish(engine, buffer, outs)
        engine.drop([o.response_id for o in outs])
    seqs = [_as_train_sequence(p, o.token_ids) for p, o in zip(prompts, outs, strict=True)]
    trainer = make_trainer(path, env, dtype)
    try:
        lp, _ = trainer.compute_logprobs(seqs)
    finally:
        trainer.close()
    engine = np.concatenate([o.logprobs for o in outs]).astype(np.float64)
    ops = np.abs(np.expm1(lp.astype(np.float64) - engine))
    per_response = [float(x.mean()) for x in np.split(ops, np.cumsum([o.token_ids.size for o in outs])[:-1])]
    above = float(np.mean([m >= d_s for m in per_response]))
    return Check("", above == 0.0, f"token OPS mean {ops.mean():.2e}, p99 {np.quantile(ops, 0.99):.2e}; response "
                 f"mean OPS max {max(per_response):.2e} vs d_s = {d_s}: {above:.0%} of responses at or above",
                 float(ops.mean()), detail={"response_mean_ops": per_response})


def _transport(endpoint: str, path: str, env: Env, dtype: str, kind: str) -> Check:
    """A stepped trainer on this GPU streams its weights through a GPU transport (`ipc`: CUDA IPC handles of
    flattened buckets, no host copy; `distributed`: SGLang's weight-update group over NCCL); then the engine's
    sampled log-probs equal the trainer's (bf16 floor) and the tokens carry the new version."""
    import numpy as np

    from rollverify.app.weight_transport import TransportSpec
    from rollverify.buffer import RolloutBuffer
    from rollverify.types import Group
    from sglang_ext.protocol import WireSamplingParams
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    version = {"ipc": 21, "distributed": 22}[kind]
    seqs = random_sequences(4, 128, 8, [24, 24, 24, 24])
    trainer = make_trainer(path, env, dtype, lr=2e-2)
    try:
        lps, _ = trainer.compute_logprobs(seqs)
        for s_, lp in zip(seqs, np.split(lps, np.cumsum([q.gen_ids.size for q in seqs])[:-1]), strict=True):
            s_.rollout_logprobs, s_.advantage = lp, 1.0
        trainer.train_step(seqs)  # new weights, so the transport visibly moves them
        buffer = RolloutBuffer()
        prompt = np.array([20, 21, 22, 23], np.int64)
        buffer.add_group(Group.new(0, prompt, 1, 48))
        tr = buffer.get("0-0")
        spec = TransportSpec(kind, (endpoint,), master_addr="127.0.0.1", group=f"smoke-{kind}")
        with SGLangRolloutEngine([endpoint], poll_wait_s=0.2) as engine:
            engine.pause()
            t = time.perf_counter()
            stats = trainer.send_weights(spec, version, 8 << 20)
            dt = time.perf_counter() - t
            engine.resume()
            engine.submit([tr], WireSamplingParams(temperature=1.0, ignore_eos=True))
            _finish(engine, buffer, [tr], 120)
            engine.drop(["0-0"])
        lp, _ = trainer.compute_logprobs([_as_train_sequence(prompt, tr.token_ids)])
    finally:
        trainer.close()
    d = float(np.abs(lp - tr.logprobs).mean())
    ok = bool((tr.versions == version).all()) and d < 2e-2
    return Check("", ok, f"{stats['sync_bytes'] / 2**20:.1f} MiB in {int(stats['sync_buckets'])} buckets in "
                 f"{dt:.2f} s; versions after {sorted(set(tr.versions.tolist()))}; mean |engine lp - trainer lp| "
                 f"= {d:.1e} (< 2e-2)", d)


def _memory_handoff(path: str, env: Env, dtype: str, args: list[str]) -> Check:
    """A server with SGLang's memory saver gives its weights and KV cache back to the GPU on `memory release`
    and takes them again on `resume` (the colocated handoff); the free device memory shows it."""
    import torch

    from rollverify.app.weight_transport import TransportSpec
    from sglang_ext.launch import launch_server
    from sglang_ext.rollout_engine import SGLangRolloutEngine
    from sglang_ext.weight_transport import ServerControl

    server = launch_server(path, args=args, engine_args={"enable_memory_saver": True},
                           log_path=env.workdir / "server-memory-saver.log")
    try:
        with SGLangRolloutEngine([server.endpoint], poll_wait_s=0.2) as engine:
            engine.pause()
            control = ServerControl(TransportSpec("ipc", (server.endpoint,)), [0])
            try:
                free0 = torch.cuda.mem_get_info()[0]
                control.call_all("memory", {"action": "release", "tags": []}, "release")
                free1 = torch.cuda.mem_get_info()[0]
                control.call_all("memory", {"action": "resume", "tags": []}, "resume")
                free2 = torch.cuda.mem_get_info()[0]
            finally:
                control.close()
            engine.resume()
    finally:
        server.stop()
    freed, taken = (free1 - free0) / 2**30, (free1 - free2) / 2**30
    return Check("", freed > 0.5 and taken > 0.5, f"release freed {freed:.2f} GiB, resume took {taken:.2f} GiB "
                 "(needs torch_memory_saver installed)", freed)


# ---------------------------------------------------------------------------------------------- the bundle


def use_bundle(bundle: Path, env: Env) -> None:
    """Take megatron-core from the bundle (`tools/gpu_smoke_bundle.py`) and its tiny models into the work folder
    (where `model_path` finds them); nothing is installed."""
    site = bundle / "site"
    if not (site / "megatron" / "core").is_dir():
        raise SystemExit(f"error: {bundle} is not a gpu-smoke bundle (no site/megatron/core): run make gpu-smoke-bundle")
    sys.path.insert(0, str(site))
    # the bundle stays what make gpu-smoke-bundle wrote (its size is what a carry takes): no __pycache__ in it,
    # from this process or the ones it starts
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    models = bundle / "cache" / "models"
    if models.is_dir():
        shutil.copytree(models, env.workdir / "cache" / "models", dirs_exist_ok=True)
    if env.plan_figures is None and (bundle / "plan_figures.json").is_file():
        env.plan_figures = str(bundle / "plan_figures.json")


# the packages the GPU machine has: torch and transformers with everything they require (read from this machine's
# metadata), the standard library, and the project's and tools' own modules; megatron comes from the bundle only
DEVICE_IMAGE_ROOTS = ("torch", "transformers")
OWN = ("megatron_bridge", "rollverify", "gpu_smoke", "gpu_checks", "gpu_host_checks")


def device_image_modules() -> set[str]:
    """Top-level module names of torch's and transformers' dependency closure (their non-optional requirements)."""
    import importlib.metadata as md
    import re

    from packaging.requirements import Requirement

    dists: set[str] = set()
    todo = list(DEVICE_IMAGE_ROOTS)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in dists:
            continue
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        dists.add(name)
        for r in reqs:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    tops = {m for m, ds in md.packages_distributions().items()
            if any(re.sub(r"[-_.]+", "-", d).lower() in dists for d in ds)}
    return tops | set(sys.stdlib_module_names) | set(OWN) | {"megatron", "_distutils_hack", "__main__"}


def device_image_path(folder: Path) -> list[str]:
    """An import path with only what the GPU machine has: the standard library, and `folder` holding links to
    the site-packages entries (packages and their metadata) of `device_image_modules`. Its own processes start
    with `-I -S` (no site-packages) and this path; the bundle's `site/` (megatron) and the checkout come first."""
    import importlib.metadata as md
    import importlib.util
    import re
    import site

    folder.mkdir(parents=True, exist_ok=True)
    allowed = device_image_modules() - set(sys.stdlib_module_names) - set(OWN) - {"megatron", "__main__"}
    sites = [Path(x).resolve() for x in site.getsitepackages()]
    linked: set[str] = set()
    for name in sorted(allowed):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        where = [Path(x) for x in spec.submodule_search_locations] if spec.submodule_search_locations else \
            [Path(spec.origin)] if spec.origin else []
        for path in where:
            if any(path.resolve().is_relative_to(s) for s in sites) and not (folder / path.name).exists():
                (folder / path.name).symlink_to(path.resolve())
                linked.add(name)
    dists = {re.sub(r"[-_.]+", "-", d).lower() for m, ds in md.packages_distributions().items() if m in linked
             for d in ds}
    for dist in md.distributions():
        info = getattr(dist, "_path", None)
        if info is not None and re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower() in dists and \
                not (folder / Path(info).name).exists():
            (folder / Path(info).name).symlink_to(Path(info).resolve())
    stdlib = [x for x in sys.path if x and "site-packages" not in x and Path(x).exists()
              and Path(x).resolve() != Path(__file__).resolve().parent]
    return [*stdlib, str(folder)]


def tool_imports(tools: Path) -> list[str]:
    """Every module the tools' checks import, at the top or inside a function, but those of part B (SGLang)."""
    import ast

    part_b = {"part_b", "_pause_truncate_resume", "_weight_update", "_logprob_floor", "_transport",
              "_memory_handoff", "_record", "_finish", "_as_train_sequence"}
    found: set[str] = set()
    for name in ("gpu_smoke.py", "gpu_checks.py", "gpu_host_checks.py"):
        tree = ast.parse((tools / name).read_text())
        skip = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name in part_b for n in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
    return sorted(m for m in found if m.split(".")[0] not in ("__future__",))


def dry_run(args) -> int:
    """The bundle's contents and size, then every import on the GPU machine's import path (`device_image_path`):
    the tools' import list, and the parts run on CPU with small shapes (`--device cpu --quick`)."""
    bundle = Path(args.bundle)
    report: dict = {"bundle": str(bundle), "problems": []}
    manifest = bundle / "manifest.json"
    if not manifest.is_file():
        report["problems"].append(f"{bundle} has no manifest.json: run make gpu-smoke-bundle")
    else:
        m = json.loads(manifest.read_text())
        size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
        report.update(size_bytes=size, manifest=m)
        if size > m["max_bytes"]:
            report["problems"].append(f"the bundle is {size / 2**20:.1f} MiB, over {m['max_bytes'] / 2**20:.0f} MiB")
        for name in BUNDLED_MODELS:
            if not (bundle / "cache" / "models" / m["models"][name]).is_dir():
                report["problems"].append(f"the bundle lacks the {name} model {m['models'][name]}")
    tools = Path(__file__).resolve().parent
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rollverify-gpu-smoke-dry-"))
    image = device_image_path(work / "device-image")
    boot = ("import runpy, sys; sys.path[:] = " + repr([str(tools), str((bundle / "site").resolve()), str(tools.parent),
                                                        *image])
            + f"; sys.argv = sys.argv[1:]; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')")
    me = [sys.executable, "-I", "-S", "-c", boot, "gpu_smoke.py", "--bundle", str(bundle)]
    listed = subprocess.run([*me, "--import-list"], capture_output=True, text=True, timeout=600)
    try:
        imports = json.loads(listed.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        imports = {"error": (listed.stdout + listed.stderr)[-3000:]}
    report["imports"] = imports
    bad = {k: v for k, v in imports.items() if isinstance(v, str) and v.startswith("FAILED")}
    if "error" in imports or bad:
        report["problems"].append(f"imports that do not resolve on the GPU machine: {bad or imports}")
    ran = subprocess.run([*me, "--device", "cpu", "--quick", "--part", "AHG", "--budget-s", "1e9",
                          "--workdir", str(work), "--json", str(work / "cpu_run.json")], capture_output=True, text=True,
                         timeout=3600)
    print(ran.stdout, end="", flush=True)
    report["cpu_run"] = {"returncode": ran.returncode, "stderr_tail": ran.stderr[-3000:]}
    if (work / "cpu_run.json").is_file():
        report["cpu_run"]["report"] = json.loads((work / "cpu_run.json").read_text())
    if ran.returncode != 0:
        report["problems"].append(f"the parts on CPU (--device cpu --quick) exited with {ran.returncode}")
    report["tool_modules"] = tool_imports(tools)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    n = sum(1 for v in imports.values() if isinstance(v, str) and not v.startswith("FAILED")) if \
        "error" not in imports else 0
    size = report.get("size_bytes", 0) / 2**20
    print(f"{'FAIL' if report['problems'] else 'PASS'} dry run: bundle {size:.1f} MiB; {n} modules the checks import "
          f"resolve as on the GPU machine; the parts ran on CPU (exit {ran.returncode}); wrote {args.json}"
          + "".join(f"\n  problem: {x}" for x in report["problems"]), flush=True)
    return 1 if report["problems"] else 0


def import_list() -> int:
    """Import each module of `tool_imports` and print {module: where it came from, or FAILED and why}: in
    `--dry-run`'s process, whose import path is the GPU machine's (`device_image_path`)."""
    import importlib

    out = {}
    for name in tool_imports(Path(__file__).resolve().parent):
        try:
            mod = importlib.import_module(name)
            out[name] = getattr(mod, "__file__", None) or "built-in"
        except Exception as e:  # noqa: BLE001 - reported as not resolving
            out[name] = f"FAILED {type(e).__name__}: {e}"
    optional = {"transformer_engine", "flash_attn"}  # the checks skip without them, as they will there
    for name, where in list(out.items()):
        if name.split(".")[0] in optional and where.startswith("FAILED"):
            out[name] = f"absent, as on the GPU machine (the check skips): {where.removeprefix('FAILED ')}"
    print(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["A", "B", "G", "H", "AG", "AH", "AHG", "AB", "ABG"], default="AHG",
                   help="A: the trainer, H: host memory, NCCL, TE, kernels (tools/gpu_host_checks.py), G: colocated "
                   "memory, IPC and kernels (tools/gpu_checks.py), B: SGLang")
    p.add_argument("--device", default="cuda", help="cuda (cuda:N) or cpu (the logic with small shapes)")
    p.add_argument("--quick", action="store_true", help="small shapes (the 0.6B model cut down, short lengths)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="a check that would end after it is skipped")
    p.add_argument("--checks", default=None, help="comma list: run only these checks (default: all of the part)")
    p.add_argument("--json", default="gpu_smoke.json")
    p.add_argument("--workdir", default=None, help="models and checkpoints go here (default: a temp folder)")
    p.add_argument("--bundle", default=None, help="the folder make gpu-smoke-bundle wrote (megatron-core, models, "
                   "the planner's figures): what a machine without the project's install needs")
    p.add_argument("--dry-run", action="store_true", help="with --bundle, on CPU: the bundle and every import "
                   "the checks make, as the GPU machine will resolve them")
    p.add_argument("--import-list", action="store_true", help=argparse.SUPPRESS)  # --dry-run's own process
    p.add_argument("--plan-figures", default=None, help="part G: the planner's figures as --write-plan-figures wrote "
                   "them (where rollverify.app.plan does not import; a bundle has them)")
    p.add_argument("--write-plan-figures", default=None, metavar="PATH",
                   help="write the planner's figures for part G to PATH and exit (needs the project's install)")
    args = p.parse_args(argv)
    if args.write_plan_figures:
        import gpu_checks

        gpu_checks.write_plan_figures(args.write_plan_figures)
        return 0
    if args.dry_run:
        if args.bundle is None:
            p.error("--dry-run checks a bundle: give --bundle (make gpu-smoke-bundle writes build/gpu-smoke)")
        return dry_run(args)
    if args.import_list:
        return import_list()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("FAIL setup: no CUDA device visible (use --device cpu --quick for a dry run)", flush=True)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rollverify-gpu-smoke-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ROLLVERIFY_CACHE", str(workdir / "cache"))  # the models made here stay here
    env = Env(args.device, args.quick, workdir, args.plan_figures)
    if args.bundle:
        use_bundle(Path(args.bundle), env)
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": args.device,
            "device_name": torch.cuda.get_device_name() if env.cuda else platform.processor(),
            "quick": args.quick, "part": args.part, "budget_s": args.budget_s, "bundle": args.bundle}
    for mod in ("transformers", "megatron.core"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[mod] = f"{m.__version__} ({Path(m.__file__).parent})"
        except Exception:  # noqa: BLE001 - a version string is informational
            info[mod] = None
    smoke = Smoke(args.budget_s, set(args.checks.split(",")) if args.checks else None, args.json, info)
    smoke.write(complete=False)
    if "A" in args.part:
        part_a(env, smoke)
    if "H" in args.part:
        import gpu_host_checks

        gpu_host_checks.run_all(smoke, env, Check, lambda: stepped_trainer(env))
    if "G" in args.part:
        import gpu_checks

        gpu_checks.run_all(smoke, env, Check, lambda name: model_path(name, env))
    if "B" in args.part:
        part_b(env, smoke)
    failed = [c.name for c in smoke.checks if c.passed is False]
    smoke.write(complete=True)
    print(f"{'FAIL' if failed else 'PASS'} all: {len(smoke.checks) - len(failed)}/{len(smoke.checks)} checks "
          f"passed or skipped in {time.monotonic() - smoke.t0:.0f} s; wrote {args.json}", flush=True)
    return 1 if failed else 0


def stepped_trainer(env: Env):
    """Part H's trainer: the 0.6B-shaped model (cut down with --quick) in bf16 on the device (fp32 on CPU), one
    GRPO step taken, so that the distributed optimizer holds its state."""
    path = model_path("0p6b", env)
    from rollverify.losses import CorrectionConfig

    trainer = make_trainer(path, env, "bfloat16" if env.cuda else "float32", correction=CorrectionConfig(method="none"))
    seqs = random_sequences(4, 1000, 8, [16, 24])
    trainer.train_step(seqs)
    return trainer


if __name__ == "__main__":
    raise SystemExit(main())
