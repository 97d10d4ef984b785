"""`rollverify` command line: one entry point, each subcommand implemented in the module that owns it."""

from __future__ import annotations

import argparse
import sys


def _make_tiny_model(argv: list[str]) -> int:
    from rollverify.tiny_model import TinyModelSpec, make_tiny_model

    p = argparse.ArgumentParser(prog="rollverify make-tiny-model", description=__doc__)
    p.add_argument("--out", required=True, help="folder to write (new, empty, or an earlier tiny model)")
    p.add_argument("--moe", action="store_true", help="Qwen3-MoE (8 experts, top-2) instead of dense Qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    p.add_argument("--task", default=None, help="supervised warm start on this synthetic task")
    p.add_argument("--force", action="store_true", help="rewrite an existing tiny model")
    a = p.parse_args(argv)
    spec = TinyModelSpec(moe=a.moe, seed=a.seed, tie_word_embeddings=a.tied, task=a.task)
    try:
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
    from rollverify.train import cli_main

    return cli_main(argv)


def _demo(argv: list[str]) -> int:
    from rollverify.demo import cli_main

    return cli_main(argv)


COMMANDS = {
    "make-tiny-model": _make_tiny_model,
    "serve": _serve,
    "train": _train,
    "demo": _demo,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: rollverify {" + ",".join(COMMANDS) + "} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
