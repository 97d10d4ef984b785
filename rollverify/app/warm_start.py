"""Supervised warm start of a tiny model on a synthetic task, and sampled-reward evaluation.

RL from a random tiny model never sees a reward; RL from a solved task has nothing to learn. A short
teacher-forced run on correct demonstrations puts the policy in between (sampled reward well above zero, well
below one at temperature 1), where GRPO has signal and partial rollout's off-policy drift shows up in the reward.
Everything is deterministic for a seed: data order, optimiser, sampling (run single-threaded, see `single_thread`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from rollverify.tasks import Example, get_task


@dataclass(frozen=True)
class WarmStartRecipe:
    """Budget and optimiser of the warm start; `steps` is the knob that sets the starting reward."""

    steps: int = 350
    batch_size: int = 32
    micro_batch: int = 8  # examples are sorted by length and split, so long-tailed lengths pad little
    lr: float = 5e-3
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0


# Per-task recipes: the warm-started default tiny model (hidden 64, 2 layers) samples a reward of ~0.4 at
# temperature 1 on the eval split (greedy ~0.5; 300 steps give ~0.27, 400 ~0.5), in about a minute on one idle
# core; countdown_short with the same recipe ~0.32 (T=1), ~0.40 (greedy).
# `python tools/experiments/warm_start_report.py` measures them.
RECIPES: dict[str, WarmStartRecipe] = {
    "countdown": WarmStartRecipe(),
    "countdown_short": WarmStartRecipe(),
    # turns of ~73 tokens (45 of them the policy's): fewer, shorter-batched steps than countdown's
    "toolchain": WarmStartRecipe(steps=200, batch_size=16, micro_batch=8),
}


WARM_START_VERSION = 1  # bump when the training loop itself changes what it produces


@dataclass
class WarmStartResult:
    steps: int
    final_loss: float
    seconds: float


@contextlib.contextmanager
def single_thread():
    """Run torch on one thread: the same bits on any machine (reduction order does not depend on the core
    count), and no oversubscription on a shared 2-core machine, where two threads run 5-10x slower than one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def demonstration_batch(tokenizer, task, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 on prompt and padding) for prompt + demonstration + EOS; a
    multi-turn task's environment parts (`demonstration_segments`: tool outputs) are inputs, never labels."""
    seqs, labs = [], []
    for ex in examples:
        p = _encode(tokenizer, ex.prompt)
        segments = task.demonstration_segments(ex) if hasattr(task, "demonstration_segments") else \
            [(task.demonstration(ex), True)]
        r, lab = [], []
        for text, trained in segments:
            ids = _encode(tokenizer, text)
            r += ids
            lab += ids if trained else [-100] * len(ids)
        seqs.append(p + r + [tokenizer.eos_token_id])
        labs.append([-100] * len(p) + lab + [tokenizer.eos_token_id])
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labs, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, : len(lab)] = torch.tensor(lab)
    return ids, labels


def _loss_sum(model, ids: torch.Tensor, labels: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Summed next-token cross-entropy over the labelled positions."""
    logits = model(input_ids=ids, attention_mask=(ids != pad_id).long()).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


@single_thread()
def supervised_warm_start(
    model, tokenizer, task, recipe: WarmStartRecipe, seed: int = 0, log_every: int = 0
) -> WarmStartResult:
    """Teacher-forced cross-entropy on the task's train demonstrations, in place, in float32."""
    if not hasattr(task, "demonstration"):
        raise ValueError(f"task {task.name!r} has no demonstrations; a warm start needs a synthetic task")
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < recipe.warmup:
            return (step + 1) / recipe.warmup
        frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    stream = task.stream("train", seed)
    t0, loss_v = time.perf_counter(), float("nan")
    for step in range(recipe.steps):
        exs = sorted(
            (next(stream) for _ in range(recipe.batch_size)), key=lambda e: len(task.demonstration(e))
        )
        micro = [
            demonstration_batch(tokenizer, task, exs[i : i + recipe.micro_batch])
            for i in range(0, len(exs), recipe.micro_batch)
        ]
        n_tok = sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro)
        opt.zero_grad(set_to_none=True)
        loss_v = 0.0
        for ids, labels in micro:  # token mean over the whole batch
            loss = _loss_sum(model, ids, labels, tokenizer.pad_token_id)
            (loss / n_tok).backward()
            loss_v += float(loss.detach()) / n_tok
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == recipe.steps - 1):
            elapsed = time.perf_counter() - t0
            print(f"[warm-start] step {step} loss {loss_v:.4f} ({elapsed:.1f}s)", file=sys.stderr)
    model.eval()
    return WarmStartResult(recipe.steps, loss_v, time.perf_counter() - t0)


@torch.no_grad()
@single_thread()
def sample_responses(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
) -> list[str]:
    """Sampled continuations (plain ancestral sampling: no top-k/top-p), decoded up to the first EOS."""
    model.eval()
    torch.manual_seed(seed)
    out: list[str] = []
    for b in range(0, len(prompts), batch_size):
        enc = [_encode(tokenizer, p) for p in prompts[b : b + batch_size]]
        width = max(map(len, enc))
        ids = torch.full((len(enc), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(enc):  # left padding, so every row continues at the same column
            ids[i, width - len(e) :] = torch.tensor(e)
            mask[i, width - len(e) :] = 1
        kw: dict[str, Any] = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        if temperature == 0:
            kw = dict(do_sample=False)
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **kw,
        )
        for row in gen[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            out.append(tokenizer.decode(row, skip_special_tokens=True))
    return out


def evaluate_reward(
    model,
    tokenizer,
    task,
    examples: list[Example],
    *,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    seed: int = 0,
) -> float:
    """Mean task reward of one sampled response per example."""
    if max_new_tokens is None:
        max_new_tokens = getattr(task, "max_response_chars", 256) + 8
    resp = sample_responses(
        model, tokenizer, [e.prompt for e in examples], max_new_tokens=max_new_tokens, temperature=temperature,
        seed=seed,
    )  # fmt: skip
    return sum(task.reward(e.prompt, r, e.label) for e, r in zip(examples, resp, strict=True)) / len(examples)


def weights_digest(model) -> str:
    """Hash of every parameter's bytes: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def recipe_fingerprint(task_name: str) -> str:
    """Hash of what a warm start on `task_name` depends on besides the spec (the task's settings and the
    recipe): a model cache keyed by spec alone would keep serving a model made by an older recipe."""
    blob = f"{WARM_START_VERSION}|{get_task(task_name)!r}|{RECIPES.get(task_name, WarmStartRecipe())!r}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(model, tokenizer, spec) -> Any:
    """Hook of `make_tiny_model`: warm-start `model` on `spec.task` with that task's recipe and `spec.seed`."""
    from rollverify.app.console import say, stage

    task = get_task(spec.task)
    recipe = RECIPES.get(spec.task, WarmStartRecipe())
    say(f"warm start: training the tiny model on {spec.task} ({recipe.steps} steps; once, then it is cached) ...")
    with stage("warm start") as st:
        res = supervised_warm_start(model, tokenizer, task, recipe, seed=spec.seed)
        st.detail = f"{spec.task}, {res.steps} steps, final loss {res.final_loss:.3f}"
    return model
