"""Plain values and framed messages between the trusted side and a sandboxed program.

A value crosses the sandbox's boundary only as plain data: None, bool, int, float, complex, str, bytes and lists,
tuples, dicts, sets and frozensets of them. `encode` maps each to JSON (types that JSON lacks are one-key objects:
{"t": [...]} a tuple, {"d": [[k, v], ...]} a dict, {"s": [...]} a set, {"z": [...]} a frozenset, {"b": base64}
bytes, {"i": hex} a big int, {"f": "nan"} a non-finite float, {"c": [re, im]} a complex); `decode` rebuilds genuine
built-in objects and refuses anything else. So a value that comes out of the sandbox compares with Python's own
equality of built-in types: no object of the program's classes (an `__eq__` that always agrees) ever leaves it.
Subclasses of the built-in types are sent as their base type (a namedtuple as a tuple, an OrderedDict as a dict).

A message is a frame: 4 bytes of big-endian length, then that many bytes of UTF-8 JSON holding one object.
`FrameReader` refuses a frame over its size cap before reading it, and anything that is not a JSON object.

This module uses the standard library only: a copy of it runs inside the sandbox, beside the code reward's box and
judge programs.
"""

import base64
import json
import math
import os
import struct

MAX_DEPTH = 100
HEADER = struct.Struct(">I")
SMALL_INT = 1 << 53


class WireError(ValueError):
    """A value that cannot cross, or bytes that are not a well-formed message."""


def encode(value, depth=0):
    """`value` as JSON-ready data; WireError for a value that is not plain data."""
    if depth > MAX_DEPTH:
        raise WireError(f"value nested deeper than {MAX_DEPTH}")
    d = depth + 1
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        value = int(value)
        return value if -SMALL_INT < value < SMALL_INT else {"i": format(value, "x")}
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return {"b": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, complex):
        return {"c": [encode(value.real, d), encode(value.imag, d)]}
    if isinstance(value, list):
        return [encode(v, d) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"t": [encode(v, d) for v in tuple.__iter__(value)]}
    if isinstance(value, dict):
        return {"d": [[encode(k, d), encode(v, d)] for k, v in dict.items(value)]}
    if isinstance(value, frozenset):
        return {"z": [encode(v, d) for v in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"s": [encode(v, d) for v in set.__iter__(value)]}
    raise WireError(
        f"a value of type {type(value).__name__} cannot leave the sandbox: only None, bool, int, float, complex, str, "
        "bytes and lists, tuples, dicts and sets of them can"
    )


def decode(data, depth=0):
    """Built-in objects from `encode`'s data; WireError for anything else."""
    if depth > MAX_DEPTH:
        raise WireError(f"value nested deeper than {MAX_DEPTH}")
    d = depth + 1
    if data is None or isinstance(data, (bool, str)):
        return data
    if isinstance(data, int):
        if not -SMALL_INT < data < SMALL_INT:
            raise WireError("a big int must be sent as hex")
        return data
    if isinstance(data, float):
        return data
    if isinstance(data, list):
        return [decode(v, d) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise WireError(f"not a value: {str(data)[:80]}")
    (tag, body), = data.items()
    try:
        if tag == "t":
            return tuple(decode(v, d) for v in _items(body))
        if tag == "d":
            return {decode(k, d): decode(v, d) for k, v in (_pair(p) for p in _items(body))}
        if tag == "s":
            return {decode(v, d) for v in _items(body)}
        if tag == "z":
            return frozenset(decode(v, d) for v in _items(body))
        if tag == "b":
            return base64.b64decode(_text(body), validate=True)
        if tag == "i":
            return int(_text(body), 16)
        if tag == "f":
            if body not in ("nan", "inf", "-inf"):
                raise WireError(f"not a non-finite float: {body!r}")
            return float(body)
        if tag == "c":
            re_, im = _items(body)
            return complex(_real(decode(re_, d)), _real(decode(im, d)))
    except (TypeError, ValueError) as exc:
        raise WireError(f"bad {tag!r} value: {exc}") from None
    raise WireError(f"unknown value tag {tag!r}")


def _items(body):
    if not isinstance(body, list):
        raise WireError("a container's items must be a list")
    return body


def _pair(p):
    if not isinstance(p, list) or len(p) != 2:
        raise WireError("a dict item must be a [key, value] pair")
    return p


def _text(body):
    if not isinstance(body, str):
        raise WireError("expected a string")
    return body


def _real(x):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise WireError("a complex part must be a number")
    return x


def frame(message):
    """One message (a dict of JSON data) as a frame."""
    body = json.dumps(message, allow_nan=False, separators=(",", ":")).encode("utf-8")
    return HEADER.pack(len(body)) + body


def read_frame(fd, max_frame):
    """The next message on a blocking descriptor, None at its end (inside the sandbox: requests from the caller)."""
    header = _read_exact(fd, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > max_frame:
        raise WireError(f"a message of {size} bytes is over the {max_frame}-byte cap")
    body = _read_exact(fd, size)
    return None if body is None else json.loads(body.decode("utf-8"))


def _read_exact(fd, n):
    parts, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """Frames out of a byte stream: `feed` bytes as they come, then `next()` until it returns None."""

    def __init__(self, max_frame):
        self.max_frame = max_frame
        self.buf = bytearray()

    def feed(self, data):
        self.buf += data
        if len(self.buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buf)
            if size > self.max_frame:
                raise WireError(f"a message of {size} bytes is over the {self.max_frame}-byte cap")

    def next(self):
        if len(self.buf) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self.buf)
        if size > self.max_frame:
            raise WireError(f"a message of {size} bytes is over the {self.max_frame}-byte cap")
        if len(self.buf) < HEADER.size + size:
            return None
        body = bytes(self.buf[HEADER.size : HEADER.size + size])
        del self.buf[: HEADER.size + size]
        try:
            message = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise WireError(f"a message is not JSON: {exc}") from None
        if not isinstance(message, dict):
            raise WireError("a message must be a JSON object")
        return message
