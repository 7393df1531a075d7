from __future__ import annotations

import pytest

from lm_resiliency.core import codec
from lm_resiliency.core.auth import BufferCorrupt, Signer, Verifier
from lm_resiliency.core.messages import BulkChunk, Heartbeat
from lm_resiliency.errors import AuthError

pytestmark = pytest.mark.timeout(60)
KEY = b"k" * 32


def _hb(signer: Signer) -> list:
    return signer.seal(codec.encode(Heartbeat(signer.sender, signer.incarnation, 1, 1)))


def test_accepts_and_names_the_sender() -> None:
    v = Verifier(KEY)
    sealed, frames = v.open(_hb(Signer(KEY, 3, 7)))
    assert (sealed.sender, sealed.incarnation, sealed.seq) == (3, 7, 1)
    assert isinstance(codec.decode(frames), Heartbeat)


def test_wrong_key_rejected_and_counted() -> None:
    v = Verifier(KEY)
    with pytest.raises(AuthError) as exc:
        v.open(_hb(Signer(b"x" * 32, 3, 7)))
    assert exc.value.reason == "bad_mac" and v.stats.bad_mac == 1 and v.stats.accepted == 0


def test_tampered_header_and_buffer_rejected() -> None:
    v = Verifier(KEY)
    s = Signer(KEY, 1, 1)
    frames = s.seal(codec.encode(BulkChunk(1, "t", 0, 1, 4, {}, (b"abcd",))))
    header = bytearray(frames[1])
    header[-1] ^= 1
    with pytest.raises(AuthError, match="bad_mac"):
        v.open([frames[0], bytes(header), frames[2]])
    with pytest.raises(BufferCorrupt, match=r"buffers \[0\] fail their digests") as exc:
        v.open([frames[0], frames[1], b"abce"])
    assert exc.value.sealed.sender == 1  # authentic header: the receiver can ask for the chunk again
    with pytest.raises(AuthError, match="malformed"):
        v.open([frames[0], frames[1]])  # a buffer dropped
    assert v.stats.rejected == 3


def test_replay_rejected_reordering_within_window_accepted() -> None:
    v = Verifier(KEY, window=8)
    s = Signer(KEY, 1, 1)
    m1, m2, m3 = _hb(s), _hb(s), _hb(s)
    v.open(m1)
    v.open(m3)
    v.open(m2)  # late but new: fine
    for m in (m1, m2, m3):
        with pytest.raises(AuthError, match="replayed"):
            v.open(m)
    old = _hb(s)
    for _ in range(10):
        v.open(_hb(s))
    with pytest.raises(AuthError, match="replayed"):  # fell out of the window: refused
        v.open(old)
    assert v.stats.replayed == 4


def test_new_incarnation_replaces_old_and_old_is_refused() -> None:
    v = Verifier(KEY)
    old, new = Signer(KEY, 2, 1), Signer(KEY, 2, 2)
    v.open(_hb(old))
    v.open(_hb(new))
    with pytest.raises(AuthError, match="stale_incarnation"):
        v.open(_hb(old))


@pytest.mark.parametrize("auth", [b"", b"LMR1", b"XXXX" + b"\0" * 60, b"\xff" * 200])
def test_garbage_auth_frames_rejected(auth: bytes) -> None:
    with pytest.raises(AuthError):
        Verifier(KEY).open([auth, b"header"])


def test_short_key_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        Signer(b"short", 0, 1)
