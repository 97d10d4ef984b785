"""Wire format of the control channel: typed message bodies, raw array frames, error codes.

One request is a ZMQ multipart message `[header, *buffers]`; the header is UTF-8 JSON, the buffers are raw
little-endian array bytes described by the header, so token ids, log-probs, routed experts and weight tensors
never pass through JSON. Every body is a pydantic model with `extra="forbid"`, so a misspelled field is an error
reply that names it instead of a silently ignored option. `docs/protocol.md` is the human-readable spec.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollverify.types import ENV_VERSION as ENV_VERSION  # the wire's environment-token version is the core's

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 16 << 20
MAX_HEADER_DEPTH = 16  # nesting of JSON arrays and objects in a header (a submit needs 5)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # every JSON integer in a header
INT32_MAX = 2**31 - 1  # weights versions and token counts (they travel as int32 buffers)
# A token's policy version on the wire: >= 0 the version that sampled it; ENV_VERSION (the core's value,
# rollverify.types) an environment token (a tool's output the controller appended: log-prob NaN, no policy);
# UNKNOWN_VERSION a submitted prefix token whose version the client did not say.
UNKNOWN_VERSION = -1
MAX_ID_CHARS = 256  # a string request id
MAX_TYPE_CHARS = 64  # a message type (the longest known is far shorter); a reply echoes it whole or not at all
MAX_RID_CHARS = 512  # a response id
MAX_BUFFER_DIMS = 8
TOP_K_MAX = 1 << 30  # SGLang's own "no top-k" value; anything at or above the vocabulary size is no top-k
TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-3, 100.0  # besides 0 (greedy)
MAX_ITEMS = 1 << 16  # responses per submit, stop ids per sampling setting: 1 << 10
MAX_EVENTS = 1 << 16
MAX_BUCKET = 1 << 20
REPLY_ONLY_FIELDS = ("ok", "error")

# dtypes a buffer may declare; bfloat16 has no numpy type and is only accepted for weight tensors.
NUMPY_DTYPES = {
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
}
ITEMSIZE = {**{k: np.dtype(v).itemsize for k, v in NUMPY_DTYPES.items()}, "bfloat16": 2}


class ErrorCode:
    """Stable error codes: clients branch on these, messages are for people."""

    MALFORMED = "MALFORMED"  # frames or header unreadable, buffer sizes wrong
    PROTOCOL_VERSION = "PROTOCOL_VERSION"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    INVALID = "INVALID"  # body does not validate (field, range, dtype, shape)
    UNKNOWN_RESPONSE = "UNKNOWN_RESPONSE"
    DUPLICATE_RESPONSE = "DUPLICATE_RESPONSE"
    KEEP_OUT_OF_RANGE = "KEEP_OUT_OF_RANGE"
    RESPONSE_RUNNING = "RESPONSE_RUNNING"  # needs a paused (or finished) response
    ALREADY_PAUSED = "ALREADY_PAUSED"
    NOT_PAUSED = "NOT_PAUSED"
    BUSY = "BUSY"  # responses are generating; pause first
    VERSION_MISMATCH = "VERSION_MISMATCH"
    WEIGHT_INVALID = "WEIGHT_INVALID"  # unknown name, wrong shape or dtype: nothing applied
    WEIGHT_SEQUENCE = "WEIGHT_SEQUENCE"  # buckets out of order
    WEIGHTS_INCOMPLETE = "WEIGHTS_INCOMPLETE"  # a streamed version failed after loading began: send a whole one
    ENGINE_ERROR = "ENGINE_ERROR"
    SHUTTING_DOWN = "SHUTTING_DOWN"


class ProtocolError(Exception):
    """An error reply: `code` is one of ErrorCode, `message` says what was wrong and where."""

    def __init__(self, code: str, message: str, details: dict | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}
        self.req_id: int | str | None = None  # what a malformed request's reply can echo
        self.req_type: str | None = None


# ---------------------------------------------------------------------------------------------- frames


class BufferSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=MAX_RID_CHARS)
    dtype: str
    shape: list[int] = Field(max_length=MAX_BUFFER_DIMS)

    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


class Header(BaseModel):
    """Frame 0 of every message, both directions."""

    model_config = ConfigDict(extra="forbid")
    proto: int
    id: int | Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None  # JSON integers are int64
    type: Annotated[str, Field(max_length=MAX_TYPE_CHARS)] | None = None
    body: dict[str, Any] = Field(default_factory=dict)
    buffers: list[BufferSpec] = Field(default_factory=list)
    ok: bool | None = None  # replies only
    error: dict[str, Any] | None = None  # replies only


@dataclass
class Message:
    """A decoded message: header plus raw frames keyed by buffer name (decoded to arrays on demand)."""

    header: Header
    frames: dict[str, tuple[BufferSpec, memoryview]] = field(default_factory=dict)

    @property
    def body(self) -> dict[str, Any]:
        return self.header.body

    def has(self, name: str) -> bool:
        return name in self.frames

    def array(
        self, name: str, dtypes: Sequence[str], ndim: int | None = None, required: bool = True
    ) -> np.ndarray | None:
        """The buffer as a read-only numpy view; its declared dtype must be one of `dtypes`."""
        if name not in self.frames:
            if required:
                raise ProtocolError(ErrorCode.INVALID, f"missing buffer {name!r}")
            return None
        spec, raw = self.frames[name]
        if spec.dtype not in dtypes:
            raise ProtocolError(
                ErrorCode.INVALID, f"buffer {name!r} has dtype {spec.dtype}, expected one of {list(dtypes)}"
            )
        if ndim is not None and len(spec.shape) != ndim:
            raise ProtocolError(
                ErrorCode.INVALID, f"buffer {name!r} has shape {spec.shape}, expected {ndim} dimensions"
            )
        return np.frombuffer(raw, dtype=NUMPY_DTYPES[spec.dtype]).reshape(spec.shape)


def _as_frame(arr: np.ndarray) -> memoryview:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return memoryview(arr.reshape(-1).view(np.uint8))


def dtype_name(arr: np.ndarray) -> str:
    name = np.dtype(arr.dtype).name
    if name not in NUMPY_DTYPES:
        raise TypeError(f"arrays of dtype {name} cannot travel on the control channel")
    return name


def encode(header: Header, arrays: dict[str, np.ndarray] | None = None, raw: list | None = None) -> list:
    """Frames of one message. `arrays` are numpy buffers; `raw` are (BufferSpec, bytes-like) already encoded
    (weight tensors, whose dtype numpy may lack)."""
    frames: list = []
    specs: list[BufferSpec] = []
    for name, arr in (arrays or {}).items():
        specs.append(BufferSpec(name=name, dtype=dtype_name(arr), shape=list(arr.shape)))
        frames.append(_as_frame(arr))
    for spec, data in raw or []:
        specs.append(spec)
        frames.append(data)
    header = header.model_copy(update={"buffers": specs})
    text = header.model_dump_json(exclude_none=True)
    if header.id is None:  # replies always carry `id`, null when the request's could not be read
        text = '{"id":null,' + text[1:] if text != "{}" else '{"id":null}'
    return [text.encode(), *frames]


UNREADABLE = object()  # stands in for a number a header may not hold, so the rest (id, type) stays readable


class _Numbers:
    """JSON number hooks: int64 integers (Python itself refuses 4301+ digits), finite floats, no NaN/Infinity.
    The first offence is recorded and the value replaced by UNREADABLE."""

    def __init__(self) -> None:
        self.problem: str | None = None

    def _bad(self, what: str) -> object:
        self.problem = self.problem or what
        return UNREADABLE

    def int(self, s: str) -> Any:
        if len(s) > 20:
            return self._bad(f"an integer of {len(s)} characters (JSON integers must fit in int64)")
        v = int(s)
        return v if INT64_MIN <= v <= INT64_MAX else self._bad(f"integer {s} that does not fit in int64")

    def float(self, s: str) -> Any:
        v = float(s)
        return v if math.isfinite(v) else self._bad(f"number {s[:40]} that is not a finite float64")

    def constant(self, s: str) -> Any:
        return self._bad(f"{s}, which is not JSON")


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _nesting_depth(text: str) -> int:
    """Deepest nesting of arrays and objects, strings skipped (one vectorized pass)."""
    code = np.frombuffer(_JSON_STRING.sub("", text).encode(), np.uint8)
    step = (code == ord("[")).astype(np.int32) + (code == ord("{"))
    step -= (code == ord("]")).astype(np.int32) + (code == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def _bad_string(obj: Any) -> bool:
    """Whether any string (or key) is not valid Unicode (a lone surrogate from a `\\udXXX` escape)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            if not o.isascii():
                try:
                    o.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return False


def parse_header_json(raw: bytes) -> tuple[Any, str | None, bool]:
    """A header frame's JSON, bounded: strict UTF-8, nesting depth. Every failure is ProtocolError(MALFORMED)
    naming it. Returns the object, the number it may not hold (an integer beyond int64, a non-finite float:
    replaced by UNREADABLE), and whether a string may hold a lone surrogate (an escape of one appears;
    `check_strings` decides), so the caller can still read the id and type before refusing the message."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(
            ErrorCode.MALFORMED, f"header frame of {len(raw)} bytes exceeds the limit of {MAX_HEADER_BYTES}"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(ErrorCode.MALFORMED, f"header frame is not UTF-8 JSON: {e}") from None
    if text.count("[") + text.count("{") > MAX_HEADER_DEPTH and _nesting_depth(text) > MAX_HEADER_DEPTH:
        raise ProtocolError(
            ErrorCode.MALFORMED, f"header nests arrays/objects deeper than {MAX_HEADER_DEPTH} levels"
        )
    numbers = _Numbers()
    try:
        obj = json.loads(text, parse_int=numbers.int, parse_float=numbers.float, parse_constant=numbers.constant)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(ErrorCode.MALFORMED, f"header frame is not UTF-8 JSON: {e}") from None
    return obj, numbers.problem, _SURROGATE_ESCAPE.search(text) is not None


def check_strings(obj: Any) -> None:
    if _bad_string(obj):
        raise ProtocolError(
            ErrorCode.MALFORMED, "header holds a string with a lone surrogate escape (not valid Unicode)"
        )


def _readable(value: Any, limit: int, ints: bool) -> Any:
    """`value` if a reply can echo it (an int64, or a short valid-Unicode string), else None."""
    if ints and type(value) is int:
        return value
    if type(value) is str and len(value) <= limit and not _bad_string(value):
        return value
    return None


def decode(frames: Sequence[Any], request: bool = False) -> Message:
    """Parse `[header, *buffers]`; raises ProtocolError(MALFORMED or PROTOCOL_VERSION) naming the fault, with
    `req_id` / `req_type` set to the request's id and type where they were readable. Header fields are
    type-checked strictly (no coercion); `request` also refuses the reply-only fields."""
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED, "empty message (no header frame)")
    head = frames[0]
    obj, bad_number, suspicious = parse_header_json(head.bytes if hasattr(head, "bytes") else bytes(head))
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "header frame must be a JSON object")
    try:
        if bad_number:
            raise ProtocolError(ErrorCode.MALFORMED, f"header frame holds {bad_number}")
        if suspicious:
            check_strings(obj)
        return _decode(obj, frames, request)
    except ProtocolError as e:
        e.req_id = _readable(obj.get("id"), MAX_ID_CHARS, ints=True)
        e.req_type = _readable(obj.get("type"), MAX_TYPE_CHARS, ints=False)
        raise


def _decode(obj: dict, frames: Sequence[Any], request: bool) -> Message:
    proto = obj.get("proto")
    if type(proto) is not int or proto != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.PROTOCOL_VERSION,
            f"protocol version {_short(proto)} is not supported; this server speaks {PROTOCOL_VERSION}",
        )
    if request:
        extra = [f for f in REPLY_ONLY_FIELDS if f in obj]
        if extra:
            raise ProtocolError(
                ErrorCode.MALFORMED, f"header field(s) {extra} belong to replies, not to a request"
            )
    try:
        header = Header.model_validate(obj, strict=True)
    except ValidationError as e:
        raise ProtocolError(ErrorCode.MALFORMED, f"header: {_pydantic_message(e)}") from None
    if len(frames) - 1 != len(header.buffers):
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"header declares {len(header.buffers)} buffers but {len(frames) - 1} buffer frames arrived",
        )
    msg = Message(header=header)
    for spec, frame in zip(header.buffers, frames[1:], strict=True):
        if spec.dtype not in ITEMSIZE:
            raise ProtocolError(ErrorCode.MALFORMED, f"buffer {spec.name!r}: unknown dtype {spec.dtype!r}")
        if any(d < 0 for d in spec.shape):
            raise ProtocolError(
                ErrorCode.MALFORMED, f"buffer {spec.name!r}: negative dimension in {spec.shape}"
            )
        raw = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        if raw.nbytes != spec.nbytes():
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"buffer {spec.name!r} declares {spec.dtype}{spec.shape} = {spec.nbytes()} bytes "
                f"but its frame has {raw.nbytes}",
            )
        if spec.name in msg.frames:
            raise ProtocolError(ErrorCode.MALFORMED, f"buffer name {spec.name!r} appears twice")
        msg.frames[spec.name] = (spec, raw.cast("B") if raw.ndim != 1 or raw.format != "B" else raw)
    return msg


def _pydantic_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    more = len(e.errors()) - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def parse_body(model: type[BaseModel], body: dict[str, Any], what: str) -> Any:
    """The body as `model`, strictly: no type coercion (`true`, `1.0` or `"1"` are not integers)."""
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as e:
        raise ProtocolError(ErrorCode.INVALID, f"{what}: {_pydantic_message(e)}") from None


def error_header(req_id: Any, typ: str | None, err: ProtocolError) -> Header:
    return Header(
        proto=PROTOCOL_VERSION,
        id=req_id,
        type=typ,
        ok=False,
        error={"code": err.code, "message": err.message, **({"details": err.details} if err.details else {})},
    )


# ---------------------------------------------------------------------------------------------- bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


Version = Annotated[int, Field(ge=0, le=INT32_MAX)]  # weights versions travel as int32 per token
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Rid = Annotated[str, Field(min_length=1, max_length=MAX_RID_CHARS)]


class WireSamplingParams(_Body):
    """What the engine samples with, as the channel carries it (the loop's `rollverify.interfaces.SamplingParams`
    is a subset). Log-probs are of log_softmax(logits / temperature); temperature 0 is greedy decoding and reports
    log_softmax(logits) (temperature 1). top_p/top_k/min_p truncate sampling but the reported log-prob stays that
    of the untruncated tempered distribution (keep them off for RL)."""

    temperature: float = Field(1.0, ge=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, le=TOP_K_MAX)
    min_p: float = Field(0.0, ge=0.0, lt=1.0, allow_inf_nan=False)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(None, max_length=1 << 10)
    sampling_seed: int | None = Field(None, ge=0, le=INT64_MAX)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError(f"top_k must be -1 (off) or in [1, {TOP_K_MAX}]")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0 < v < TEMPERATURE_MIN:
            raise ValueError(f"temperature must be 0 (greedy) or in [{TEMPERATURE_MIN}, {TEMPERATURE_MAX}]")
        return v


class SubmitItem(_Body):
    rid: Rid
    prompt_len: int = Field(ge=1, le=INT32_MAX)
    prefix_len: Count = 0
    max_new_tokens: int = Field(ge=1, le=INT32_MAX)  # budget of the whole response, prefix included
    sampling: WireSamplingParams | None = None  # overrides the message's


class SubmitBody(_Body):
    """Buffers: prompt_ids int32[sum prompt_len], prefix_ids int32[sum prefix_len]; optional, aligned with
    prefix_ids: prefix_logprobs float32, prefix_versions int32, prefix_routed_experts [.., layers, top_k];
    optional prompt_routed_experts [sum(prompt_len - 1), layers, top_k]."""

    items: list[SubmitItem] = Field(max_length=MAX_ITEMS)
    sampling: WireSamplingParams = Field(default_factory=WireSamplingParams)
    expect_version: Version | None = None


class PauseBody(_Body):
    pass


class ResumeBody(_Body):
    """No ids: the server resumes and relaunches every paused response but those in `hold`, which stay paused.
    `rids`: the server is running; these paused (held) responses launch."""

    hold: list[Rid] = Field(default_factory=list, max_length=MAX_ITEMS)
    rids: list[Rid] | None = Field(default=None, min_length=1, max_length=MAX_ITEMS)

    @model_validator(mode="after")
    def _one_of(self) -> ResumeBody:
        if self.hold and self.rids is not None:
            raise ValueError("resume takes `hold` (resume the server) or `rids` (launch held responses), not both")
        return self


class TruncateBody(_Body):
    keep: dict[str, int]  # each keep length is checked against its response: KEEP_OUT_OF_RANGE


class AppendItem(_Body):
    rid: Rid
    count: int = Field(ge=1, le=INT32_MAX)  # environment tokens for this response, in `token_ids`


class AppendBody(_Body):
    """Environment tokens (buffer `token_ids` int32, items end to end) appended to responses that are not
    generating; each then continues (launched at once unless the server is paused or `launch` is false)."""

    items: list[AppendItem] = Field(min_length=1, max_length=MAX_ITEMS)
    launch: bool = True


class DropBody(_Body):
    rids: list[str] | None = None
    all: bool = False


class FetchBody(_Body):
    rids: list[str] | None = None  # None: every cached response


class EventsBody(_Body):
    # acknowledge every event with seq <= after; seqs start at 1, so -1 (accepted since version 1) and 0 acknowledge
    # nothing
    after: int = Field(0, ge=-1, le=INT64_MAX)
    wait_s: float = Field(0.0, ge=0.0, le=60.0, allow_inf_nan=False)
    max_events: int = Field(4096, ge=1, le=MAX_EVENTS)


class UpdateWeightsBody(_Body):
    """One bucket; buffers are the tensors, named by their Hugging Face names."""

    version: Version
    bucket: int = Field(0, ge=0, le=MAX_BUCKET)
    commit: bool = True
    flush_cache: bool = True


class UpdateWeightsFromDiskBody(_Body):
    path: str = Field(min_length=1, max_length=4096)
    version: Version


class WeightsGroupBody(_Body):
    """Join the trainer's weight-update group (disaggregated transport; see "Weight transports")."""

    master_addr: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=INT32_MAX)
    world_size: int = Field(ge=2, le=INT32_MAX)
    group: str = Field(min_length=1, max_length=128)
    backend: Literal["gloo", "nccl"]


class _StreamBody(_Body):
    """One step of a weight version streamed bucket by bucket: `bucket` (its tensors' names, dtypes, shapes),
    then `commit` (how many buckets were sent), or `abort`."""

    step: Literal["bucket", "commit", "abort"]
    version: Version
    bucket: int = Field(0, ge=0, le=MAX_BUCKET)
    names: list[str] = Field(default_factory=list, max_length=1 << 16)
    dtypes: list[str] = Field(default_factory=list, max_length=1 << 16)
    shapes: list[list[Annotated[int, Field(ge=0, le=INT64_MAX)]]] = Field(default_factory=list, max_length=1 << 16)
    buckets: Count = 0
    reason: str = Field("", max_length=4096)

    @model_validator(mode="after")
    def _one_dtype_and_shape_per_name(self) -> _StreamBody:
        n = len(self.names)
        if self.step == "bucket" and (n == 0 or not n == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"a bucket needs one dtype and one shape per name, at least one name (got {n} names, "
                f"{len(self.dtypes)} dtypes, {len(self.shapes)} shapes). Nothing was applied"
            )
        return self


class DistributedBucketBody(_StreamBody):
    group: str = Field("", max_length=128)  # the weight-update group the bytes are broadcast over


class IpcBucketBody(_StreamBody):
    payloads: list[str] = Field(default_factory=list, max_length=64)  # base64, one per TP rank


class MemoryBody(_Body):
    action: Literal["release", "resume"]
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] = Field(default_factory=list, max_length=3)


class FlushBody(_Body):
    pass


class ComputeLogprobsBody(_Body):
    """Log-probs of the named responses' tokens under the served weights (sglang_ext/handlers/logprobs.py)."""

    rids: list[Rid] = Field(min_length=1, max_length=MAX_ITEMS)
    expect_version: Version | None = None


class StatsBody(_Body):
    engine: bool = False  # also ask SGLang for its load snapshot (one round trip to the scheduler)


class HealthBody(_Body):
    pass


class WeightsBody(_Body):
    pass


class ShutdownBody(_Body):
    pass


BODIES: dict[str, type[BaseModel]] = {
    "submit": SubmitBody,
    "pause": PauseBody,
    "resume": ResumeBody,
    "truncate": TruncateBody,
    "append": AppendBody,
    "drop": DropBody,
    "fetch": FetchBody,
    "events": EventsBody,
    "update_weights": UpdateWeightsBody,
    "update_weights_from_disk": UpdateWeightsFromDiskBody,
    "flush": FlushBody,
    "compute_logprobs": ComputeLogprobsBody,
    "weights_group": WeightsGroupBody,
    "update_weights_distributed": DistributedBucketBody,
    "update_weights_ipc": IpcBucketBody,
    "memory": MemoryBody,
    "stats": StatsBody,
    "health": HealthBody,
    "weights": WeightsBody,
    "shutdown": ShutdownBody,
}
# Answered at once, beside whatever command is executing; everything else runs one at a time in arrival order.
QUERY_TYPES = frozenset({"events", "stats", "health", "fetch", "weights"})
SUBMIT_BUFFERS = frozenset(
    {
        "prompt_ids",
        "prefix_ids",
        "prefix_logprobs",
        "prefix_versions",
        "prefix_routed_experts",
        "prompt_routed_experts",
    }
)

APPEND_BUFFERS = frozenset({"token_ids"})


def check_buffer_names(typ: str, msg: Message) -> None:
    """Refuse buffers a request type does not take (update_weights' are named by the weights themselves)."""
    if typ == "update_weights":
        return
    allowed = SUBMIT_BUFFERS if typ == "submit" else APPEND_BUFFERS if typ == "append" else frozenset()
    unknown = [n for n in msg.frames if n not in allowed]
    if unknown:
        takes = f"its buffers are {sorted(allowed)}" if allowed else "it takes none"
        raise ProtocolError(
            ErrorCode.INVALID, f"{typ} takes no buffer named {_short(unknown[0])} ({takes})"
        )

FinishReason = Literal["stop", "length", "abort", "error"]


# ---------------------------------------------------------------------------------------------- outputs


@dataclass
class Output:
    """Generated tokens of one response from index `offset` on (a delta, or the whole cache for fetch).

    `routed_experts[j]` are the routes of the engine's latest forward over input position
    prompt_len + offset + j - 1 (the one whose output distribution sampled token `offset + j`).
    `prompt_routed_experts` (input positions 0 .. prompt_len - 2) and `prefix_routed_experts` (tokens
    0 .. offset - 1) come when the engine re-prefilled those positions (a launch under new weights) and
    supersede what the controller holds for them; with them every input position of prompt + tokens[:-1] has
    the routes of its latest forward, which is what routing replay needs.
    """

    rid: str
    offset: int
    token_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    versions: np.ndarray  # int32 [n]
    total_len: int  # generated tokens of the response after this delta
    finish_reason: str | None = None  # None: still live (paused); else stop | length | error
    routed_experts: np.ndarray | None = None  # [n, layers, top_k]
    prompt_routed_experts: np.ndarray | None = None  # [prompt_len - 1, layers, top_k]
    prefix_routed_experts: np.ndarray | None = None  # [offset, layers, top_k]
    seq: int | None = None  # event sequence number (events only)
    error: str | None = None
    matched_stop: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def encode_outputs(
    outputs: list[Output], seqs: bool = False, route_shape: Any = None
) -> tuple[dict, dict[str, np.ndarray]]:
    """Pack many outputs into one body and a constant number of buffers: per-token arrays concatenated in item
    order, per-item integers as int32/int64 arrays, only the response ids (and finish reasons) as JSON.
    `seqs` (events) and `route_shape` (MoE: layers, top_k, dtype) make those buffers present even when the
    batch is empty, as the doc lists them."""
    body: dict[str, Any] = {"rids": [o.rid for o in outputs]}
    if any(o.finish_reason is not None for o in outputs):
        body["finish"] = [o.finish_reason for o in outputs]
    errors = {str(i): o.error for i, o in enumerate(outputs) if o.error is not None}
    if errors:
        body["errors"] = errors
    stops = {str(i): o.matched_stop for i, o in enumerate(outputs) if o.matched_stop is not None}
    if stops:
        body["matched_stop"] = stops
    arrays: dict[str, np.ndarray] = {
        "offsets": np.fromiter((o.offset for o in outputs), np.int32, len(outputs)),
        "counts": np.fromiter((len(o.token_ids) for o in outputs), np.int32, len(outputs)),
        "totals": np.fromiter((o.total_len for o in outputs), np.int32, len(outputs)),
        "token_ids": concat([o.token_ids for o in outputs], np.int32),
        "logprobs": concat([o.logprobs for o in outputs], np.float32),
        "versions": concat([o.versions for o in outputs], np.int32),
    }
    if seqs or any(o.seq is not None for o in outputs):
        arrays["seqs"] = np.fromiter(
            (-1 if o.seq is None else o.seq for o in outputs), np.int64, len(outputs)
        )
    routes = [o.routed_experts for o in outputs if o.routed_experts is not None]
    if routes:
        if len(routes) != len(outputs):
            raise ValueError("either every output carries routed experts or none does")
        arrays["routed_experts"] = np.concatenate(routes)
    elif route_shape is not None and not outputs:
        arrays["routed_experts"] = np.zeros((0, route_shape.layers, route_shape.top_k), route_shape.dtype)
    for name in ("prompt", "prefix"):
        parts = [getattr(o, f"{name}_routed_experts") for o in outputs]
        if any(p is not None for p in parts):
            arrays[f"{name}_route_rows"] = np.fromiter((-1 if p is None else len(p) for p in parts), np.int32, len(parts))
            arrays[f"{name}_routed_experts"] = np.concatenate([p for p in parts if p is not None])
    return body, arrays


def concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    """`parts` end to end as `dtype` (no copy of a single part already of it); empty when there are none."""
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


ROUTE_DTYPES = ("uint8", "int16", "int32")


@dataclass
class OutputBatch:
    """An output batch as the controller reads it: every entry's per-token arrays end to end, as they travel.

    Entry `i` holds tokens `offsets[i] ..` of response `rids[i]`, stored at `bounds[i]:bounds[i + 1]` of
    `token_ids`, `logprobs`, `versions` and `routed_experts`. Decoding copies each buffer once, whatever the
    number of entries (the frames belong to the socket); nothing is done per entry but reading the JSON lists.
    """

    rids: list[str]
    offsets: np.ndarray  # int32 [R]: index of the entry's first token in its response
    bounds: np.ndarray  # int64 [R + 1]: the entry's rows in the per-token arrays
    totals: np.ndarray  # int32 [R]: the response's length after the entry
    token_ids: np.ndarray  # int32 [N]
    logprobs: np.ndarray  # float32 [N]
    versions: np.ndarray  # int32 [N]
    routed_experts: np.ndarray | None  # [N, layers, top_k]
    finish: list[str | None]  # per entry: stop | length | error, None while live
    seqs: np.ndarray | None = None  # int64 [R], events only (-1: none)
    prompt_routes: dict[int, np.ndarray] = field(default_factory=dict)  # entry -> [prompt_len - 1, L, K]
    prefix_routes: dict[int, np.ndarray] = field(default_factory=dict)  # entry -> [offset, L, K]
    errors: dict[int, str] = field(default_factory=dict)
    matched_stop: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rids)

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.bounds)

    @classmethod
    def decode(cls, msg: Message) -> OutputBatch:
        """Inverse of encode_outputs; MALFORMED when the buffers do not match the entries."""
        rids = msg.body.get("rids", [])
        r = len(rids)
        offsets = msg.array("offsets", ["int32"], 1)
        counts = msg.array("counts", ["int32"], 1)
        totals = msg.array("totals", ["int32"], 1)
        seqs = msg.array("seqs", ["int64"], 1, required=False)
        ids = msg.array("token_ids", ["int32"], 1)
        lps = msg.array("logprobs", ["float32"], 1)
        vers = msg.array("versions", ["int32"], 1)
        routes = msg.array("routed_experts", ROUTE_DTYPES, 3, required=False)
        finish = msg.body.get("finish") or [None] * r
        bounds = np.zeros(r + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        total = int(bounds[-1])
        sizes_ok = len(offsets) == len(counts) == len(totals) == len(finish) == r and (
            seqs is None or len(seqs) == r
        )
        if (
            not sizes_ok
            or not (len(ids) == len(lps) == len(vers) == total)
            or (routes is not None and len(routes) != total)
        ):
            raise ProtocolError(ErrorCode.MALFORMED, "output buffers do not match the item counts")
        prompt_routes = _entry_routes(msg, "prompt", r)
        prefix_routes = _entry_routes(msg, "prefix", r)
        if any(len(a) != offsets[i] for i, a in prefix_routes.items()):
            raise ProtocolError(ErrorCode.MALFORMED, "prefix_route_rows must equal the entries' offsets")
        return cls(
            rids=rids,
            offsets=offsets.copy(),
            bounds=bounds,
            totals=totals.copy(),
            token_ids=ids.copy(),
            logprobs=lps.copy(),
            versions=vers.copy(),
            routed_experts=None if routes is None else routes.copy(),
            finish=finish,
            seqs=None if seqs is None else seqs.copy(),
            prompt_routes=prompt_routes,
            prefix_routes=prefix_routes,
            errors={int(k): v for k, v in msg.body.get("errors", {}).items()},
            matched_stop={int(k): v for k, v in msg.body.get("matched_stop", {}).items()},
        )

    def output(self, i: int) -> Output:
        """Entry `i` as an Output whose arrays are views into this batch."""
        sl = slice(int(self.bounds[i]), int(self.bounds[i + 1]))
        seq = None if self.seqs is None or self.seqs[i] < 0 else int(self.seqs[i])
        return Output(
            rid=self.rids[i],
            offset=int(self.offsets[i]),
            token_ids=self.token_ids[sl],
            logprobs=self.logprobs[sl],
            versions=self.versions[sl],
            total_len=int(self.totals[i]),
            finish_reason=self.finish[i],
            routed_experts=None if self.routed_experts is None else self.routed_experts[sl],
            prompt_routed_experts=self.prompt_routes.get(i),
            prefix_routed_experts=self.prefix_routes.get(i),
            seq=seq,
            error=self.errors.get(i),
            matched_stop=self.matched_stop.get(i),
        )

    def outputs(self) -> list[Output]:
        return [self.output(i) for i in range(len(self))]


def _entry_routes(msg: Message, name: str, r: int) -> dict[int, np.ndarray]:
    """Entry -> its `{name}_routed_experts` rows (`{name}_route_rows` per entry, -1: none), copied."""
    rows = msg.array(f"{name}_route_rows", ["int32"], 1, required=False)
    flat = msg.array(f"{name}_routed_experts", ROUTE_DTYPES, 3, required=False)
    if rows is None:
        if flat is not None:
            raise ProtocolError(ErrorCode.MALFORMED, f"{name}_routed_experts without {name}_route_rows")
        return {}
    if len(rows) != r or flat is None:
        raise ProtocolError(ErrorCode.MALFORMED, "output buffers do not match the item counts")
    ends = np.cumsum(np.maximum(rows, 0))
    if ends[-1:].sum() != len(flat):
        raise ProtocolError(ErrorCode.MALFORMED, f"{name}_routed_experts do not match {name}_route_rows")
    return {i: flat[ends[i] - rows[i] : ends[i]].copy() for i in np.flatnonzero(rows >= 0).tolist()}


def route_dtype(num_experts: int) -> np.dtype:
    """Smallest integer type that holds an expert index: routes are the bulk of the bytes for MoE."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32767:
        return np.dtype(np.int16)
    return np.dtype(np.int32)
