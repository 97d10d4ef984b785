"""tools/gpu_smoke.py's part H: host memory, NCCL on one GPU, Transformer Engine and the attention kernels' own
check, on the GPU machine the smoke check runs on (one GPU, torch and transformers, megatron-core from the bundle).

- host_ram_distopt_save: a bf16 trainer of the 0.6B-shaped model steps once and saves its distributed checkpoint
  the way megatron_bridge.checkpoint does (memory-efficient gather, torch_dist); a thread samples the process's
  C heap (glibc mallinfo2) every 0.2 ms. Its peak over the heap before the save is held against the host ledger's
  figure for that rank (`rollverify.app.host_memory.rank_checkpoint`: the gathered fp32 state, one bucket's
  buffers, the bf16 weights the writer copies from the GPU), within 15 %.
- nccl_two_ranks_one_gpu: two processes on cuda:0 join one NCCL group and all-reduce. NCCL refuses two ranks on
  one device in most versions ("Duplicate GPU detected"): that is reported as a skip with NCCL's words; a hang past
  90 s or another error fails.
- te_layer: where `transformer_engine.pytorch` imports, a TE LayerNormLinear forward and backward against torch's
  layer norm and linear in bf16, and its `_extra_state` (FP8 metadata) through get/set. TE's wheels do not fit the
  64 MiB a GPU machine takes with the checkout, so on that machine it is a skip.
- attention_kernel_check: `megatron_bridge.throughput.check_kernel` (a causal varlen forward and backward with
  GQA) on each flash-attention kernel that imports, as `probe()` runs it before choosing one.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> int:
    """What this process holds in the C heap now (in-use arena and mmapped blocks: torch's CPU tensors)."""
    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = _MallInfo2
    m = fn()
    return m.uordblks + m.hblkhd


class HeapPeak:
    """The heap's peak over a block, sampled every `every_s` by a thread."""

    def __init__(self, every_s: float = 0.0002) -> None:
        self.every_s, self.peak, self.base, self._on = every_s, 0, 0, False

    def __enter__(self) -> HeapPeak:
        self.base = self.peak = heap_bytes()
        self._on = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._on:
            self.peak = max(self.peak, heap_bytes())
            time.sleep(self.every_s)

    def __exit__(self, *exc) -> None:
        self._on = False
        self._thread.join()
        self.peak = max(self.peak, heap_bytes())

    @property
    def above_base(self) -> int:
        return self.peak - self.base


def check_host_ram_of_save(trainer, workdir) -> tuple:
    """(passed, figure, value, detail) of host_ram_distopt_save for a stepped `trainer` (world size 1)."""
    import gc

    from rollverify.app.host_memory import rank_checkpoint

    params = sum(b.numel_unpadded for b in trainer.model.buffers)
    device = trainer.device.type
    ck = rank_checkpoint(params, 0, rank=0, tp=1, cp=1, dp=1, ep=1, etp=1, world=1, pp=1, weight_bytes=2,
                         mem_efficient=True, device=device,
                         bucket_params=40_000_000 if trainer.paths.overlap_grad_reduce else None)
    ledger = ck.gather + ck.buffers + ck.staging
    gc.collect()
    with HeapPeak() as heap:
        t = time.monotonic()
        trainer.save_checkpoint(workdir / "host-ram-save")
        seconds = time.monotonic() - t
    measured = heap.above_base
    ok = abs(measured - ledger) <= 0.15 * ledger
    gib = 1 << 30
    return (ok, f"save of {params / 1e6:.0f} M parameters peaked {measured / gib:.2f} GiB above the heap before it, "
                f"the host ledger counts {ledger / gib:.2f} GiB (gathered state {ck.gather / gib:.2f}, buffers "
                f"{ck.buffers / gib:.2f}, weights staged from the device {ck.staging / gib:.2f}); within 15 %: {ok}; "
                f"{seconds:.1f} s", measured / ledger,
            {"params": params, "measured_bytes": measured, "ledger_bytes": ledger, "gather": ck.gather,
             "buffers": ck.buffers, "staging": ck.staging, "seconds": seconds})


def _nccl_rank(rank: int, port: int, results) -> None:
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        x = torch.ones(1 << 20, device="cuda") * (rank + 1)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        results.put((rank, float(x[0].item()), None))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, f"{type(e).__name__}: {e}"))


def check_nccl_one_gpu(timeout_s: float = 90.0) -> tuple:
    """(passed or None, figure, value, detail) of nccl_two_ranks_one_gpu."""
    import queue
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, value, error = results.get(timeout=1.0)
                got[rank] = (value, error)
            except queue.Empty:
                continue
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    errors = [e for _, e in got.values() if e]
    if len(got) < 2:
        return False, f"no answer from {2 - len(got)} rank(s) within {timeout_s:.0f} s (NCCL hung)", None, {}
    if errors:
        refused = any("Duplicate GPU" in e or "duplicate" in e.lower() for e in errors)
        return (None if refused else False), f"NCCL {'refuses' if refused else 'failed'}: {errors[0][:300]}", None, \
            {"errors": errors}
    values = sorted(v for v, _ in got.values())
    return values == [3.0, 3.0], f"two ranks on cuda:0 all-reduced 1 + 2 = {values}", values[0], {}


def check_te_layer(device: str) -> tuple:
    """(passed or None, figure, value, detail) of te_layer."""
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # noqa: BLE001 - not installed here, or built for another torch
        return None, (f"Transformer Engine does not import here ({type(e).__name__}: {e}); its wheels do not fit the "
                      "64 MiB a GPU machine takes with the checkout (requirements/te.txt, `make te`)"), None, {}
    import torch

    torch.manual_seed(0)
    layer = te.LayerNormLinear(256, 512, normalization="RMSNorm", eps=1e-6, params_dtype=torch.bfloat16).to(device)
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    out.float().sum().backward()
    w = layer.weight.detach().float()
    xr = x.detach().float().requires_grad_(True)
    norm = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.layer_norm_weight.detach().float()
    ref = norm @ w.t()
    ref.sum().backward()
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    gerr = float((x.grad.float() - xr.grad).abs().max() / xr.grad.abs().max())
    state = layer.get_extra_state()
    layer.set_extra_state(state)
    ok = err < 2e-2 and gerr < 5e-2
    return ok, (f"TE {te.__version__ if hasattr(te, '__version__') else ''} LayerNormLinear bf16: output rel. "
                f"error {err:.1e}, input gradient {gerr:.1e}; _extra_state {type(state).__name__} round trip"), err, {}


def check_attention_kernels(device: str) -> tuple:
    """(passed or None, figure, value, detail) of attention_kernel_check."""
    from megatron_bridge.throughput import _imports, check_kernel, varlen_kernel

    errors: dict[str, str] = {}
    found = {"flash_attn_2": _imports("flash_attn", "flash_attn_varlen_func", errors),
             "flash_attn_4": _imports("flash_attn.cute", "flash_attn_varlen_func", errors)}
    ran = {name: check_kernel(varlen_kernel(name), device) for name, ok in found.items() if ok}
    if not ran:
        return None, f"no flash-attention kernel imports here ({'; '.join(errors.values()) or 'not installed'})", \
            None, {}
    ok = all(v is None for v in ran.values())
    return ok, "; ".join(f"{k}: {v or 'causal varlen GQA forward and backward agree with SDPA'}"
                         for k, v in ran.items()), None, {"ran": ran}


def run_all(smoke, env, check_cls, make_trainer_fn) -> None:
    """Part H through gpu_smoke's `Smoke` runner; `make_trainer_fn()` builds the stepped trainer of the save."""

    def wrap(fn):
        def run():
            passed, figure, value, detail = fn()
            return check_cls("", passed, figure, value, detail=detail)

        return run

    def save() -> tuple:
        trainer = make_trainer_fn()
        try:
            return check_host_ram_of_save(trainer, env.workdir)
        finally:
            trainer.close()

    smoke.run("host_ram_distopt_save", wrap(save), estimate_s=120)
    if env.cuda:
        smoke.run("nccl_two_ranks_one_gpu", wrap(check_nccl_one_gpu), estimate_s=100)
        smoke.run("attention_kernel_check", wrap(lambda: check_attention_kernels(env.device)), estimate_s=60)
    smoke.run("te_layer", wrap(lambda: check_te_layer(env.device)), estimate_s=30)
