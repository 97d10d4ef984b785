"""The tiny model's warm start, measured: sampled reward of the untrained and the warm-started model on a task's
eval split (for tuning `rollverify.app.warm_start.RECIPES` and for reports).

    python tools/experiments/warm_start_report.py --task countdown --seed 0 [--steps N --lr X --hidden H ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from rollverify.app.tiny_model import TinyModelSpec, build_tokenizer, untrained_model
from rollverify.app.warm_start import (
    RECIPES,
    WarmStartRecipe,
    evaluate_reward,
    supervised_warm_start,
    weights_digest,
)
from rollverify.tasks import get_task


def cli_main(argv: list[str] | None = None) -> int:
    """Measure base vs warm-started sampled reward on the eval split (for tuning recipes and reports)."""
    p = argparse.ArgumentParser(prog="python tools/experiments/warm_start_report.py", description=cli_main.__doc__)
    p.add_argument("--task", default="countdown")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--eval-n", type=int, default=256)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    a = p.parse_args(argv)
    spec = TinyModelSpec(task=a.task, seed=a.seed)
    if a.hidden:
        spec = replace(spec, hidden_size=a.hidden, head_dim=a.hidden // spec.num_heads)
    if a.layers:
        spec = replace(spec, num_layers=a.layers)
    if a.intermediate:
        spec = replace(spec, intermediate_size=a.intermediate)
    recipe = RECIPES.get(a.task, WarmStartRecipe())
    over = {k: v for k, v in dict(steps=a.steps, lr=a.lr, batch_size=a.batch_size).items() if v is not None}
    recipe = replace(recipe, **over)
    task, tok = get_task(a.task), build_tokenizer(spec.vocab_size)
    model = untrained_model(spec)
    evals = task.examples("eval", a.eval_n, seed=0)
    t = time.perf_counter()
    base = evaluate_reward(model, tok, task, evals, seed=1)
    print(f"base reward (T=1, {len(evals)} eval prompts): {base:.3f} ({time.perf_counter() - t:.1f}s)")
    res = supervised_warm_start(model, tok, task, recipe, seed=a.seed, log_every=50)
    print(f"warm start: {recipe} -> loss {res.final_loss:.4f} in {res.seconds:.1f}s")
    for temp in (1.0, 0.0):
        t = time.perf_counter()
        r = evaluate_reward(model, tok, task, evals, seed=1, temperature=temp)
        print(f"warm reward (T={temp:g}): {r:.3f} ({time.perf_counter() - t:.1f}s)")
    print(f"weights digest {weights_digest(model)}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
