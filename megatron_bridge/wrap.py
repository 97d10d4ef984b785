"""A trainer rank's Megatron-Core wrappers: DDP over the model (with the overlapped gradient reduce and parameter
gather of the throughput paths, `megatron_bridge.throughput`) and the optimizer with its LR scheduler."""

from __future__ import annotations

import torch

from megatron_bridge.config import TrainerConfig
from megatron_bridge.throughput import ThroughputPaths


def wrap_ddp(model, tconfig, cfg: TrainerConfig, dtype: torch.dtype, paths: ThroughputPaths):
    """`model` in Megatron-Core's DDP (a Float16Module first for half precision); the config's no-sync and
    finalize hooks point at it. Overlap (`paths`): the gradient buckets reduce(-scatter) while the backward
    still runs (`megatron/core/distributed/distributed_data_parallel.py`); the parameter gather stays in the
    optimizer step unless `paths.overlap_param_gather`."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    if dtype != torch.float32:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tconfig, model)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=paths.overlap_grad_reduce,
        overlap_param_gather=paths.overlap_param_gather and cfg.use_distributed_optimizer,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=tconfig, ddp_config=ddp_cfg, module=model)
    tconfig.no_sync_func = ddp.no_sync
    tconfig.finalize_model_grads_func = finalize_model_grads
    return ddp


def make_optimizer(model, cfg: TrainerConfig, dtype: torch.dtype, paths: ThroughputPaths):
    """Megatron-Core's optimizer over the DDP `model` and its LR scheduler, from the trainer section."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    c = cfg
    ocfg = OptimizerConfig(
        optimizer=c.optimizer, lr=c.lr, min_lr=c.min_lr, weight_decay=c.weight_decay,
        adam_beta1=c.adam_beta1, adam_beta2=c.adam_beta2, adam_eps=c.adam_eps, clip_grad=c.grad_clip,
        bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=c.use_distributed_optimizer,
        overlap_param_gather=paths.overlap_param_gather and c.use_distributed_optimizer,
    )
    opt = get_megatron_optimizer(ocfg, [model])
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0 if c.lr_warmup_steps else c.lr, max_lr=c.lr, min_lr=c.min_lr,
        lr_warmup_steps=c.lr_warmup_steps, lr_decay_steps=max(c.steps, c.lr_warmup_steps + 1),
        lr_decay_style=c.lr_decay_style, start_wd=c.weight_decay, end_wd=c.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant",
    )
    return opt, sched
