"""Write ids (kvstore.write_ids): which put wrote a block."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.write_ids import MAX_WRITE_ID, check_write_id, check_write_ids, next_write_id, same_write


def test_each_put_draws_an_id_of_its_own() -> None:
    ids = [next_write_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids) and all(0 < i < MAX_WRITE_ID for i in ids)


def test_a_write_is_its_bytes_and_its_id_where_both_sides_know_one() -> None:
    assert same_write(5, 100, 5, 100)
    assert not same_write(5, 100, 6, 100)  # another put of the same bytes
    assert not same_write(5, 100, 5, 101)  # one put writes one value a key
    assert same_write(0, 100, 6, 100) and same_write(5, 100, 0, 100)  # an id unknown: by checksum
    assert not same_write(0, 100, 0, 101)


def test_ids_out_of_range_are_refused_by_name() -> None:
    assert check_write_id(0) == 0 and check_write_id(MAX_WRITE_ID - 1) == MAX_WRITE_ID - 1
    for bad in (-1, MAX_WRITE_ID, True, 1.0, "1"):
        with pytest.raises(InvalidArgument, match=r"PutEnd.write_id must be an int in \[0, 2\*\*64\)"):
            check_write_id(bad, "PutEnd.write_id")
    assert check_write_ids([], 3) == [0, 0, 0] and check_write_ids([1, 2], 2) == [1, 2]
    with pytest.raises(InvalidArgument, match=r"write_ids must be an int in \[0, 2\*\*64\), got -2"):
        check_write_ids([1, -2], 2)
    with pytest.raises(InvalidArgument, match="has 1 entries for 2 blocks"):
        check_write_ids([1], 2)
