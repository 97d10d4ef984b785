"""The trainer on responses of policy and environment tokens: log-probs recomputed over the whole
sequence, only policy tokens trained (loss mask), TIS, the token-mean denominator and the mismatch figures over
policy tokens; environment tokens get no gradient."""

from __future__ import annotations

import numpy as np
import pytest
from megatron_fixtures import MARKS, fixed_sequences, hf_token_logprobs, tiny_path

pytestmark = MARKS

ADV = [1.0, -1.0, 0.5, -0.5]
ENV = slice(3, 7)  # tokens 3-6 of the 9-token sequence are a tool's output


def _responses(path, env_logprobs: float = np.nan):
    """Four responses (6, 9, 3, 12 tokens); the second holds 4 environment tokens with `env_logprobs` (NaN: as
    the rollout records them) where the engine would have a log-prob."""
    from rollverify.types import ENV_VERSION, ENVIRONMENT, Response

    seqs = fixed_sequences(4)
    lps, _ = hf_token_logprobs(path, seqs)
    out = []
    for i, s in enumerate(seqs):
        lp = lps[i] - 0.05
        src = np.zeros(len(lp), np.uint8)
        ver = np.zeros(len(lp), np.int64)
        if i == 1:
            lp[ENV], src[ENV], ver[ENV] = env_logprobs, ENVIRONMENT, ENV_VERSION
        out.append(Response(0, i, s.prompt_ids, 64, token_ids=s.gen_ids, logprobs=lp, versions=ver, sources=src,
                            finished=True, finish_reason="stop"))
    return out


def _weights(trainer) -> dict[str, np.ndarray]:
    return {n: t.detach().float().numpy().copy() for n, t in trainer.iter_hf_tensors()}


def test_environment_tokens_are_recomputed_but_never_trained():
    from megatron_bridge.loop_adapter import LoopTrainer, train_sequence
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    path = tiny_path()
    cfg = TrainerConfig(lr=1e-2, micro_batch_tokens=24)
    responses = _responses(path)
    seq = train_sequence(responses[1])
    assert seq.loss_mask.tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert train_sequence(responses[0]).loss_mask is None  # no environment token: nothing to mask

    a = LoopTrainer(MegatronTrainer(path, cfg))
    lps = a.compute_logprobs(responses, temperature=1.0)  # over the whole sequence, env positions included
    assert [len(x) for x in lps] == [6, 9, 3, 12] and all(np.isfinite(x).all() for x in lps)
    m = a.train_step(responses, np.array(ADV), temperature=1.0, policy_version=0)
    policy = sum(r.num_policy_tokens for r in responses)
    assert m["tokens"] == policy == 30 - 4  # the token-mean denominator: policy tokens only
    assert m["mismatch_tokens"] == policy and m["mismatch_abs_mean"] == pytest.approx(0.05, abs=1e-4)
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and m["tis_weight_mean"] == pytest.approx(
        np.exp(0.05), abs=1e-4)
    after_a = _weights(a.trainer)

    # the same step with anything at all where the environment tokens' log-probs would be: the same update
    b = LoopTrainer(MegatronTrainer(path, cfg))
    mb = b.train_step(_responses(path, env_logprobs=-20.0), np.array(ADV), temperature=1.0, policy_version=0)
    assert mb["loss"] == pytest.approx(m["loss"], abs=1e-7) and mb["tokens"] == m["tokens"]
    after_b = _weights(b.trainer)
    assert all(np.array_equal(after_a[k], after_b[k]) for k in after_a)

    # a response made only of environment tokens adds nothing: neither gradient nor denominator
    from rollverify.types import ENVIRONMENT, Response

    only_env = Response(0, 4, responses[0].prompt_ids, 64, token_ids=responses[3].token_ids,
                        logprobs=np.full(12, np.nan, np.float32), versions=np.full(12, -1),
                        sources=np.full(12, ENVIRONMENT, np.uint8), finished=True, finish_reason="stop")
    c = LoopTrainer(MegatronTrainer(path, cfg))
    mc = c.train_step([*_responses(path), only_env], np.array([*ADV, 3.0]), temperature=1.0, policy_version=0)
    assert mc["tokens"] == m["tokens"] and mc["loss"] == pytest.approx(m["loss"], abs=1e-6)
    after_c = _weights(c.trainer)
    assert max(float(np.abs(after_a[k] - after_c[k]).max()) for k in after_a) < 1e-6
    for t in (a, b, c):
        t.close()
