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
from collections.abc import Sequence
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


@dataclasses.dataclass(frozen=True)
class _FieldSpec:
    name: str
    check: Any  # the resolved annotation
    frames: bool
    required: bool


_SPECS: dict[type[Message], tuple[_FieldSpec, ...]] = {}


def _spec(cls: type[Message]) -> tuple[_FieldSpec, ...]:
    cached = _SPECS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append(_FieldSpec(f.name, hints[f.name], bool(f.metadata.get("frames")), required))
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
        kwargs[spec.name] = _check(body[spec.name], spec.check, f"{tag}.{spec.name}")
    if n_frames and not any(s.frames for s in specs):
        raise CodecError(f"{tag}: carries no buffers but {n_frames} frames arrived")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # __post_init__ validation of a message
        raise CodecError(f"{tag}: {exc}") from exc


def _check(value: Any, tp: Any, where: str) -> Any:
    """Return `value` converted to the annotation `tp`, or raise CodecError naming `where`."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, where)
            except CodecError as exc:
                errors.append(str(exc))
        raise CodecError(f"{where}: {type(value).__name__} matches none of {tp}")
    if tp is int:
        if type(value) is not int:
            raise CodecError(f"{where}: expected int, got {type(value).__name__}")
        return value
    if tp is float:
        if type(value) is float:
            return value
        if type(value) is int:
            return float(value)
        raise CodecError(f"{where}: expected float, got {type(value).__name__}")
    if tp is bool or tp is str or tp is bytes:
        if type(value) is not tp:
            raise CodecError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    if tp is memoryview:
        raise CodecError(f"{where}: buffers cannot appear in a header")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise CodecError(f"{where}: expected array, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise CodecError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_check(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise CodecError(f"{where}: expected map, got {type(value).__name__}")
        return {
            _check(k, key_tp, f"{where}.<key>"): _check(v, val_tp, f"{where}[{k!r}]")
            for k, v in value.items()
        }
    raise CodecError(f"{where}: unsupported annotation {tp!r}")
