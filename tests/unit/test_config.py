from pathlib import Path

import pytest
from pydantic import ValidationError

from kvstore.config import (
    ClientConfig,
    ConductorConfig,
    DaemonConfig,
    DramConfig,
    EvictionConfig,
    MasterConfig,
    NodeConfig,
    SsdConfig,
    format_size,
    load,
    parse_size,
)
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
    with pytest.raises(ValidationError):  # assigning is a bug in the caller, not a bad setting
        config.dram.capacity = 1  # type: ignore[misc]
    with pytest.raises(ConfigError, match="capacty=5: unknown setting"):
        DramConfig(capacty=5)  # type: ignore[call-arg]


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match="path is required"):
        SsdConfig(capacity="1GiB")
    with pytest.raises(ConfigError, match=r"eviction: low_watermark \(0.6\) must not exceed"):
        NodeConfig(eviction={"high_watermark": 0.5, "low_watermark": 0.6})
    with pytest.raises(ConfigError, match="power of two, got 96"):
        DramConfig(alignment=96)
    with pytest.raises(ConfigError, match=r"name='\.\./etc': String should match pattern"):
        DramConfig(name="../etc")


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ClientConfig(timeout_s=-1), r"invalid ClientConfig: timeout_s=-1: .*greater than 0"),
        (lambda: ClientConfig(replicas=0), "replicas=0"),
        (lambda: ClientConfig(transport="carrier-pigeon"), "transport='carrier-pigeon'"),
        (lambda: ClientConfig(slice_bytes="12XB"), r"slice_bytes='12XB': size '12XB' is not a number"),
        (lambda: MasterConfig(port=70000), "port=70000"),
        (lambda: MasterConfig(node_ttl_ms=300, heartbeat_interval_ms=200), r"node_ttl_ms \(300\) must be at least two"),
        (lambda: DaemonConfig(dram={"capacity": 0}), r"invalid DaemonConfig: dram.capacity=0"),
        (lambda: EvictionConfig(high_watermark=2), "high_watermark=2"),
        (lambda: NodeConfig(ssd={"capacity": -1}), r"ssd.capacity=-1: size must not be negative"),
        (lambda: ConductorConfig(decode=["http://d"]), "at least one prefill and one decode worker"),
        (lambda: ConductorConfig(prefill=[], decode=["http://d"]), "at least one prefill and one decode worker"),
        (lambda: ConductorConfig(prefill=["http://p"], openai=["http://o"]), "or OpenAI servers, not both"),
        (lambda: ClientConfig.model_validate({"timeout_s": "soon"}), "timeout_s='soon'"),
        (lambda: ClientConfig.model_validate_json('{"timeout_s": -1}'), "timeout_s=-1"),
        (lambda: ClientConfig.model_validate_strings({"replicas": "0"}), "replicas='0'"),
    ],
)
def test_every_model_and_every_way_of_building_one_raises_config_error(build: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        build()  # type: ignore[operator]
    assert isinstance(caught.value, InvalidArgument) and not isinstance(caught.value, ValidationError)


def test_a_config_error_names_every_bad_setting() -> None:
    with pytest.raises(ConfigError) as caught:
        ClientConfig(timeout_s=0, replicas=99, bogus=1)  # type: ignore[call-arg]
    message = str(caught.value)
    assert "timeout_s=0" in message and "replicas=99" in message and "bogus=1: unknown setting" in message


def test_valid_nested_models_pass_through() -> None:
    dram = DramConfig(capacity="8MiB")
    assert NodeConfig(dram=dram).dram == dram
    assert NodeConfig.model_validate({"dram": {"capacity": "8MiB"}}).dram == dram


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


def test_load_names_keyword_settings_by_their_path_and_value() -> None:
    with pytest.raises(ConfigError, match=r"invalid client config: timeout_s=-1"):
        load(ClientConfig, "client", environ={}, timeout_s=-1)
    with pytest.raises(ConfigError, match=r"KVSTORE_MASTER_PORT='x'"):
        load(MasterConfig, "master", environ={"KVSTORE_MASTER_PORT": "x"})
