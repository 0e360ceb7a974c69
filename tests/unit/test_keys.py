import hashlib
import os
import subprocess
import sys
from array import array

import numpy as np
import pytest

from hicache.errors import InvalidArgument
from hicache.keys import (
    ROOT_PARENT_KEY,
    chain_page_keys,
    namespace_id,
    pack_tokens,
    page_keys,
    split_page_keys,
    unpack_tokens,
)

FINGERPRINT = bytes(range(16))


def test_namespace_vectors():
    # Pinned: changing these breaks every persisted disk tier.
    assert namespace_id(FINGERPRINT).hex() == "a10775ac74a90992fb52924ac9b95be6"
    assert namespace_id(FINGERPRINT, "tenant-a").hex() == "f93ff15b24178c9a167df1ee89104fc9"
    assert namespace_id(FINGERPRINT, b"tenant-a") == namespace_id(FINGERPRINT, "tenant-a")
    assert namespace_id(FINGERPRINT, None) == namespace_id(FINGERPRINT, b"")


def test_page_key_vectors():
    keys = page_keys(namespace_id(FINGERPRINT), list(range(12)), 4)
    assert [k.hex() for k in keys] == [
        "e0b40238051ce898e7b3864f4b29dd40",
        "5b1d1405ce29c01bc3c537ba173b6940",
        "9abc02bada8e2329115f466afe2a60f8",
    ]


def test_page_key_algorithm_as_documented():
    ns = namespace_id(FINGERPRINT, "lora-7")
    tokens = [5, 1_000, 127_999, 0, 42, 7]
    parent = bytes(16)
    expected = []
    for start in range(0, 6, 2):
        data = ns + parent + np.asarray(tokens[start : start + 2], dtype="<i4").tobytes()
        parent = hashlib.blake2b(data, digest_size=16, person=b"hicache.page.v1").digest()
        expected.append(parent)
    assert page_keys(ns, tokens, 2) == expected
    fp_len = len(FINGERPRINT).to_bytes(4, "little")
    extra = b"lora-7"
    ns_data = fp_len + FINGERPRINT + len(extra).to_bytes(4, "little") + extra
    assert ns == hashlib.blake2b(ns_data, digest_size=16, person=b"hicache.ns.v1").digest()


def test_namespaces_separate_fingerprint_and_extra_key():
    a = namespace_id(b"ab", b"c")
    b = namespace_id(b"a", b"bc")
    assert a != b, "length prefixes must keep concatenations apart"
    assert namespace_id(b"model-1") != namespace_id(b"model-2")
    assert namespace_id(b"model-1", "t1") != namespace_id(b"model-1", "t2")
    tokens = list(range(8))
    assert page_keys(namespace_id(b"m", "t1"), tokens, 4) != page_keys(namespace_id(b"m", "t2"), tokens, 4)


def test_page_keys_chain_the_whole_prefix():
    ns = namespace_id(FINGERPRINT)
    base = page_keys(ns, [1, 2, 3, 4, 5, 6], 3)
    changed_first = page_keys(ns, [9, 2, 3, 4, 5, 6], 3)
    assert base[0] != changed_first[0] and base[1] != changed_first[1]
    # Chaining in pieces equals hashing in one go.
    packed = pack_tokens([1, 2, 3, 4, 5, 6])
    first = chain_page_keys(ns, ROOT_PARENT_KEY, packed[:12], 3)
    second = chain_page_keys(ns, first, packed[12:], 3)
    assert split_page_keys(first + second) == base
    # A partial last page has no key.
    assert page_keys(ns, [1, 2, 3, 4, 5, 6, 7], 3) == base


def test_pack_tokens_accepts_every_input_form():
    expected = np.array([0, 1, 127_999, 2**31 - 1], dtype="<i4").tobytes()
    values = [0, 1, 127_999, 2**31 - 1]
    assert pack_tokens(values) == expected
    assert pack_tokens(tuple(values)) == expected
    assert pack_tokens(np.array(values, dtype=np.int64)) == expected
    assert pack_tokens(np.array(values, dtype=np.int32)) == expected
    assert pack_tokens(array("i", values)) == expected
    assert pack_tokens(expected) is expected
    assert pack_tokens(bytearray(expected)) == expected
    assert pack_tokens(memoryview(expected)) == expected
    assert pack_tokens([]) == b""
    assert unpack_tokens(expected).tolist() == values


@pytest.mark.parametrize(
    "bad",
    [b"\x00\x01\x02", np.zeros((2, 2), dtype=np.int32), np.array([1.5]), [2**31], [-(2**31) - 1]],
)
def test_pack_tokens_rejects_bad_input(bad):
    with pytest.raises(InvalidArgument):
        pack_tokens(bad)


def test_bad_namespace_and_chain_arguments():
    with pytest.raises(InvalidArgument):
        namespace_id(b"")
    with pytest.raises(InvalidArgument):
        namespace_id(FINGERPRINT, 3)  # type: ignore[arg-type]
    ns = namespace_id(FINGERPRINT)
    with pytest.raises(InvalidArgument):
        chain_page_keys(ns, ROOT_PARENT_KEY, pack_tokens([1, 2, 3]), 2)
    with pytest.raises(InvalidArgument):
        chain_page_keys(ns, b"short", pack_tokens([1, 2]), 2)


def test_page_keys_equal_across_processes():
    script = (
        "from hicache.keys import namespace_id, page_keys;"
        "ns = namespace_id(bytes(range(16)), 'tenant-a');"
        "print(','.join(k.hex() for k in page_keys(ns, list(range(100, 164)), 16)))"
    )
    ns = namespace_id(FINGERPRINT, "tenant-a")
    here = ",".join(k.hex() for k in page_keys(ns, list(range(100, 164)), 16))
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        outputs.add(done.stdout.strip())
    assert outputs == {here}
