import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import InvalidArgument, InvalidKey
from kvstore.keys import MAX_KEY_BYTES, block_keys, checksum, tail_key, validate_key


def test_one_key_per_full_block_and_none_for_the_tail() -> None:
    assert len(block_keys(list(range(10)), 4)) == 2
    assert block_keys(list(range(3)), 4) == []
    assert block_keys([], 4) == []


def test_keys_are_32_hex_digits_and_deterministic() -> None:
    keys = block_keys(list(range(64)), 16, "model-a")
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
    assert keys == block_keys(list(range(64)), 16, "model-a")
    # A fixed value: the chain must never change across releases or machines.
    assert block_keys([1, 2, 3, 4], 4, "") == block_keys(np.array([1, 2, 3, 4], dtype=np.int16), 4)


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
    assert tail is not None and len(tail) == 32
    assert tail == tail_key(np.array(tokens, dtype=np.int64), 4, "ns")
    assert tail not in block_keys([*tokens, 99, 98], 4, "ns")  # never a full block's key
    assert tail_key(tokens[:8], 4, "ns") is None  # no partial block
    assert tail_key([*tokens[:9], 77], 4, "ns") != tail  # other tail tokens
    assert tail_key([1, *tokens[1:]], 4, "ns") != tail  # other prefix
    assert tail_key(tokens, 4, "other") != tail
    assert tail_key(tokens[:3], 4, "ns") is not None  # a prompt shorter than one block has a tail too
    with pytest.raises(InvalidArgument):
        tail_key(tokens, 0)
