"""The trainer wing's config section: what `megatron_bridge.trainer.MegatronTrainer` takes (the run config's
`trainer` section), with its bounds and its one `check()`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

from rollverify.losses import CORRECTIONS, CorrectionConfig
from rollverify.sections import ConfigError, bounded

LossKind = Literal["grpo", "ppo", "gspo", "sapo", "vespo"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
DecayStyle = Literal["constant", "linear", "cosine"]

_METHOD = "trainer.correction.method"
_RETIRED_CORRECTION = {
    "use_tis": f"set {_METHOD}: tis for use_tis true, none for false (one of {', '.join(CORRECTIONS)})",
    "stale_correction": f"set {_METHOD} (one of {', '.join(CORRECTIONS)}); it weighs by the engine's log-probs "
                        "by itself, with no use_tis beside it",
    "mask_offpolicy": f"set {_METHOD}: mask_offpolicy for true, and trainer.correction.then to what weighs the "
                      "tokens it keeps (none, or tis, decoupled, ...: what use_tis / stale_correction chose)",
    # the knobs, which sat beside them
    **{f.name: f"set trainer.correction.{f.name}" for f in fields(CorrectionConfig) if f.name not in ("method", "then")},
}


@dataclass
class TrainerConfig:
    """The trainer: optimiser, policy loss, parallel layout, limits. `MegatronTrainer` takes this section as it
    is (the run config's `trainer`); the model's dtype, the seed and the sampling temperature it reads from their
    own sections."""

    steps: int = bounded(40, ge=1)  # optimizer steps (= policy versions) of the run; the lr schedule decays over them
    lr: float = bounded(1e-6, gt=0.0)  # the paper's 1e-6; the tiny CPU model needs ~1e-4
    min_lr: float = bounded(0.0, ge=0.0)
    lr_warmup_steps: int = bounded(0, ge=0)
    lr_decay_style: DecayStyle = "constant"
    weight_decay: float = bounded(0.0, ge=0.0)
    grad_clip: float = bounded(1.0, gt=0.0)  # global gradient norm bound
    optimizer: Literal["adam", "sgd"] = "adam"
    adam_beta1: float = bounded(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = bounded(0.999, ge=0.0, lt=1.0)
    adam_eps: float = bounded(1e-8, gt=0.0)
    use_distributed_optimizer: bool = True  # Megatron-Core's optimizer-state sharding over DP (Adam only)
    loss: LossKind = "grpo"  # grpo (= ppo: PPO surrogate on GRPO advantages), gspo, sapo, vespo
    # VeRL's names; null: the loss's own as in VeRL (grpo, vespo: token-mean; gspo, sapo: seq-mean-token-mean)
    loss_agg_mode: AggMode | None = None
    eps_low: float = bounded(0.2, ge=0.0, lt=1.0)  # decoupled clipping: ratio in [1 - eps_low, 1 + eps_high]
    eps_high: float = bounded(0.3, ge=0.0)
    dual_clip_c: float = bounded(3.0, gt=1.0)  # dual-clip bound for negative advantages; inf: off
    gspo_eps_low: float = bounded(3e-4, ge=0.0)
    gspo_eps_high: float = bounded(4e-4, ge=0.0)
    sapo_tau_pos: float = bounded(1.0, gt=0.0)
    sapo_tau_neg: float = bounded(1.05, gt=0.0)
    vespo_c1_pos: float = bounded(2.0, ge=0.0)  # VESPO's kernel W^c1 exp(c2 (1 - W)) for A >= 0
    vespo_c2_pos: float = bounded(3.0, gt=0.0)
    vespo_c1_neg: float = bounded(3.0, ge=0.0)  # and for A < 0
    vespo_c2_neg: float = bounded(2.0, gt=0.0)
    # what weighs and masks tokens the engine sampled under another policy than the trainer's: TIS, the field's
    # corrections, slime's mask of carried-over tokens (rollverify.losses.CorrectionConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    tp: int = bounded(1, ge=1)  # tensor parallel
    pp: int = bounded(1, ge=1)  # pipeline parallel
    ep: int = bounded(1, ge=1)  # expert parallel (carved out of tp*dp, as in Megatron-Core)
    dp: int = bounded(1, ge=1)  # data parallel; world size = tp * pp * cp * dp
    cp: int = bounded(1, ge=1)  # context parallel: every packed sequence split over cp ranks (dense models)
    etp: int = bounded(1, ge=1)  # expert tensor parallel: each expert's weights split over etp ranks (1: whole)
    micro_batch_tokens: int = bounded(4096, ge=1)  # packed tokens per micro-batch
    replay_verify: bool = False  # MoE: replay the engine's routes when computing log-probs for verification
    replay_train: bool = True  # MoE: routing replay (R3) for the old-log-prob recompute and the training step
    recompute: Literal["none", "selective", "full"] = "none"  # activation recompute in the training backward
    sequence_parallel: bool = False  # split the sequence over the TP group between layers (needs tp > 1)
    logprob_chunk_tokens: int = bounded(1024, ge=1)  # tokens whose [tokens x vocab/tp] logits exist at once
    max_seq_len: int = bounded(0, ge=0)  # most model inputs (prompt + response - 1) per sequence; 0: the model context
    dist_timeout_s: float = bounded(1800.0, gt=0.0)  # trainer collectives (gloo / NCCL) that wait longer fail
    call_timeout_s: float = bounded(3600.0, gt=0.0)  # a trainer rank silent for longer during a call fails it
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda where a GPU is visible, else cpu
    # the colocated memory handoff: from each weight push to the next training phase the trainer's parameters,
    # gradients and optimizer state leave the device (megatron_bridge.offload) while the servers hold theirs.
    # null: on where the servers release their memory too (cluster.launcher ray, placement colocated), else off
    offload_between_phases: bool | None = None

    RETIRED: ClassVar[dict[str, str]] = _RETIRED_CORRECTION

    def check(self) -> None:
        """The rules between this section's keys (bounds and types are the fields' own); `ConfigError` naming
        the key. The run config calls it when it validates (its `dp` is the run's; a trainer built without a run
        config derives dp from its world size, and Megatron-Core checks the layout there)."""
        if (self.tp * self.cp * self.dp) % (self.ep * self.etp):
            span = "tp*dp" if self.cp == 1 else "tp*cp*dp"
            what = "" if self.etp == 1 else f"ep*etp = {self.ep * self.etp} "
            raise ConfigError(f"trainer.ep: {what}must divide {span} = {self.tp * self.cp * self.dp} "
                              f"(Megatron-Core), got {self.ep}")
        if self.min_lr > self.lr:
            raise ConfigError(f"trainer.min_lr: must be <= trainer.lr ({self.lr}), got {self.min_lr}")
        if self.optimizer != "adam" and self.use_distributed_optimizer:
            raise ConfigError(f"trainer.optimizer: Megatron-Core's distributed optimizer supports adam only, got "
                              f"{self.optimizer!r}; set trainer.use_distributed_optimizer=false")
        self.correction.check("trainer.correction")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("trainer.sequence_parallel: needs trainer.tp > 1 (it splits the sequence over TP)")

    def offloads(self, launcher: str, placement: str) -> bool:
        """Whether the trainer offloads between phases in this cluster layout (`offload_between_phases`)."""
        if self.offload_between_phases is None:
            return launcher == "ray" and placement == "colocated"
        return self.offload_between_phases

    @property
    def loss_kind(self) -> str:
        """The loss function `loss` names in `rollverify.losses` (grpo's surrogate is ppo's)."""
        return "ppo" if self.loss == "grpo" else self.loss

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp
