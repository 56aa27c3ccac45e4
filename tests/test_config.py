import argparse
import math
import warnings

import pytest

from gputq.config import ConfigWarning, GputqConfig, add_transfer_queue_arguments
from gputq.errors import ConfigError


def _parse(argv):
    return add_transfer_queue_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_defaults_are_valid_and_offload_nothing():
    config = GputqConfig()
    assert config.transport == "auto"
    assert config.routed_experts_dtype == "int32"
    assert config.offloaded_fields == ()


def test_default_offload_follows_r3():
    assert GputqConfig(enabled=True).offloaded_fields == ("logprobs",)
    both = GputqConfig(enabled=True, use_rollout_routing_replay=True).offloaded_fields
    assert both == ("logprobs", "routed_experts")


def test_offloading_routed_experts_without_r3_is_refused():
    with pytest.raises(ValueError, match="use-rollout-routing-replay"):
        GputqConfig(enabled=True, transfer_params=("logprobs", "routed_experts"))
    args = _parse(["--enable-transfer-queue", "--transfer-params", "routed_experts"])
    with pytest.raises(ConfigError, match="flag --transfer-params: .*use-rollout-routing-replay"):
        GputqConfig.load(env={}, args=args)
    # Offload off: the list does not matter, nothing is offloaded.
    assert GputqConfig(transfer_params=("routed_experts",)).offloaded_fields == ()


def test_r3_and_params_may_come_from_different_layers(tmp_path):
    path = tmp_path / "tq.yaml"
    path.write_text("transfer_params: [routed_experts]\nenabled: true\n")
    config = GputqConfig.load(yaml_path=str(path), env={"GPUTQ_USE_ROLLOUT_ROUTING_REPLAY": "yes"})
    assert config.offloaded_fields == ("routed_experts",)


def test_precedence_yaml_env_flags(tmp_path):
    path = tmp_path / "tq.yaml"
    path.write_text("transport: rdma\nnum-units: 3\nrouted_experts_dtype: uint8\nput_timeout_s: 5\n")
    env = {"GPUTQ_TRANSPORT": "tcp", "GPUTQ_NUM_UNITS": "4", "UNRELATED": "x"}
    args = _parse(["--transfer-queue-config", str(path), "--routed-experts-dtype", "uint16",
                   "--enable-transfer-queue", "--use-rollout-routing-replay"])
    config = GputqConfig.load(env=env, args=args)
    assert config.transport == "tcp"            # env beats YAML
    assert config.num_units == 4                # env beats YAML
    assert config.routed_experts_dtype == "uint16"  # flag beats YAML
    assert config.put_timeout_s == 5.0          # YAML beats default
    assert config.enabled and config.use_rollout_routing_replay


def test_flags_left_unset_do_not_override():
    config = GputqConfig.load(env={"GPUTQ_ENABLED": "true"}, args=_parse([]))
    assert config.enabled is True


def test_transfer_params_flag_and_env():
    config = GputqConfig.load(env={}, args=_parse(["--enable-transfer-queue", "--transfer-params", "logprobs"]))
    assert config.transfer_params == ("logprobs",) and config.offloaded_fields == ("logprobs",)
    config = GputqConfig.load(env={"GPUTQ_TRANSFER_PARAMS": "routed_experts,logprobs"})
    assert config.transfer_params == ("routed_experts", "logprobs")


@pytest.mark.parametrize("changes, message", [
    ({"transport": "udp"}, "transport"),
    ({"routed_experts_dtype": "int8"}, "routed_experts_dtype"),
    ({"num_units": 0}, "num_units"),
    ({"restore_threads": 0}, "restore_threads must be >= 1, got 0"),
    ({"read_timeout_s": 0}, "read_timeout_s"),
    ({"reservation_timeout_s": 0}, "reservation_timeout_s"),
    ({"write_aging_s": -1}, "write_aging_s"),
    ({"transfer_params": ("tokens",)}, "tokens"),
])
def test_bad_values_raise_config_error(changes, message):
    with pytest.raises(ConfigError, match=message):
        GputqConfig(**changes)
    with pytest.raises(ValueError):
        GputqConfig(**changes)


def test_bad_environment_value_names_setting():
    with pytest.raises(ConfigError, match="environment variable GPUTQ_NUM_UNITS='many': num_units must be an integer"):
        GputqConfig.load(env={"GPUTQ_NUM_UNITS": "many"})
    with pytest.raises(ConfigError, match="GPUTQ_TRANSPORT='udp': transport must be one of"):
        GputqConfig.load(env={"GPUTQ_TRANSPORT": "udp"})


def test_unknown_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "tq.yaml"
    path.write_text("trasnport: tcp\n")
    with pytest.raises(ConfigError, match="unknown setting 'trasnport'; did you mean 'transport'"):
        GputqConfig.load(yaml_path=str(path), env={})


def test_with_token_generates_once():
    config = GputqConfig().with_token()
    assert config.token and len(config.token) == 32
    assert config.with_token().token == config.token


def test_malformed_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("transport: [tcp\nnum_units: 2\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML at line \d+"):
        GputqConfig.load(yaml_path=str(path), env={})


@pytest.mark.parametrize("text, message", [
    ("num_units: 2.5\n", "num_units: num_units must be an integer, got 2.5"),
    ("num_units: 2.0\n", "num_units must be an integer, got 2.0"),
    ("unit_capacity_bytes: 1e9\n", "unit_capacity_bytes must be an integer"),
    ("enabled: maybe\n", "enabled must be true or false, got 'maybe'"),
    ("enabled: 1\n", "enabled must be true or false, got 1"),
    ("use_rollout_routing_replay: 0.0\n", "use_rollout_routing_replay must be true or false"),
    ("put_timeout_s: fast\n", "put_timeout_s must be a number"),
    ("transfer_params: 3\n", "transfer_params must be a list"),
])
def test_yaml_values_are_typed_strictly_and_name_the_file(tmp_path, text, message):
    path = tmp_path / "tq.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"tq\\.yaml: .*{message}"):
        GputqConfig.load(yaml_path=str(path), env={})


def test_constructor_is_strict_too():
    with pytest.raises(ConfigError, match="num_units must be an integer, got 2.5"):
        GputqConfig(num_units=2.5)
    with pytest.raises(ConfigError, match="enabled must be true or false"):
        GputqConfig(enabled="yes")
    assert GputqConfig(put_timeout_s=5).put_timeout_s == 5.0


@pytest.mark.parametrize("value", ["2.5", "3.0", "0x10"])
def test_env_float_for_int_is_an_error(value):
    with pytest.raises(ConfigError, match=f"GPUTQ_WRITER_THREADS='{value}'"):
        GputqConfig.load(env={"GPUTQ_WRITER_THREADS": value})


def test_the_zero_copy_threshold_is_a_setting_like_any_other(tmp_path):
    # The operations guide tells users to set GPUTQ_ZERO_COPY_MAX_BYTES: it must not warn as unknown.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for text, value in (("0", 0.0), ("inf", math.inf), ("1048576", float(1 << 20))):
            assert GputqConfig.load(env={"GPUTQ_ZERO_COPY_MAX_BYTES": text}).zero_copy_max_bytes == value
    assert GputqConfig().zero_copy_max_bytes == math.inf  # every shard in place unless set
    (tmp_path / "gputq.yaml").write_text("zero_copy_max_bytes: 67108864\n")
    assert GputqConfig.load(yaml_path=str(tmp_path / "gputq.yaml"), env={}).zero_copy_max_bytes == 1 << 26
    for bad in ("lots", "-1", "nan"):
        with pytest.raises(ConfigError, match=f"GPUTQ_ZERO_COPY_MAX_BYTES='{bad}'"):
            GputqConfig.load(env={"GPUTQ_ZERO_COPY_MAX_BYTES": bad})


def test_unknown_env_variable_warns_with_closest_name():
    with pytest.warns(ConfigWarning, match="GPUTQ_TRANSPROT is not a gputq setting; did you mean GPUTQ_TRANSPORT"):
        config = GputqConfig.load(env={"GPUTQ_TRANSPROT": "tcp"})
    assert config.transport == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # variables read by other layers are not mistakes
        GputqConfig.load(env={"GPUTQ_RDMA_WRITE_PATH": "tcp", "GPUTQ_CONFIG": "", "GPUTQ_TOKEN": "t" * 16})


def test_token_is_redacted_and_checked():
    token = "s3cret-token-0123456789"
    config = GputqConfig(token=token)
    assert token not in repr(config) and "token='***'" in repr(config)
    assert config.to_dict()["token"] == "***"
    assert config.to_dict(include_secrets=True)["token"] == token
    assert token not in str(config.to_dict())
    with pytest.raises(ConfigError, match="at least 16 characters, got 5"):
        GputqConfig(token="short")
    with pytest.raises(ConfigError, match="environment variable GPUTQ_TOKEN: token must have"):
        GputqConfig.load(env={"GPUTQ_TOKEN": "short"})
    assert GputqConfig.load(env={"GPUTQ_TOKEN": token}).token == token


def test_field_registry_comes_from_config():
    registry = GputqConfig(routed_experts_dtype="uint8").field_registry(4, 2)
    assert registry.get("routed_experts").dtype == "uint8"
    assert registry.get("routed_experts").row_shape == (4, 2)
    assert registry.get("logprobs").dtype == "float32"


def test_packed_ids_name_num_experts_by_flag_env_or_megatrons_own_flag():
    config = GputqConfig.load(env={"GPUTQ_ROUTED_EXPERTS_DTYPE": "packed", "GPUTQ_NUM_EXPERTS": "384"})
    spec = config.field_registry(4, 8).get("routed_experts")
    assert (spec.dtype, spec.num_experts, spec.stored_shape) == ("uint8", 384, (4, 9))
    args = _parse(["--routed-experts-dtype", "auto", "--num-experts", "256"])
    assert GputqConfig.load(env={}, args=args).field_registry(4, 8).get("routed_experts").dtype == "uint8"
    # Megatron's parser has --num-experts already: gputq adds no second one and reads the model's value.
    megatron = argparse.ArgumentParser()
    megatron.add_argument("--num-experts", type=int, default=None)
    args = add_transfer_queue_arguments(megatron).parse_args(["--routed-experts-dtype", "packed", "--num-experts", "512"])
    assert GputqConfig.load(env={}, args=args).num_experts == 512
    with pytest.raises(ConfigError, match="flag --routed-experts-dtype: routed_experts_dtype 'packed' needs "
                                          "num_experts"):
        GputqConfig.load(env={}, args=_parse(["--routed-experts-dtype", "packed"]))
    with pytest.raises(ConfigError, match="at most 16 bits"):
        GputqConfig(routed_experts_dtype="packed", num_experts=1 << 17)
    with pytest.raises(ConfigError, match="num_experts must be >= 0"):
        GputqConfig(num_experts=-1)


def test_num_experts_bounds_whole_byte_ids_too():
    """The documented promise, "an ID at or above it is refused", holds for whole bytes: their spec carries it,
    and a format too narrow for the model's experts is refused at once (GLM-4.5's 160 fit uint8; 300 do not)."""
    config = GputqConfig.load(env={"GPUTQ_ROUTED_EXPERTS_DTYPE": "uint8", "GPUTQ_NUM_EXPERTS": "160"})
    assert config.field_registry(4, 8).get("routed_experts").id_limit == 160
    assert GputqConfig(routed_experts_dtype="uint16").field_registry(4, 8).get("routed_experts").id_limit == 0
    with pytest.raises(ConfigError, match="'uint8' holds IDs below 256: 300 experts need a wider one"):
        GputqConfig(routed_experts_dtype="uint8", num_experts=300)
    with pytest.raises(ConfigError, match="'uint16' holds IDs below 65536"):
        GputqConfig(routed_experts_dtype="uint16", num_experts=(1 << 16) + 1)


def test_metrics_port_setting():
    assert GputqConfig().metrics_port == 0
    assert GputqConfig.load(env={"GPUTQ_METRICS_PORT": "9400"}).metrics_port == 9400
    with pytest.raises(ConfigError, match="metrics_port"):
        GputqConfig(metrics_port=70000)


@pytest.mark.parametrize("line", ["token: 1234567890123456", "token: 12345678901234.5",
                                  "token: [1234567890123456]", "token: {k: 1234567890123456}"])
def test_a_token_of_the_wrong_type_is_never_echoed(tmp_path, line):
    """An unquoted numeric token in YAML is refused without its digits in the message."""
    path = tmp_path / "tq.yaml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=r"tq.yaml: token: token must be a string") as info:
        GputqConfig.load(yaml_path=str(path), env={})
    assert "1234567890123456" not in str(info.value) and "12345678901234" not in str(info.value)
    with pytest.raises(ConfigError, match="token must be a string") as info:
        GputqConfig(token=1234567890123456)
    assert "1234567890123456" not in str(info.value)
    with pytest.raises(ConfigError, match="token must be a string") as info:
        GputqConfig.from_mapping({"token": 1234567890123456})
    assert "1234567890123456" not in str(info.value)
