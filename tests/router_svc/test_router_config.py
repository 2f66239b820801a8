"""The router's configuration: every knob documented, flags and env, bad values refused."""

import pytest

from router_svc.config import RouterConfig
from services import settings
from tests.gateway.test_config import test_every_knob_is_documented_with_its_flag_and_env_var as check_documented


def test_every_router_knob_is_documented_with_its_flag_and_env_var():
    check_documented(RouterConfig)


def test_scaling_knobs_come_from_flags_and_env():
    config = settings.parse_config(RouterConfig, ["--member-id", "r0", "--scale-up-window-s", "2"],
                                   env={"MOEMESH_MAX_REPLICAS": "2", "MOEMESH_SCALE_UP_WINDOW_S": "9"})
    assert (config.scale_up_window_s, config.max_replicas) == (2.0, 2)
    assert config.policy.max_replicas == 2 and config.window_horizon_s == 600.0


@pytest.mark.parametrize("field,value,needle", [
    ("scale_up_hit_rate", 0.01, "scale_down_hit_rate < scale_up_hit_rate"),
    ("max_replicas", 0, "max_replicas must be >= 1, got 0"),
    ("policy_interval_s", -1.0, "policy_interval_s must be >= 0, got -1.0"),
    ("rebalance_min_gain", 1.0, "rebalance_min_gain must be in [0, 1), got 1.0"),
])
def test_bad_values_are_refused_naming_the_value(field, value, needle):
    with pytest.raises(ValueError) as err:
        RouterConfig(member_id="r0", **{field: value})
    assert needle in str(err.value)
