import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import InvalidArgument, InvalidKey
from kvstore.keys import (
    MAX_KEY_BYTES,
    MAX_NAMESPACE_BYTES,
    block_keys,
    checksum,
    key_digest,
    prefix_seed,
    tail_key,
    validate_key,
    validate_namespace,
)


def test_one_key_per_full_block_and_none_for_the_tail() -> None:
    assert len(block_keys(list(range(10)), 4)) == 2
    assert block_keys(list(range(3)), 4) == []
    assert block_keys([], 4) == []


def test_keys_are_the_namespace_then_32_hex_digits_and_deterministic() -> None:
    keys = block_keys(list(range(64)), 16, "model-a")
    assert all(k.startswith("model-a/") and len(k) == 8 + 32 and int(k[8:], 16) >= 0 for k in keys)
    assert keys == block_keys(list(range(64)), 16, "model-a")
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in block_keys(list(range(64)), 16))  # no namespace: bare hex
    assert block_keys([1, 2, 3, 4], 4, "") == block_keys(np.array([1, 2, 3, 4], dtype=np.int16), 4)


def test_fixed_values_never_change_across_releases_or_machines() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    assert block_keys(tokens, 4) == ["222d1959d5eeb67d35626369605823bd", "579a7435bb85dbbcda50d6f0e41e2d6a"]
    # The hex part is the chain of earlier releases; the namespace in front is the only change.
    assert block_keys(tokens, 4, "llama-3-8b/fp16") == [
        "llama-3-8b/fp16/b5a63e208a0bff05f3d5ccfbee78ea8d",
        "llama-3-8b/fp16/4f965e9ce22c56dacffe5d93d47ffea4",
    ]
    assert tail_key(tokens[:6], 4, "llama-3-8b/fp16") == "llama-3-8b/fp16/fce9d8f2caa8bb8c6ea1c1a5649b9a81"


def test_a_prefix_of_the_namespace_selects_exactly_its_keys() -> None:
    tokens = list(range(64))
    fp16, bf16 = block_keys(tokens, 8, "llama-3-8b/fp16"), block_keys(tokens, 8, "llama-3-8b/bf16")
    stored = sorted([*fp16, *bf16, *block_keys(tokens, 8, "llama-3-8b"), *block_keys(tokens, 8)])
    assert [k for k in stored if k.startswith("llama-3-8b/fp16/")] == sorted(fp16)
    assert {k for k in stored if k.startswith("llama-3-8b/")} >= {*fp16, *bf16}  # namespaces nest by "/"
    assert tail_key(tokens[:10], 8, "llama-3-8b/fp16").startswith("llama-3-8b/fp16/")  # type: ignore[union-attr]


def test_the_digest_of_a_key_is_its_chain_hash() -> None:
    keys = block_keys(list(range(16)), 8, "a/b")
    assert key_digest(keys[0]) == bytes.fromhex(keys[0][4:]) and len(key_digest(keys[1])) == 16
    assert key_digest(block_keys(list(range(8)), 8)[0]) == bytes.fromhex(block_keys(list(range(8)), 8)[0])
    for bad in ("ops-01", "a/" + "g" * 32, "a/" + "0" * 31, "a/" + "0" * 33, "a/ " + "0" * 30 + " "):
        with pytest.raises(InvalidKey, match="32 hex digits"):
            key_digest(bad)


def test_list_numpy_and_dtypes_agree() -> None:
    tokens = [5, 10, 2**20, 7, 0, 1, 2, 3]
    expected = block_keys(tokens, 4, "ns")
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        assert block_keys(np.array(tokens, dtype=dtype), 4, "ns") == expected
    assert block_keys(tuple(tokens), 4, "ns") == expected


def test_torch_tensors_agree_with_lists() -> None:
    torch = pytest.importorskip("torch")
    tokens = list(range(100, 164))
    assert block_keys(torch.tensor(tokens), 16) == block_keys(tokens, 16)


def test_namespace_and_block_size_separate_keys() -> None:
    tokens = list(range(32))
    assert block_keys(tokens, 8, "a") != block_keys(tokens, 8, "b")
    assert block_keys(tokens, 8)[1] != block_keys(tokens, 16)[0]
    # The namespace is hashed too: the hex part alone differs between namespaces.
    assert key_digest(block_keys(tokens, 8, "a")[0]) != key_digest(block_keys(tokens, 8, "b")[0])


def test_the_longest_namespace_makes_keys_of_the_longest_length() -> None:
    longest = "n" * MAX_NAMESPACE_BYTES
    (key,) = block_keys([1, 2], 2, longest)
    assert len(key.encode()) == MAX_KEY_BYTES and validate_key(key) == key
    wide = "é" * (MAX_NAMESPACE_BYTES // 2)  # two bytes of UTF-8 each
    assert len(block_keys([1, 2], 2, wide)[0].encode()) <= MAX_KEY_BYTES


@pytest.mark.parametrize(
    ("namespace", "match"),
    [
        ("n" * (MAX_NAMESPACE_BYTES + 1), f"{MAX_NAMESPACE_BYTES + 1} bytes of UTF-8, more than the limit of 223"),
        ("é" * (MAX_NAMESPACE_BYTES // 2 + 1), "224 bytes"),
        ("model\nother", r"control character '\\n'"),
        ("model\x00", "control character"),
        ("model\x85", "control character"),
        ("\ud800", "UTF-8"),
        ("llama/", "ends with '/'"),
        (b"llama", "must be str, not bytes"),
        (None, "not NoneType"),
    ],
)
def test_a_namespace_that_cannot_prefix_valid_keys_is_a_typed_error(namespace: object, match: str) -> None:
    for build in (block_keys, tail_key):
        with pytest.raises(InvalidKey, match=match):
            build([1, 2, 3], 2, namespace)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey, match=match):
        validate_namespace(namespace)
    with pytest.raises(InvalidArgument):  # InvalidKey is an InvalidArgument
        prefix_seed(2, namespace)  # type: ignore[arg-type]


@pytest.mark.parametrize("namespace", ["", "llama", "llama-3-8b/fp16", "/abs/path/model", "a b/c:d", "模型/fp16"])
def test_namespaces_with_any_printable_characters_are_kept_as_given(namespace: str) -> None:
    assert validate_namespace(namespace) == namespace
    (key,) = block_keys([1, 2], 2, namespace)
    assert key.startswith(f"{namespace}/" if namespace else "") and validate_key(key) == key


def test_tokens_beyond_int32_are_hashed_as_int64() -> None:
    small = block_keys([1, 2, 3, 4], 2)
    big = block_keys([1, 2, 3, 2**40], 2)
    assert small[0] == big[0] and small[1] != big[1]


@given(st.lists(st.integers(0, 2**40), max_size=80), st.integers(1, 9), st.integers(0, 80))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens: list[int], block_size: int, cut: int) -> None:
    full = block_keys(tokens, block_size)
    assert block_keys(tokens[:cut], block_size) == full[: min(cut, len(tokens)) // block_size]


@given(st.lists(st.integers(0, 1000), min_size=8, max_size=8), st.integers(0, 7))
def test_changing_one_token_changes_its_block_and_every_later_key(tokens: list[int], pos: int) -> None:
    other = list(tokens)
    other[pos] += 1
    a, b = block_keys(tokens, 2), block_keys(other, 2)
    assert a[: pos // 2] == b[: pos // 2]
    assert all(x != y for x, y in zip(a[pos // 2 :], b[pos // 2 :], strict=True))


@pytest.mark.parametrize(
    ("tokens", "block_size", "match"),
    [
        ([1, -2, 3], 1, "non-negative"),
        ([1.5, 2.0], 1, "integers"),
        ([True, False], 1, "integers"),
        (np.zeros((2, 2), dtype=np.int64), 2, "one-dimensional"),
        (np.array([1.0, 2.0]), 1, "dtype"),
        ("abc", 1, "list"),
        ([1, 2], 0, "block_size"),
        ([1, 2], "4", "block_size"),
        ([2**70], 1, "int64"),
    ],
)
def test_bad_token_input_is_a_typed_error(tokens: object, block_size: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        block_keys(tokens, block_size)  # type: ignore[arg-type]


def test_validate_key_accepts_str_and_utf8_bytes() -> None:
    assert validate_key("abc") == "abc"
    assert validate_key(b"abc") == "abc"
    assert validate_key("é" * (MAX_KEY_BYTES // 2)) == "é" * (MAX_KEY_BYTES // 2)
    assert validate_key("x" * MAX_KEY_BYTES) == "x" * MAX_KEY_BYTES


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("", "empty"),
        (b"", "empty"),
        ("x" * (MAX_KEY_BYTES + 1), "257 bytes"),
        ("é" * (MAX_KEY_BYTES // 2 + 1), "258 bytes"),
        (b"\xff\xfe", "UTF-8"),
        (12, "int"),
        (None, "NoneType"),
        ("\ud800", "UTF-8"),
    ],
)
def test_validate_key_rejects_bad_keys_naming_the_fault(key: object, match: str) -> None:
    with pytest.raises(InvalidKey, match=match):
        validate_key(key)


def test_checksum_accepts_any_buffer() -> None:
    data = bytes(range(256))
    assert checksum(data) == checksum(memoryview(data)) == checksum(np.frombuffer(data, dtype=np.uint8))  # type: ignore[arg-type]
    assert checksum(data) != checksum(data[:-1])


def test_tail_key_covers_the_partial_block_only() -> None:
    tokens = list(range(10))
    tail = tail_key(tokens, 4, "ns")
    assert tail is not None and tail.startswith("ns/") and len(tail) == 3 + 32
    assert len(tail_key(tokens, 4) or "") == 32
    assert tail == tail_key(np.array(tokens, dtype=np.int64), 4, "ns")
    assert tail not in block_keys([*tokens, 99, 98], 4, "ns")  # never a full block's key
    assert tail_key(tokens[:8], 4, "ns") is None  # no partial block
    assert tail_key([*tokens[:9], 77], 4, "ns") != tail  # other tail tokens
    assert tail_key([1, *tokens[1:]], 4, "ns") != tail  # other prefix
    assert tail_key(tokens, 4, "other") != tail
    assert tail_key(tokens[:3], 4, "ns") is not None  # a prompt shorter than one block has a tail too
    with pytest.raises(InvalidArgument):
        tail_key(tokens, 0)
