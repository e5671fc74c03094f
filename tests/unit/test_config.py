from pathlib import Path

import pytest
from pydantic import ValidationError

from kvstore.config import DramConfig, NodeConfig, SsdConfig, format_size, load, parse_size
from kvstore.errors import ConfigError, InvalidArgument


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("256MiB", 256 * 2**20),
        ("4GiB", 4 * 2**30),
        ("4 GiB", 4 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("64k", 64 * 1024),
        ("2T", 2 * 2**40),
        ("10b", 10),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "12XB", "-5MiB", "MiB", -1, True, 1.5, None, [1]])
def test_parse_size_rejects_bad_values(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_size(bad)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * 2**30) == "3.0 GiB"


def test_models_are_frozen_and_reject_unknown_keys() -> None:
    config = NodeConfig(dram={"capacity": "8MiB"})
    assert config.dram.capacity == 8 * 2**20
    with pytest.raises(ValidationError):
        config.dram.capacity = 1  # type: ignore[misc]
    with pytest.raises(ValidationError, match="capacty"):
        DramConfig(capacty=5)  # type: ignore[call-arg]


def test_cross_field_rules() -> None:
    with pytest.raises(ValidationError, match="path is required"):
        SsdConfig(capacity="1GiB")
    with pytest.raises(ValidationError, match="low_watermark"):
        NodeConfig(eviction={"high_watermark": 0.5, "low_watermark": 0.6})
    with pytest.raises(ValidationError, match="power of two"):
        DramConfig(alignment=96)
    with pytest.raises(ValidationError, match="pattern"):
        DramConfig(name="../etc")


def test_environment_overrides_nest_with_double_underscores(tmp_path: Path) -> None:
    env = {
        "KVSTORE_NODE_DRAM__CAPACITY": "32MiB",
        "KVSTORE_NODE_SSD__CAPACITY": "1GiB",
        "KVSTORE_NODE_SSD__PATH": str(tmp_path),
        "KVSTORE_NODE_VERIFY_READS": "true",
        "KVSTORE_OTHER_X": "ignored",
    }
    config = load(NodeConfig, "node", environ=env)
    assert config.dram.capacity == 32 * 2**20
    assert config.ssd.path == tmp_path
    assert config.verify_reads is True


def test_keyword_overrides_win_over_the_environment() -> None:
    config = load(NodeConfig, "node", environ={"KVSTORE_NODE_DRAM__CAPACITY": "32MiB"}, dram={"name": "x"})
    assert config.dram.capacity == 32 * 2**20 and config.dram.name == "x"
    config = load(NodeConfig, "node", environ={"KVSTORE_NODE_DRAM__CAPACITY": "32MiB"}, dram={"capacity": 1 << 20})
    assert config.dram.capacity == 1 << 20


def test_unknown_or_malformed_environment_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="KVSTORE_NODE_DRAM__CAPACITYX"):
        load(NodeConfig, "node", environ={"KVSTORE_NODE_DRAM__CAPACITYX": "1"})
    with pytest.raises(ConfigError, match=r"KVSTORE_NODE_DRAM__CAPACITY.*12XB"):
        load(NodeConfig, "node", environ={"KVSTORE_NODE_DRAM__CAPACITY": "12XB"})
    with pytest.raises(ConfigError, match="scalar"):
        load(NodeConfig, "node", environ={"KVSTORE_NODE_VERIFY_READS": "1", "KVSTORE_NODE_VERIFY_READS__X": "2"})
