"""Run Megatron-Core 0.16.1 on CPU (world size 1 or 2 over gloo) without editing site-packages.

Megatron-Core assumes a GPU in a handful of places: it asks `torch.cuda.current_device()` where to allocate,
builds tensors with a literal `device="cuda"`, opens CUDA streams in the MoE all-to-all dispatcher and the DDP
buffers, keeps its tensor-parallel RNG streams as CUDA generator states, and asserts parameter types such as
`'torch.cuda.FloatTensor'` in the optimizer and gradient clipping. `activate()` routes around each of these, and
only these, so the project's one code path (the trainer) runs unchanged on a laptop:

* every loaded `megatron.core.*` module sees, under its global name `torch`, a proxy of the real torch whose
  tensor factories map a CUDA device to the CPU and whose `torch.cuda` answers `current_device()` with `"cpu"`
  and makes streams, events, synchronisation and cache release no-ops; the real `torch` is not changed, so the
  rest of the process (SGLang in the same interpreter, tests) is unaffected;
* the RNG tracker's CUDA state get/set functions use the CPU generator (`model_parallel_cuda_manual_seed` then
  works as is and seeds the tracker from CPU generators);
* the optimizer and clip functions that assert CUDA type names run with `Tensor.type()` reporting CUDA names for
  CPU tensors, and the tied-embedding setup under PP with `Tensor.cuda()` as the identity, for the duration of
  those calls only;
* the MoE all-to-all dispatcher gets its split sizes as numpy arrays (as its CUDA path does after the
  device-to-host copy), since `all_to_all_single` rejects tensor split sizes;
* the fully parallel checkpoint load (`FullyParallelLoadStrategyWrapper`, whose exchange allocates on CUDA and
  moves loaded shards there to broadcast them) runs with `Tensor.cuda()` as the identity and
  `ShardedTensor.init_data` on the CPU, for the duration of the load only: gloo broadcasts the CPU tensors.

`patch_missing_te()` is separate because it also applies on GPUs without TransformerEngine: 0.16.1 references
`moe_utils.te_general_gemm` without defining it when TE is absent, and without TE or apex the distributed
optimizer runs torch's Adam, whose per-parameter `step` state the `fully_reshardable` checkpoint format leaves out
(load restores it from the param groups as one tensor shared by all parameters, then fails copying the tensors'
`step` that is not there).

Models must be built with `use_cpu_initialization=True` and called with an explicit attention mask (the default
causal mask is built on CUDA); `megatron_bridge.model` does both.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

_ACTIVE = False
_ORIGINALS: list[tuple[Any, str, Any]] = []  # (owner, attribute, original value) for deactivate()

# Modules imported before patching so that their global `torch` is swapped: everything the trainer touches.
_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
)

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _to_cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


class _NullStream:
    """Stands in for `torch.cuda.Stream`/`Event`: CPU work is already ordered."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def record_event(self, *args) -> _NullStream:
        return self

    def record(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0


_NULL_STREAM = _NullStream()


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as Megatron-Core's modules see it on CPU; anything not overridden is the real one."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.Stream = _NullStream
        self.Event = _NullStream
        self.current_device = lambda: "cpu"
        self.current_stream = lambda *a, **k: _NULL_STREAM
        self.default_stream = lambda *a, **k: _NULL_STREAM
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.synchronize = lambda *a, **k: None
        self.empty_cache = lambda: None
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = lambda seed: torch.manual_seed(seed)
        self.nvtx = types.SimpleNamespace(range_push=lambda *a: None, range_pop=lambda: None,
                                          range=lambda *a, **k: contextlib.nullcontext())
        self.random = types.SimpleNamespace(get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "as_tensor",
              "zeros_like", "ones_like", "empty_like", "full_like")


class _CpuTorch(types.ModuleType):
    """`torch` as Megatron-Core's modules see it on CPU: CUDA devices in factories become the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """Make `Tensor.type()` (no arguments) report CUDA type names for CPU float tensors, for this block only."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs or self.device.type != "cpu" or self.dtype not in _CUDA_TYPE_NAMES:
            return original(self, *args, **kwargs)
        return _CUDA_TYPE_NAMES[self.dtype]

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def tensor_cuda_is_identity() -> Iterator[None]:
    """Make `Tensor.cuda()` return the tensor itself, for this block only (CPU has nowhere to move it)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


@contextlib.contextmanager
def sharded_tensors_on_cpu() -> Iterator[None]:
    """Make `ShardedTensor.init_data` allocate on the CPU whatever device it is asked for, for this block only."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    original = ShardedTensor.init_data

    def init_data(self, device, init_fn=torch.empty):
        return original(self, _to_cpu_device(device), init_fn)

    ShardedTensor.init_data = init_data
    try:
        yield
    finally:
        ShardedTensor.init_data = original


@contextlib.contextmanager
def _cpu_exchange() -> Iterator[None]:
    with tensor_cuda_is_identity(), sharded_tensors_on_cpu():
        yield


def _with_context(fn: Callable, context: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    return wrapper


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_type_names():
            return fn(*args, **kwargs)

    wrapper.__rollverify_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _set(owner: Any, name: str, value: Any) -> None:
    _ORIGINALS.append((owner, name, owner.__dict__.get(name, getattr(owner, name, None))))
    setattr(owner, name, value)


def patch_missing_te() -> None:
    """Define `moe_utils.te_general_gemm = None` when TE is absent (0.16.1 raises NameError otherwise); let the
    distributed optimizer's checkpoint load keep torch Adam's `step` (see the module docstring). Idempotent."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    cls = distrib.DistributedOptimizer
    if not distrib.HAVE_APEX_OR_TE and not hasattr(cls._set_main_param_and_optimizer_states, "__rollverify__"):
        cls._set_main_param_and_optimizer_states = _keep_torch_adam_step(cls._set_main_param_and_optimizer_states)


def _keep_torch_adam_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" not in tensors and "step" in state:
            # restored from the param groups as ONE tensor shared by every parameter, which torch's Adam would
            # then increment once per parameter each step: each parameter gets its own copy
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    set_states.__rollverify__ = True  # type: ignore[attr-defined]
    return set_states


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _numpy_splits(original: Callable) -> Callable:
    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def needed(device: str | torch.device | None = None) -> bool:
    """True when Megatron-Core will run without a GPU: the caller asked for the CPU, or the run configured none
    (`rollverify.devices.DEVICE_ENV`), or, where the run says nothing, no CUDA device is visible. A run that
    configured GPUs never gets the CPU routes (`megatron_bridge.trainer.resolve_device` stops first)."""
    from rollverify.devices import configured_device

    if device is not None:
        return torch.device(device).type == "cpu"
    configured = configured_device()
    if configured is not None:
        return configured == "cpu"
    return not torch.cuda.is_available()


def is_active() -> bool:
    return _ACTIVE


def activate() -> None:
    """Apply the CPU routes described in the module docstring (idempotent); call before building a model."""
    global _ACTIVE
    patch_missing_te()
    if _ACTIVE:
        return
    for name in _MODULES:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None and module.__dict__.get("torch") is torch:
            _set(module, "torch", _CPU_TORCH)

    random = sys.modules["megatron.core.tensor_parallel.random"]
    _set(random, "_get_cuda_rng_state", _cpu_get_rng_state)
    _set(random, "_set_cuda_rng_state", _cpu_set_rng_state)

    dispatcher = sys.modules["megatron.core.transformer.moe.token_dispatcher"]
    _set(dispatcher, "maybe_move_tensor_to_cpu", _numpy_splits(dispatcher.maybe_move_tensor_to_cpu))

    # tied embeddings under PP: the last stage's copy is moved with `.cuda()` before the first all-reduce
    lm = sys.modules["megatron.core.models.common.language_module.language_module"].LanguageModule
    _set(lm, "setup_embeddings_and_output_layer",
         _with_context(lm.setup_embeddings_and_output_layer, tensor_cuda_is_identity))

    distrib = sys.modules["megatron.core.optimizer.distrib_optimizer"]
    cls = distrib.DistributedOptimizer
    _set(cls, "__init__", _with_cuda_type_names(cls.__init__))
    # the optimizer state of a distributed checkpoint is gathered over DP with `.cuda()` copies first
    _set(cls, "get_parameter_state_dp_zero", _with_context(cls.get_parameter_state_dp_zero, tensor_cuda_is_identity))
    _set(cls, "_build_model_and_main_param_groups",
         staticmethod(_with_cuda_type_names(cls._build_model_and_main_param_groups)))
    parallel_load = sys.modules["megatron.core.dist_checkpointing.strategies.fully_parallel"]
    wrapper = parallel_load.FullyParallelLoadStrategyWrapper
    _set(wrapper, "load", _with_context(wrapper.load, _cpu_exchange))
    optimizer = sys.modules["megatron.core.optimizer.optimizer"]
    _set(optimizer.Float16OptimizerWithFloat16Params, "__init__",
         _with_cuda_type_names(optimizer.Float16OptimizerWithFloat16Params.__init__))
    clip = sys.modules["megatron.core.optimizer.clip_grads"]
    wrapped_clip = _with_cuda_type_names(clip.clip_grad_by_total_norm_fp32)
    for module in (clip, optimizer):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            _set(module, "clip_grad_by_total_norm_fp32", wrapped_clip)
    _ACTIVE = True


def deactivate() -> None:
    """Undo `activate()` (tests use it to show that the routes are what makes CPU runs work)."""
    global _ACTIVE
    while _ORIGINALS:
        owner, name, value = _ORIGINALS.pop()
        setattr(owner, name, value)
    _ACTIVE = False
