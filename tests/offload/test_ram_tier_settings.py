"""The RAM tier's policy settings: unset means TierPolicy's defaults, which the README's table states; each set one
reaches its field; a value out of range is refused naming the setting."""

import pytest

from glm53 import config
from glm53.offload.ram_tier import TierPolicy

FIELDS = [("ram_tier_decay", "decay"), ("ram_tier_hysteresis", "hysteresis"), ("ram_tier_recency_weight", "recency_weight"),
          ("ram_tier_vram_score", "vram_score"), ("ram_tier_exclusive", "exclusive")]
TYPED = {"exclusive": lambda text: text == "1"}  # the fields that are no float


def test_unset_settings_give_the_default_policy():
    assert TierPolicy.from_settings(config.load([], {})) == TierPolicy()


@pytest.mark.parametrize("name, field, value", [(n, f, v) for (n, f), v in zip(FIELDS, ("0.99", "2", "0", "0.5", "0"))])
def test_each_setting_reaches_its_field_alone(name, field, value):
    policy = TierPolicy.from_settings(config.load([], {config.env_var(name): value}))
    assert policy == TierPolicy(**{field: TYPED.get(field, float)(value)}) != TierPolicy()


def test_flags_override_the_environment():
    settings = config.load(["--ram-tier-decay", "0.995", "--ram-tier-recency-weight", "200"], {"GLM53_RAM_TIER_DECAY": "0.9"})
    assert TierPolicy.from_settings(settings) == TierPolicy(decay=0.995, recency_weight=200.0)


@pytest.mark.parametrize("name, field", FIELDS)
def test_the_shown_default_is_the_policys(name, field):
    shown = config.Settings.__dataclass_fields__[name].metadata["show_default"]
    assert shown.startswith("unset (") and TYPED.get(field, float)(shown[len("unset ("):-1]) == getattr(TierPolicy(), field)


@pytest.mark.parametrize("name, value", [("ram_tier_decay", "1.5"), ("ram_tier_decay", "0"), ("ram_tier_hysteresis", "0.9"),
                                         ("ram_tier_recency_weight", "-1"), ("ram_tier_vram_score", "2"), ("ram_tier_hysteresis", "inf"),
                                         ("ram_tier_exclusive", "maybe")])
def test_a_value_out_of_range_is_refused_naming_the_setting(name, value):
    with pytest.raises(config.ConfigError, match=config.env_var(name)):
        config.load([], {config.env_var(name): value})


def test_the_exclusive_settings_meaning_names_the_policys_steps():
    meaning = config.Settings.__dataclass_fields__["ram_tier_exclusive"].metadata["meaning"]
    assert f"for its last {TierPolicy().exclusive_after} decode steps" in meaning


def test_with_the_write_back_the_tier_is_exclusive_at_once():
    settings = config.load(["--ram-tier-write-back", "1"], {})
    assert TierPolicy.from_settings(settings) == TierPolicy(exclusive_after=1)
    assert TierPolicy.from_settings(config.load(["--ram-tier-write-back", "1", "--ram-tier-exclusive", "0"], {})).exclusive is False
