"""Deterministic tiny Qwen3 / Qwen3-MoE checkpoints in Hugging Face format, made offline.

The CPU default of the project (tests, demo) runs on these: real architectures (GQA, qk-norm, SwiGLU, MoE
router and experts) at a size two CPU cores serve and train in seconds. The same spec and seed give
byte-identical files, so one cached copy serves every test session and the demo.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import string
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

MARKER = "rollverify_model.json"

# Character-level vocabulary: every id decodes to exactly one token, so any id the model samples is printable.
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list(string.digits + string.ascii_letters + string.punctuation + " \n")
# The Qwen3 chat template's tool-call tags, one token each as in Qwen3's own vocabulary (after the characters, so
# no other id moves): generation stops at the `</tool_call>` token (rollverify.tool_turns).
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_VERSION = 2  # in the cache key: a model folder holds its tokenizer (2: the tool tokens)


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture of a tiny model; its hash names the cache entry."""

    moe: bool = False
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 64
    seed: int = 0
    task: str | None = None  # the synthetic task it is warm-started on (None: left as initialised)
    extra: dict = field(default_factory=dict)

    def digest(self) -> str:
        """Names the cache entry; a warm-started model also hashes its recipe, so a new recipe remakes it."""
        blob = json.dumps(asdict(self), sort_keys=True) + f"|vocab{VOCAB_VERSION}"
        if self.task is not None:
            from rollverify.app.warm_start import recipe_fingerprint

            blob += recipe_fingerprint(self.task)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def vocabulary(vocab_size: int) -> list[str]:
    """Special tokens, printable characters, then reserved fillers up to `vocab_size`."""
    base = SPECIAL_TOKENS + CHARS + TOOL_TOKENS
    if vocab_size < len(base):
        raise ValueError(f"vocab_size must be >= {len(base)} (special tokens + characters), got {vocab_size}")
    return base + [f"<|reserved_{i}|>" for i in range(vocab_size - len(base))]


def build_tokenizer(vocab_size: int):
    """A character-level fast tokenizer whose vocabulary is exactly the model's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([t for t in vocab if t.startswith("<|")])
    tok.add_tokens(TOOL_TOKENS)  # whole tokens that decode as text, like Qwen3's
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token="<|endoftext|>",
        model_max_length=1 << 20,
    )


def hf_config(spec: TinyModelSpec):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|pad|>"),
        torch_dtype="float32",
        attention_bias=False,
    )
    if spec.moe:
        return Qwen3MoeConfig(
            intermediate_size=spec.intermediate_size,
            moe_intermediate_size=spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
            **common,
        )
    return Qwen3Config(intermediate_size=spec.intermediate_size, **common)


def untrained_model(spec: TinyModelSpec):
    """The HF model of `spec` (float32) with its seeded init, before any warm start: what `make_tiny_model`
    saves when `spec.task` is None, and what the warm start trains otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32)
    # A wider init than HF's 0.02 so the untrained model's distribution is not uniform: sampled outputs and
    # routing decisions then differ by token, which the parity tests need.
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for _name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
    return model


@contextlib.contextmanager
def _no_progress_bars():
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def is_tiny_model(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def make_tiny_model(out: str | os.PathLike, spec: TinyModelSpec, force: bool = False) -> Path:
    """Write the model, tokenizer and a marker into `out`; refuse to overwrite anything else."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        if not is_tiny_model(out):
            raise FileExistsError(
                f"{out} is not empty and is not a RollVerify tiny model (no {MARKER}); "
                "nothing was written: pass an empty or new folder"
            )
        marker = json.loads((out / MARKER).read_text())
        if marker.get("digest") == spec.digest() and not force:
            return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        model = untrained_model(spec)
        if spec.task is not None:
            from rollverify.app.warm_start import warm_start  # supervised warm start on a synthetic task

            model = warm_start(model, build_tokenizer(spec.vocab_size), spec)
        with _no_progress_bars():  # a one-shard bar ("Writing model shards") says nothing
            model.save_pretrained(tmp, safe_serialization=True)
        build_tokenizer(spec.vocab_size).save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def cache_root() -> Path:
    """The project's cache (tiny models): $ROLLVERIFY_CACHE, else rollverify/ in the user's cache folder
    ($XDG_CACHE_HOME, else ~/.cache). One copy serves every checkout, installed copy, test session and demo."""
    env = os.environ.get("ROLLVERIFY_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rollverify"


def ensure_tiny_model(spec: TinyModelSpec | None = None, **overrides) -> Path:
    """The cached model for `spec` (made on first use); concurrent callers are serialised by a lock file."""
    import fcntl

    spec = spec or TinyModelSpec(**overrides)
    root = cache_root() / "models"
    root.mkdir(parents=True, exist_ok=True)
    name = f"{'qwen3moe' if spec.moe else 'qwen3'}-{spec.task or 'base'}-{spec.digest()}"
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return make_tiny_model(root / name, spec)


def cli_main(argv: list[str] | None = None) -> int:
    """`rollverify make-tiny-model`."""
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
