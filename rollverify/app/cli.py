"""`rollverify` command line: one entry point; each subcommand is one `COMMANDS` entry, implemented in the module
that owns it and imported only when it runs (so `rollverify --help` answers at once)."""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass

USAGE = "usage: rollverify [--version] [--help] COMMAND [options]"
EXAMPLES = """\
Run `rollverify COMMAND --help` for a command's options. Examples:
  rollverify demo                                          # on-policy vs RollVerify on the tiny CPU default
  rollverify train --config tiny_cpu --out runs/rv algo.mode=partial seed=1
  rollverify train --config tiny_cpu --out runs/rv --resume runs/rv trainer.steps=80"""


@dataclass(frozen=True)
class Command:
    """One subcommand: `module`'s `cli_main(argv)`, imported when it runs, returns the exit status; `help` is its
    line in `rollverify --help`."""

    module: str
    help: str

    def run(self, argv: list[str]) -> int:
        return importlib.import_module(self.module).cli_main(argv)


COMMANDS: dict[str, Command] = {
    "demo": Command("rollverify.app.demo", "on-policy GRPO vs RollVerify side by side on the tiny CPU model (what "
                    "`make demo` runs)"),
    "train": Command("rollverify.app.train", "run RL training from a config into a run folder (new, --resume or "
                     "--overwrite)"),
    "eval": Command("rollverify.app.evaluate", "evaluate a Hugging Face checkpoint on the config's eval sets (avg@k, "
                    "pass@k per set)"),
    "export": Command("rollverify.app.export", "write a run's checkpoint as a Hugging Face model folder"),
    "serve": Command("sglang_ext.server", "start one SGLang rollout server with RollVerify's control channel"),
    "plan": Command("rollverify.app.plan", "dry run: where each trainer rank and server goes and its memory per GPU; "
                    "no GPU needed"),
    "simulate": Command("rollverify.sim.run", "GPU-days of on_policy, partial, rollverify per context limit: the real "
                        "loop, modelled GPUs"),
    "make-tiny-model": Command("rollverify.app.tiny_model", "write a tiny Qwen3 / Qwen3-MoE model folder, made "
                               "offline"),
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
    from rollverify.app.presets import shipped_configs

    lines += ["", "options:", "  -h, --help  show this help", "  --version   print the version", "", EXAMPLES,
              f"Shipped configs (pass the name or a YAML path): {', '.join(shipped_configs())}."]
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
