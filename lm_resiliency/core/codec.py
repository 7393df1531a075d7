"""The only encoder and decoder of wire messages.

Layout of an encoded message (a list of frames):
  frame 0: msgpack array `[tag, version, body, n_frames]`; `body` maps field names to values;
  frames 1..n: the bytes of the message's `frames=True` field, untouched (no copy into msgpack).

`decode` validates everything against the dataclass annotations and raises `CodecError` (and only
`CodecError`) for anything malformed: unknown tag, unsupported version, missing, unknown or mistyped
fields, wrong frame count, or bytes that are not msgpack at all.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack

from lm_resiliency.errors import CodecError

from .messages import MESSAGE_TYPES, Message

__all__ = ["decode", "decode_header", "decode_value", "encode", "encode_value"]

M = TypeVar("M", bound=Message)
Frame = bytes | memoryview

# Bounds that keep a hostile header from costing more than it is worth.
MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 4096

Checker = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class _FieldSpec:
    name: str
    frames: bool
    required: bool
    checker: Checker  # built once from the field's annotation


_SPECS: dict[type[Message], tuple[_FieldSpec, ...]] = {}


def _spec(cls: type[Message]) -> tuple[_FieldSpec, ...]:
    cached = _SPECS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        frames = bool(f.metadata.get("frames"))
        checker = _checker(hints[f.name]) if not frames else _checker(Any)
        out.append(_FieldSpec(f.name, frames, required, checker))
    _SPECS[cls] = tuple(out)
    return _SPECS[cls]


def encode(msg: Message) -> list[Frame]:
    """Encode `msg` as frames: a msgpack header, then its buffers as they are."""
    cls = type(msg)
    if MESSAGE_TYPES.get(cls.TAG) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered message type")
    body: dict[str, Any] = {}
    buffers: Sequence[Frame] = ()
    for spec in _spec(cls):
        value = getattr(msg, spec.name)
        if spec.frames:
            buffers = value
        else:
            body[spec.name] = value
    header = msgpack.packb([cls.TAG, cls.VERSION, body, len(buffers)], use_bin_type=True)
    return [header, *buffers]


def encode_value(msg: Message) -> bytes:
    """Encode a message without buffers into one byte string (for store records)."""
    frames = encode(msg)
    if len(frames) != 1:
        raise TypeError(f"{type(msg).__name__} carries buffers and cannot be encoded as one value")
    return bytes(frames[0])


def decode_value(data: bytes, expected: type[M]) -> M:
    """Decode a store record written by `encode_value`, requiring type `expected`."""
    msg = decode([data])
    if not isinstance(msg, expected):
        raise CodecError(f"expected {expected.TAG!r}, got {type(msg).TAG!r}")
    return msg


def decode_header(frame: Frame) -> tuple[str, int, dict[str, Any], int]:
    """Parse and shape-check frame 0. Raises CodecError."""
    if len(frame) > MAX_HEADER_BYTES:
        raise CodecError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True, timestamp=0)
    except Exception as exc:  # msgpack raises a zoo of types for bad bytes; translate once, here
        raise CodecError(f"header is not valid msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, list) or len(obj) != 4:
        raise CodecError("header must be a 4-item array [tag, version, body, n_frames]")
    tag, version, body, n_frames = obj
    if not isinstance(tag, str):
        raise CodecError("header tag must be a string")
    if type(version) is not int or type(n_frames) is not int:
        raise CodecError("header version and frame count must be integers")
    if not isinstance(body, dict):
        raise CodecError("header body must be a map")
    if not 0 <= n_frames <= MAX_FRAMES:
        raise CodecError(f"frame count {n_frames} out of range")
    return tag, version, body, n_frames


def decode(frames: Sequence[Frame]) -> Message:
    """Decode frames produced by `encode`. Raises CodecError for anything malformed."""
    if not frames:
        raise CodecError("no frames")
    tag, version, body, n_frames = decode_header(frames[0])
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise CodecError(f"unknown message type {tag!r}")
    if version != cls.VERSION:
        raise CodecError(f"{tag}: schema version {version} not supported (expected {cls.VERSION})")
    if n_frames != len(frames) - 1:
        raise CodecError(f"{tag}: header announces {n_frames} frames, {len(frames) - 1} arrived")
    specs = _spec(cls)
    known = {s.name for s in specs if not s.frames}
    unknown = set(body) - known
    if unknown:
        raise CodecError(f"{tag}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs: dict[str, Any] = {}
    for spec in specs:
        if spec.frames:
            kwargs[spec.name] = tuple(frames[1:])
            continue
        if spec.name not in body:
            if spec.required:
                raise CodecError(f"{tag}: missing field {spec.name!r}")
            continue
        try:
            kwargs[spec.name] = spec.checker(body[spec.name])
        except _Mismatch as exc:
            raise CodecError(f"{tag}.{spec.name}{exc.path}: {exc.detail}") from None
    if n_frames and not any(s.frames for s in specs):
        raise CodecError(f"{tag}: carries no buffers but {n_frames} frames arrived")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # __post_init__ validation of a message
        raise CodecError(f"{tag}: {exc}") from exc


class _Mismatch(Exception):
    """A value that does not fit its annotation; `path` grows as it leaves nested checkers."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(detail)
        self.path = path
        self.detail = detail


_CHECKERS: dict[Any, Checker] = {}


def _checker(tp: Any) -> Checker:
    """A checker for annotation `tp`, built once: decoding is on every received message's path,
    so the annotation is inspected here and not per value, and error paths are only formatted
    when a value is wrong."""
    cached = _CHECKERS.get(tp)
    if cached is None:
        cached = _CHECKERS[tp] = _build(tp)
    return cached


def _build(tp: Any) -> Checker:
    if tp is Any:
        return lambda value: value
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        optional = type(None) in args
        options = [_checker(a) for a in args if a is not type(None)]

        def union(value: Any) -> Any:
            if value is None and optional:
                return None
            for option in options:
                try:
                    return option(value)
                except _Mismatch:
                    continue
            raise _Mismatch("", f"{type(value).__name__} matches none of {tp}")

        return union
    if tp is float:

        def as_float(value: Any) -> Any:
            if type(value) is float:
                return value
            if type(value) is int:
                return float(value)
            raise _Mismatch("", f"expected float, got {type(value).__name__}")

        return as_float
    if tp in (int, bool, str, bytes):

        def exact(value: Any) -> Any:
            if type(value) is not tp:
                raise _Mismatch("", f"expected {tp.__name__}, got {type(value).__name__}")
            return value

        return exact
    if tp is memoryview:

        def never(value: Any) -> Any:
            raise _Mismatch("", "buffers cannot appear in a header")

        return never
    if origin is tuple:
        args = typing.get_args(tp)
        homogeneous = len(args) == 2 and args[1] is Ellipsis
        checks = [_checker(a) for a in (args[:1] if homogeneous else args)]

        def array(value: Any) -> Any:
            if not isinstance(value, list):
                raise _Mismatch("", f"expected array, got {type(value).__name__}")
            if not homogeneous and len(checks) != len(value):
                raise _Mismatch("", f"expected {len(checks)} items, got {len(value)}")
            out = []
            for i, v in enumerate(value):
                try:
                    out.append(checks[0 if homogeneous else i](v))
                except _Mismatch as exc:
                    raise _Mismatch(f"[{i}]{exc.path}", exc.detail) from None
            return tuple(out)

        return array
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        check_key, check_val = _checker(key_tp), _checker(val_tp)

        def mapping(value: Any) -> Any:
            if not isinstance(value, dict):
                raise _Mismatch("", f"expected map, got {type(value).__name__}")
            out = {}
            for k, v in value.items():
                try:
                    key = check_key(k)
                except _Mismatch as exc:
                    raise _Mismatch(f".<key>{exc.path}", exc.detail) from None
                try:
                    out[key] = check_val(v)
                except _Mismatch as exc:
                    raise _Mismatch(f"[{k!r}]{exc.path}", exc.detail) from None
            return out

        return mapping
    raise TypeError(f"unsupported annotation {tp!r} in a message type")
