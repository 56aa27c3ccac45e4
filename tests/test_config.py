import argparse

import pytest

from gputq.config import GputqConfig, add_transfer_queue_arguments
from gputq.errors import ConfigError


def _parse(argv):
    return add_transfer_queue_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_defaults_are_valid_and_offload_nothing():
    config = GputqConfig()
    assert config.transport == "auto"
    assert config.routed_experts_dtype == "int32"
    assert config.offloaded_fields == ()


def test_routed_experts_need_r3():
    assert GputqConfig(enabled=True).offloaded_fields == ("logprobs",)
    both = GputqConfig(enabled=True, use_rollout_routing_replay=True).offloaded_fields
    assert both == ("logprobs", "routed_experts")


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
    config = GputqConfig.load(env={}, args=_parse(["--transfer-params", "logprobs"]))
    assert config.transfer_params == ("logprobs",)
    config = GputqConfig.load(env={"GPUTQ_TRANSFER_PARAMS": "routed_experts,logprobs"})
    assert config.transfer_params == ("routed_experts", "logprobs")


@pytest.mark.parametrize("changes, message", [
    ({"transport": "udp"}, "transport"),
    ({"routed_experts_dtype": "int8"}, "routed_experts_dtype"),
    ({"num_units": 0}, "num_units"),
    ({"read_timeout_s": 0}, "read_timeout_s"),
    ({"transfer_params": ("tokens",)}, "tokens"),
])
def test_bad_values_raise_config_error(changes, message):
    with pytest.raises(ConfigError, match=message):
        GputqConfig(**changes)
    with pytest.raises(ValueError):
        GputqConfig(**changes)


def test_bad_environment_value_names_setting():
    with pytest.raises(ConfigError, match="num_units"):
        GputqConfig.load(env={"GPUTQ_NUM_UNITS": "many"})


def test_unknown_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "tq.yaml"
    path.write_text("trasnport: tcp\n")
    with pytest.raises(ConfigError, match="trasnport"):
        GputqConfig.load(yaml_path=str(path), env={})


def test_with_token_generates_once():
    config = GputqConfig().with_token()
    assert config.token and len(config.token) == 32
    assert config.with_token().token == config.token
