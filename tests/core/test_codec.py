from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lm_resiliency.core import codec
from lm_resiliency.core.messages import (
    MESSAGE_TYPES,
    AuditResult,
    Batch,
    BulkAck,
    BulkChunk,
    Evidence,
    GeminiInventory,
    Goodbye,
    Heartbeat,
    LinkReport,
    PeerAnnouncement,
    Progress,
    ReplayResult,
    ReplicaRequest,
    StepTelemetry,
    Vote,
)
from lm_resiliency.errors import CodecError

pytestmark = pytest.mark.timeout(120)

SAMPLES = [
    Heartbeat(rank=3, incarnation=2, step=10, progress=11),
    Goodbye(rank=1, incarnation=1, reason="close"),
    StepTelemetry(rank=0, step=5, step_s=0.25, input_s=0.01, compute_s=0.2, comm_s=0.03, extra={"a": 1.5}),
    PeerAnnouncement(
        rank=2,
        incarnation=7,
        node_id="node-a",
        pid=123,
        pub=("ipc:///tmp/x", "tcp://1.2.3.4:5"),
        router=("tcp://1.2.3.4:6",),
        replica_group=(0, 2),
        dims={"dp": (0, 2)},
    ),
    BulkChunk(rank=1, transfer_id="t", index=0, count=2, total_bytes=8, meta={"k": "v"}, buffers=(b"abcd",)),
    BulkAck(rank=1, transfer_id="t", index=-1, ok=True),
    ReplicaRequest(rank=2, owner=2, step=7, transfer_id="x"),
    GeminiInventory(rank=1, local=(3, 4), replicas={"0": (3,)}, disk=(2,)),
    Evidence(rank=0, step=3, grads=b"g" * 16, params=b"p" * 16),
    Progress(rank=2, step=3, collectives=9, in_collective_s=0.5, idle_s=0.1),
    Vote(rank=1, key="sdc:2@6", kind="sdc", ranks=(2,), step=6, reason="grads_fingerprint_minority"),
    LinkReport(rank=2, round=3, seconds={"0": 0.001, "5": 0.25}),
    AuditResult(rank=1, step=6, audited=2, finding="output", detail=""),
    Batch(rank=3, items=(b"\x94\xa4hbt", b"")),
    ReplayResult(rank=0, step=6, what="grads", replayed=b"\x01" * 16, recorded=b"\x02" * 16, note=""),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    frames = codec.encode(msg)  # type: ignore[arg-type]
    assert codec.decode(frames) == msg


def test_buffers_travel_as_their_own_frames_uncopied() -> None:
    payload = memoryview(bytearray(b"x" * 1000))
    frames = codec.encode(BulkChunk(0, "t", 0, 1, 1000, {}, (payload,)))
    assert len(frames) == 2 and frames[1] is payload
    assert len(frames[0]) < 100  # the header does not contain the bytes


def test_every_registered_type_has_a_sample() -> None:
    assert {type(m).TAG for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ([], "no frames"),
        ([b"\xc1"], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "4-item array"),
        ([msgpack.packb(["nope", 1, {}, 0])], "unknown message type"),
        ([msgpack.packb(["hb", 99, {}, 0])], "schema version 99"),
        ([msgpack.packb(["hb", 1, {"rank": 1}, 0])], "missing field"),
        (
            [msgpack.packb(["hb", 1, {"rank": 1, "incarnation": 1, "step": 1, "progress": 1, "x": 1}, 0])],
            "unknown",
        ),
        ([msgpack.packb(["hb", 1, {"rank": "1", "incarnation": 1, "step": 1, "progress": 1}, 0])], "hb.rank"),
        (
            [msgpack.packb(["hb", 1, {"rank": True, "incarnation": 1, "step": 1, "progress": 1}, 0])],
            "hb.rank",
        ),
        (
            [msgpack.packb(["hb", 1, {"rank": 1, "incarnation": 1, "step": 1, "progress": 1}, 1])],
            "announces 1",
        ),
        (
            [msgpack.packb(["hb", 1, {"rank": 1, "incarnation": 1, "step": 1, "progress": 1}, 1]), b"x"],
            "carries no buffers",
        ),
        ([msgpack.packb(["bye", 1, {"rank": 1, "incarnation": 1, "reason": b"bytes"}, 0])], "bye.reason"),
        (
            [
                msgpack.packb(
                    [
                        "peer",
                        1,
                        {"rank": 1, "incarnation": 1, "node_id": "n", "pid": 1, "pub": "x", "router": []},
                        0,
                    ]
                )
            ],
            "peer.pub",
        ),
        (
            [msgpack.packb(["step", 1, {"rank": 0, "step": 1, "step_s": 1.0, "extra": {"a": "b"}}, 0])],
            "extra",
        ),
        (
            [msgpack.packb(["hb", 1, {"rank": 1, "incarnation": 1, "step": 1, "progress": 1}, 99999])],
            "out of range",
        ),
    ],
)
def test_malformed_payloads_raise_codec_error_naming_the_problem(frames: list[bytes], needle: str) -> None:
    with pytest.raises(CodecError, match=needle):
        codec.decode(frames)


def test_ints_are_accepted_for_float_fields() -> None:
    raw = msgpack.packb(["step", 1, {"rank": 0, "step": 1, "step_s": 2}, 0])
    msg = codec.decode([raw])
    assert isinstance(msg, StepTelemetry) and msg.step_s == 2.0 and isinstance(msg.step_s, float)


def _decode_only_codec_error(frames: list[bytes]) -> None:
    with contextlib.suppress(CodecError):
        codec.decode(frames)


@settings(max_examples=800, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.binary(max_size=256), min_size=0, max_size=4))
def test_fuzz_random_bytes_only_codec_error(frames: list[bytes]) -> None:
    _decode_only_codec_error(frames)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=800, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    st.sampled_from([*sorted(MESSAGE_TYPES), "zz"]),
    st.integers(-2, 3),
    st.dictionaries(st.text(max_size=12), msgpack_values, max_size=8),
    st.integers(-1, 3),
)
def test_fuzz_structured_headers_only_codec_error(tag: str, version: int, body: dict, n: int) -> None:
    _decode_only_codec_error([msgpack.packb([tag, version, body, n])])


@settings(max_examples=800, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.sampled_from(range(len(SAMPLES))), st.data())
def test_fuzz_mutated_valid_payloads_only_codec_error(index: int, data: st.DataObject) -> None:
    frames = [bytes(f) for f in codec.encode(SAMPLES[index])]
    header = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(header) - 1)))
        if op == "flip" and header:
            header[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del header[pos:]
        else:
            header[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
    frames[0] = bytes(header)
    _decode_only_codec_error(frames)
