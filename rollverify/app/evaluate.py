"""Evaluation: k samples per prompt on named sets, avg@k and pass@k per set; `rollverify eval` for a checkpoint.

The sets are `eval.sets` (benchmark files in the project's layout, e.g. AIME24, AIME25, AMC23, MATH500 made by
tools/prepare_data.py) or, without any, the task's held-out split (`heldout`, `eval.n_prompts` prompts). Each
prompt is rendered as in training (chat template), sampled `eval.n_samples` = k times at `eval.temperature`, and
every response scored by the run's reward. Per set:

- ``eval/<set>/avg@k``: the mean reward over all k x prompts responses;
- ``eval/<set>/pass@k``: the share of prompts with at least one response whose reward is >= `eval.solved_at`;

and ``eval_reward`` is the mean of the sets' avg@k, ``eval_reward_se`` its standard error over prompts (each
set's per-prompt mean rewards: std / sqrt(prompts); prompts are the independent draws, a prompt's k samples are
not). ``eval_reward +- 1.96 eval_reward_se`` is its 95 % interval (`format_interval`). During training these go into metrics.jsonl, TensorBoard
and the plots; `rollverify eval --model PATH --config FILE` prints them (and writes them with ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rollverify.interfaces import SamplingParams
from rollverify.tasks.base import Example
from rollverify.tasks.sets import HELDOUT, EvalSet, load_eval_sets, parse_eval_sets


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c solved (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def standard_error(scores: np.ndarray) -> float:
    """Standard error of the mean reward of one set, shape [prompts, k], over its prompts (NaN for one prompt)."""
    per_prompt = np.asarray(scores, dtype=np.float64).mean(axis=1)
    if per_prompt.size < 2:
        return float("nan")
    return float(per_prompt.std(ddof=1) / np.sqrt(per_prompt.size))


def format_interval(mean: float, se: float, z: float = 1.96) -> str:
    """``0.412 +- 0.018 [0.377, 0.447]``: the mean, z standard errors and the interval they span."""
    if not np.isfinite(se):
        return f"{mean:.3f}"
    return f"{mean:.3f} +- {z * se:.3f} [{mean - z * se:.3f}, {mean + z * se:.3f}]"


def set_metrics(scores: np.ndarray, solved_at: float) -> dict[str, float]:
    """avg@k and pass@k of one set from its rewards, shape [prompts, k]."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.size == 0:
        raise ValueError(f"scores must be [prompts, k] and non-empty, got shape {scores.shape}")
    k = scores.shape[1]
    solved = (scores >= solved_at).sum(axis=1)
    return {
        f"avg@{k}": float(scores.mean()),
        f"pass@{k}": float(np.mean([pass_at_k(k, int(c), k) for c in solved])),
    }


class Evaluator:
    """Samples and scores the eval sets on an engine; `run` returns the metrics named in the module docstring.

    `render` gives a prompt's token ids (`PromptRenderer.ids`), `decode` a response's text, `score` its reward
    as ``score(prompt, response, label)``.
    """

    def __init__(
        self,
        sets: Sequence[EvalSet],
        *,
        render: Callable[[Example], list[int]],
        decode: Callable[[list[int]], str],
        score: Callable[[str, str, str], float],
        n_samples: int,
        temperature: float,
        max_new_tokens: int,
        solved_at: float = 1.0,
        tools: Any = None,
    ) -> None:
        if not sets or any(not s.examples for s in sets):
            raise ValueError("evaluation needs at least one set, each with at least one prompt")
        self.sets = list(sets)
        self.render, self.decode, self.score = render, decode, score
        self.k, self.temperature, self.max_new_tokens = n_samples, temperature, max_new_tokens
        self.solved_at = solved_at
        self.tools = tools  # a multi-turn task's ToolTurns: each response generated turn by turn with its calls
        self._ids = [[np.asarray(render(x), np.int32) for x in s.examples] for s in self.sets]

    @property
    def n_responses(self) -> int:
        return self.k * sum(len(s.examples) for s in self.sets)

    def run(self, engine: Any, tag: str = "eval") -> dict[str, float]:
        """One batch over every set (k copies of each prompt), then the per-set metrics and `eval_reward`."""
        prompts = [ids for set_ids in self._ids for ids in set_ids for _ in range(self.k)]
        sampling = SamplingParams(temperature=self.temperature)
        if self.tools is not None:
            outs = self.tools.generate(engine.generate, prompts, self.max_new_tokens, sampling, tag)
        else:
            outs = engine.generate(prompts, self.max_new_tokens, sampling, tag=tag)
        metrics: dict[str, float] = {}
        ses = []
        i = 0
        for s in self.sets:
            scores = np.empty((len(s.examples), self.k), np.float64)
            for p, x in enumerate(s.examples):
                for j in range(self.k):
                    scores[p, j] = self.score(x.prompt, self.decode(outs[i].tolist()), x.label)
                    i += 1
            metrics.update({f"eval/{s.name}/{key}": v for key, v in set_metrics(scores, self.solved_at).items()})
            ses.append(standard_error(scores))
        avgs = [v for key, v in metrics.items() if key.endswith(f"/avg@{self.k}")]
        metrics["eval_reward"] = float(np.mean(avgs))
        metrics["eval_reward_se"] = float(np.sqrt(np.sum(np.square(ses))) / len(ses))  # the sets are independent
        return metrics

    def not_run(self) -> dict[str, float]:
        """The keys `run` writes, each NaN: a step that does not evaluate logs them null (rollverify.metrics)."""
        keys = [f"eval/{s.name}/{m}@{self.k}" for s in self.sets for m in ("avg", "pass")]
        return {k: float("nan") for k in (*keys, "eval_reward", "eval_reward_se")}


def build_evaluator(cfg: Any, task: Any, tokenizer: Any, score: Callable[[str, str, str], float],
                    tools: Any = None) -> Evaluator:
    """The evaluator of a run config (`RunConfig`) for this task, tokenizer and reward (`tools`: the run's
    ToolTurns, for a multi-turn task)."""
    from rollverify.tasks.chat import PromptRenderer

    e = cfg.eval
    sets = load_eval_sets(parse_eval_sets(e.sets))
    if not sets:
        sets = [EvalSet(HELDOUT, task.examples("eval", e.n_prompts, seed=cfg.seed))]
    renderer = PromptRenderer(tokenizer, getattr(task, "chat_template", "auto"),
                              tools=tools.schemas() if tools is not None else None)
    return Evaluator(
        sets,
        render=renderer.ids,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        score=score,
        n_samples=e.n_samples,
        temperature=e.temperature,
        max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
        solved_at=e.solved_at,
        tools=tools,
    )


def format_table(metrics: dict[str, float]) -> str:
    """One line per set: its avg@k and pass@k."""
    rows: dict[str, dict[str, float]] = {}
    for key, v in metrics.items():
        if key.startswith("eval/"):
            _, name, stat = key.split("/", 2)
            rows.setdefault(name, {})[stat] = v
    width = max([len(n) for n in rows] + [3])
    lines = []
    for name, stats in rows.items():
        lines.append(f"{name:<{width}}  " + "  ".join(f"{k} {v:.4f}" for k, v in stats.items()))
    return "\n".join(lines)


# --- rollverify eval --------------------------------------------------------------------------------------


def evaluate_checkpoint(cfg: Any, model: str | Path, out: str | Path | None = None) -> dict[str, float]:
    """Evaluate the HF checkpoint folder `model` with `cfg`'s task, reward and eval settings, on servers
    launched for it (or on `servers.endpoints`, which first receive its weights)."""
    from transformers import AutoTokenizer

    from rollverify.app.export import hf_weight_buckets
    from rollverify.app.start import build_tool_turns, start_engine
    from rollverify.tasks import get_task
    from rollverify.tasks.reward import task_reward

    model = Path(model)
    if out is not None and Path(out).exists():
        raise FileExistsError(f"--out {out} exists; give a new file name (results are never overwritten)")
    task = get_task(cfg.task.name, **cfg.task.options)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tools = build_tool_turns(cfg, task, tokenizer)
    evaluator = build_evaluator(cfg, task, tokenizer, task_reward(task, cfg.task.reward), tools)
    engine = start_engine(cfg, model, Path(tempfile.mkdtemp(prefix="rollverify-eval-")))  # server logs
    try:
        if cfg.servers.endpoints:
            engine.update_weights(hf_weight_buckets(model), 0)
        metrics = evaluator.run(engine, tag="eval")
    finally:
        engine.close(shutdown=not cfg.servers.endpoints)
        if tools is not None:
            tools.close()
    result = {"model": str(model), "n_samples": cfg.eval.n_samples, **metrics}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "x") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    return result


def cli_main(argv: list[str] | None = None) -> int:
    from rollverify.app.config import load_config

    p = argparse.ArgumentParser(
        prog="rollverify eval",
        description="Evaluate a Hugging Face checkpoint (e.g. RUN/hf/step_N) on the config's eval sets: "
        "avg@k and pass@k per set, k = eval.n_samples.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors, tokenizer)")
    p.add_argument("--config", required=True, help="YAML config or a shipped config's name; its task, eval "
                   "and rollout sections are used")
    p.add_argument("--out", default=None, help="write the results as JSON to this new file")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.n_samples=8")
    a = p.parse_args(argv)
    try:
        # --model replaces the config's model, the tiny model's settings included
        model = [f"model.path={json.dumps(a.model)}", "model.moe=false", "model.tiny_overrides={}"]
        cfg = load_config(a.config, [*a.overrides, *model])
        cfg.check_paths()
        if a.out is not None and Path(a.out).exists():
            raise FileExistsError(f"--out {a.out} exists; give a new file name (results are never overwritten)")
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = evaluate_checkpoint(cfg, a.model, a.out)
    print(format_table(result))
    print(f"eval_reward {format_interval(result['eval_reward'], result['eval_reward_se'])} (95 % interval over prompts)")
    return 0
