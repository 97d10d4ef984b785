"""Megatron-Core side of RollVerify: conversion, log-probs, routing replay, train step, weight export.

Entry points (import the submodules; importing this package pulls in nothing heavy):

* `trainer.MegatronTrainer(model_path, config.TrainerConfig(...))`: one SPMD rank (world size 1 runs
  in-process); `config.TrainerConfig` is the run config's `trainer` section, with its `check()`;
  `proxy.TrainerProxy`: the same methods over a rank group (`spawned.PipeRanks`: child processes,
  `spawned.spawn_trainer` / `spawned.make_trainer(..., world_size=N)`; `ray_trainer.RayRanks`: Ray actors);
  `loop_adapter.LoopTrainer`: the loop's `rollverify.interfaces.Trainer` over either.
* `convert`: HF <-> Megatron-Core weights for Qwen3 / Qwen3-MoE (TP, EP, PP), `iter_hf_tensors` /
  `iter_hf_buckets` streaming (a bucket: one collective).
* `throughput`, `wrap`: the GPU throughput paths chosen at start (TE spec, grouped GEMM, overlapped gradient
  reduce, the flash-attention varlen kernel) and the DDP / optimizer set-up that takes them.
* `weight_sync`: `WeightSink` (begin/push/end): in-memory, disk and callable sinks, and `TransportSink`, the
  GPU transports' (a broadcast over SGLang's weight-update group, or CUDA IPC, one payload per server TP rank)
  driven by a `BucketControl`.
* `micro_batches`, `weights_out`, `offload`: the trainer's micro-batch runner, its weights-out side, and its
  side of the colocated memory handoff (offload / reload of parameters, gradients, optimizer state).
* `replay`: R3 routing replay; `cpu_compat` / `parallel`: Megatron-Core on CPU over gloo.
"""
