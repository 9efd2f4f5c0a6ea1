"""The signer's MAC is HMAC-SHA256 byte for byte, and a frame it did not sign is never unpickled."""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine_core.workers.signing import BadSignature, Signer

pytestmark = pytest.mark.unit


@pytest.mark.deep
@given(key=st.binary(min_size=0, max_size=200), payload=st.binary(max_size=5000))
@example(key=b"", payload=b"x")
@example(key=b"k" * 64, payload=b"x")
@example(key=b"k" * 65, payload=b"")
@example(key=bytes(range(200)), payload=b"y" * 3000)
def test_mac_is_hmac_sha256(key: bytes, payload: bytes):
    # Keys shorter than, equal to and longer than SHA-256's 64-byte block: RFC 2104's three cases.
    assert Signer(key).mac(payload) == hmac.new(key, payload, hashlib.sha256).digest()


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 1 << 20])
def test_mac_of_every_size_and_a_memoryview(size: int):
    key = os.urandom(32)
    payload = os.urandom(size)
    expected = hmac.new(key, payload, hashlib.sha256).digest()
    signer = Signer(key)
    assert signer.mac(payload) == expected
    assert signer.mac(memoryview(payload)) == expected
    assert signer.mac(payload) == expected  # the padded states are copied, never consumed


def test_round_trip_and_rejections():
    key = os.urandom(32)
    signer = Signer(key)
    obj = (7, "execute_model", ({"a": [1, 2]},), None, 0)
    assert signer.loads(signer.dumps(obj)) == obj

    class Boom:
        def __reduce__(self):
            return (os.system, ("false",))  # what a forged pickle would run

    forged = pickle.dumps(Boom())
    with pytest.raises(BadSignature):
        signer.loads([Signer(os.urandom(32)).mac(forged), forged])  # another key's signature
    mac, payload = signer.dumps(obj)
    with pytest.raises(BadSignature):
        signer.loads([mac, payload + b"."])  # tampered
    with pytest.raises(BadSignature):
        signer.loads([payload])  # not [mac, payload]
    assert signer.rejected == 3
