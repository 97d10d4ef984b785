"""`rollverify` command line: one entry point; each subcommand is one `COMMANDS` entry, implemented in the module
that owns it and imported only when it runs (so `rollverify --help` answers at once)."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from dataclasses import dataclass

USAGE = "usage: rollverify [--version] [--help] COMMAND [options]"
EPILOG = """\
Run `rollverify COMMAND --help` for a command's options. Examples:
  rollverify demo                                          # on-policy vs RollVerify on the tiny CPU default
  rollverify train --config tiny_cpu --out runs/rv algo.mode=partial seed=1
  rollverify train --config tiny_cpu --out runs/rv --resume runs/rv trainer.steps=80
Shipped configs (pass the name or a YAML path): tiny_cpu, qwen3_8b_base, qwen3_30b_a3b_base."""


@dataclass(frozen=True)
class Command:
    """One subcommand: `run(argv)` returns the exit status; `help` is its line in `rollverify --help`."""

    run: Callable[[list[str]], int]
    help: str


def _make_tiny_model(argv: list[str]) -> int:
    from rollverify.app.tiny_model import TinyModelSpec, make_tiny_model

    p = argparse.ArgumentParser(
        prog="rollverify make-tiny-model",
        description="Write a tiny Qwen3 (or Qwen3-MoE) model and its tokenizer in Hugging Face format, made "
        "offline from a seed: the same options give the same files. `rollverify train` and the tests make and "
        "cache these themselves; use this to get one as a folder (e.g. for `rollverify serve`).",
    )
    p.add_argument("--out", required=True, help="folder to write: new, empty, or an earlier tiny model")
    p.add_argument("--moe", action="store_true", help="Qwen3-MoE (8 experts, top-2) instead of dense Qwen3")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    p.add_argument("--tied", action="store_true", help="tie the input and output embeddings")
    p.add_argument(
        "--task", default=None, help="warm-start it on this synthetic task first (countdown: about a minute)"
    )
    p.add_argument("--force", action="store_true", help="rewrite a tiny model already in --out")
    a = p.parse_args(argv)
    spec = TinyModelSpec(moe=a.moe, seed=a.seed, tie_word_embeddings=a.tied, task=a.task)
    try:
        if a.task is not None:
            from rollverify.tasks import synthetic_task_names

            if a.task not in synthetic_task_names():
                raise ValueError(
                    f"--task {a.task!r}: not a synthetic task; choose one of {', '.join(synthetic_task_names())}"
                )
        out = make_tiny_model(a.out, spec, force=a.force)
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"tiny {'Qwen3-MoE' if a.moe else 'Qwen3'} model ({spec.digest()}) at {out}")
    return 0


def _serve(argv: list[str]) -> int:
    from sglang_ext.server import cli_main

    return cli_main(argv)


def _train(argv: list[str]) -> int:
    from rollverify.app.train import cli_main

    return cli_main(argv)


def _demo(argv: list[str]) -> int:
    from rollverify.app.demo import cli_main

    return cli_main(argv)


def _eval(argv: list[str]) -> int:
    from rollverify.app.evaluate import cli_main

    return cli_main(argv)


def _export(argv: list[str]) -> int:
    from rollverify.app.export import cli_main

    return cli_main(argv)


def _simulate(argv: list[str]) -> int:
    from rollverify.sim.run import cli_main

    return cli_main(argv)


def _plan(argv: list[str]) -> int:
    from rollverify.app.plan import cli_main

    return cli_main(argv)


COMMANDS: dict[str, Command] = {
    "demo": Command(_demo, "on-policy GRPO vs RollVerify side by side on the tiny CPU model (what `make demo` runs)"),
    "train": Command(_train, "run RL training from a config into a run folder (new, --resume or --overwrite)"),
    "eval": Command(_eval, "evaluate a Hugging Face checkpoint on the config's eval sets (avg@k, pass@k per set)"),
    "export": Command(_export, "write a run's checkpoint as a Hugging Face model folder"),
    "serve": Command(_serve, "start one SGLang rollout server with RollVerify's control channel"),
    "plan": Command(_plan, "dry run: where each trainer rank and server goes and its memory per GPU; no GPU needed"),
    "simulate": Command(_simulate, "GPU-days of on_policy, partial, rollverify per context limit: the real loop, modelled GPUs"),
    "make-tiny-model": Command(_make_tiny_model, "write a tiny Qwen3 / Qwen3-MoE model folder, made offline"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    from rollverify import __version__

    try:
        installed = dist_version("rollverify")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return __version__
    return installed


def help_text() -> str:
    width = max(map(len, COMMANDS))
    lines = [USAGE, "", "RollVerify: RL of LLMs with verified partial rollout (SGLang + Megatron-Core).", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {cmd.help}" for name, cmd in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help  show this help", "  --version   print the version", "", EPILOG]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(help_text(), file=sys.stderr)
        return 2
    first = argv[0]
    if first in ("-h", "--help", "help"):
        print(help_text())
        return 0
    if first in ("-V", "--version"):
        print(f"rollverify {version()}")
        return 0
    if first not in COMMANDS:
        close = difflib.get_close_matches(first, list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        what = "option" if first.startswith("-") else "command"
        print(
            f"{USAGE}\nrollverify: error: unknown {what} {first!r}{hint}; commands: {', '.join(COMMANDS)} "
            "(see `rollverify --help`)",
            file=sys.stderr,
        )
        return 2
    return COMMANDS[first].run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
