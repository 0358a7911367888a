"""The expert cache's policy settings: unset means the policy's defaults, which the README's table states."""

import pytest

from glm53 import config
from glm53.offload.cache import Policy


def test_unset_settings_give_the_default_policy():
    assert Policy.from_settings(config.load([], {})) == Policy()


def test_settings_override_decay_and_recency_weight():
    policy = Policy.from_settings(config.load([], {"GLM53_EC_DECAY": "0.995", "GLM53_EC_RECENCY_WEIGHT": "0"}))
    assert (policy.decay, policy.recency_weight) == (0.995, 0.0)
    assert policy.recency_decay == Policy().recency_decay


@pytest.mark.parametrize("name, field", [("ec_decay", "decay"), ("ec_hysteresis", "hysteresis"), ("ec_recency_weight", "recency_weight"),
                                         ("ec_warm_horizon", "warm_horizon")])
def test_the_shown_default_is_the_policys(name, field):
    shown = config.Settings.__dataclass_fields__[name].metadata
    text = next(v for v in shown.values() if isinstance(v, str) and v.startswith("unset ("))
    assert float(text[len("unset ("):-1]) == getattr(Policy(), field)


def test_a_decay_out_of_range_is_refused_naming_the_setting():
    with pytest.raises(config.ConfigError, match="GLM53_EC_DECAY"):
        config.load([], {"GLM53_EC_DECAY": "1.5"})


def test_the_warm_horizon_setting_caps_the_warm_start_and_is_checked():
    assert Policy.from_settings(config.load([], {"GLM53_EC_WARM_HORIZON": "100"})).warm_horizon == 100.0
    with pytest.raises(config.ConfigError, match="GLM53_EC_WARM_HORIZON"):
        config.load([], {"GLM53_EC_WARM_HORIZON": "0.5"})
    with pytest.raises(ValueError, match="warm_horizon"):
        Policy(warm_horizon=0.0)
