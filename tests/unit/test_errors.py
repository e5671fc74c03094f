import pickle

import pytest

from kvstore import errors as E


def test_every_error_has_a_unique_code_and_round_trips_by_code() -> None:
    codes = [cls.code for cls in E.CODE_TO_ERROR.values()]
    assert len(codes) == len(set(codes))
    for code, cls in E.CODE_TO_ERROR.items():
        err = E.error_from_code(code, "boom")
        assert type(err) is cls and str(err) == "boom"


def test_unknown_code_becomes_the_root_error() -> None:
    err = E.error_from_code(999_999, "what")
    assert type(err) is E.KVStoreError


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (E.InvalidArgument, ValueError),
        (E.InvalidKey, ValueError),
        (E.BufferTooSmall, ValueError),
        (E.ConfigError, ValueError),
        (E.NotFound, KeyError),
        (E.Timeout, TimeoutError),
        (E.ConnectionFailed, ConnectionError),
        (E.StoreBusy, BlockingIOError),
    ],
)
def test_categories_also_inherit_builtins(cls: type[E.KVStoreError], builtin: type[Exception]) -> None:
    with pytest.raises(builtin):
        raise cls("x")
    with pytest.raises(E.KVStoreError):
        raise cls("x")


def test_errors_pickle_with_their_message() -> None:
    err = pickle.loads(pickle.dumps(E.NotFound("key 'a' missing")))
    assert type(err) is E.NotFound and str(err) == "key 'a' missing"
