"""The trainer's side of the colocated memory handoff (megatron_bridge.offload) on a real Megatron-Core model:
offload releases the storages of parameters, gradients and optimizer state, reload restores them bit for bit in
place, and training through an offload/reload cycle is the training without one. (World size 2: the TP-2
checkpoint test in test_megatron_trainer.py goes through a cycle; the handoff's order against a server:
test_weight_transport.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron_fixtures import MARKS, fixed_sequences, hf_token_logprobs, tiny_path

pytestmark = MARKS

ADV = [1.0, -1.0, 0.5, -0.5]


def _batch():
    seqs = fixed_sequences(4)
    lps, _ = hf_token_logprobs(tiny_path(), seqs)
    for i, s in enumerate(seqs):
        s.rollout_logprobs, s.advantage = lps[i] - 0.05, ADV[i]
    return seqs


def _trainer(dtype: str):
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    return MegatronTrainer(tiny_path(), TrainerConfig(lr=1e-2, micro_batch_tokens=24), dtype=dtype)


def _inner(trainer):
    return [o.optimizer for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]


def _state(trainer) -> dict[str, torch.Tensor]:
    """Copies of every parameter, optimizer main param and optimizer state tensor."""
    out = {f"param/{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for i, inner in enumerate(_inner(trainer)):
        for j, p in enumerate(q for g in inner.param_groups for q in g["params"]):
            out[f"main/{i}/{j}"] = p.detach().clone()
            for k, v in inner.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"state/{i}/{j}/{k}"] = v.detach().clone()
    return out


def _storage_bytes(trainer) -> dict[str, int]:
    params = list(trainer.model.parameters())
    opt = [v for inner in _inner(trainer) for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
    return {"params": sum(p.untyped_storage().nbytes() for p in params),
            "grads": sum(p.main_grad.untyped_storage().nbytes() for p in params),
            "optimizer": sum(v.untyped_storage().nbytes() for v in opt)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_releases_the_storages_and_reload_restores_them_bit_for_bit(dtype):
    """float32: the distributed optimizer's main params are views of the parameters; bfloat16: fp32 copies of
    their own (offloaded with the optimizer). A step after an offload/reload cycle equals the step without one."""
    seqs = _batch()
    plain = _trainer(dtype)
    plain.train_step(seqs)
    m_plain = plain.train_step(seqs)
    want = _state(plain)
    plain.close()

    trainer = _trainer(dtype)
    trainer.train_step(seqs)
    before = _state(trainer)
    held = _storage_bytes(trainer)
    assert min(held.values()) > 0
    stats = trainer.offload(("grads", "optimizer"))
    assert _storage_bytes(trainer)["grads"] == _storage_bytes(trainer)["optimizer"] == 0
    assert _storage_bytes(trainer)["params"] == held["params"]  # the kinds not asked for stay
    stats.update(trainer.offload(("params",)))
    assert _storage_bytes(trainer) == {"params": 0, "grads": 0, "optimizer": 0}
    assert trainer.memory.offloaded == ("params", "grads", "optimizer")
    assert stats["offload/params_bytes"] >= sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert stats["offload/optimizer_bytes"] > 0 and stats["offload/grads_bytes"] > 0

    # a call that needs the weights between phases brings them back for its duration only
    lp, _ = trainer.compute_logprobs(seqs)
    exported = trainer.export_hf_state()
    assert _storage_bytes(trainer)["params"] == 0 and np.isfinite(lp).all() and exported

    reloaded = trainer.reload()
    assert reloaded["reload/params_bytes"] == stats["offload/params_bytes"]
    assert _storage_bytes(trainer) == held and trainer.memory.offloaded == ()
    after = _state(trainer)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(not p.main_grad.any() for p in trainer.model.parameters())  # freed gradients come back as zeros

    m = trainer.train_step(seqs)
    assert (m["loss"], m["grad_norm"]) == (m_plain["loss"], m_plain["grad_norm"])
    got = _state(trainer)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="unknown trainer memory kind"):
        trainer.offload(("activations",))
    trainer.close()
