"""The loss-type registry: every row resolves to registered functions, the sets derived from it,
LossSettings built from a config, and the two ways of passing settings to policy_loss."""

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.config.grpo_config import GRPOConfig
from grpo_lab.ops import (
    CLIP_LOSSES,
    GLOBAL_NORMALIZER_LOSSES,
    LOSS_AGGREGATIONS,
    LOSS_TYPES,
    LOSSES,
    OBJECTIVES,
    LossSettings,
    clip_diagnostics,
    policy_loss,
)
from grpo_lab.ops.losses import CLIP_MASKS
from grpo_lab.ops.registry import CLIPPINGS


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_row_names_registered_functions(loss_type):
    spec = LOSSES[loss_type]
    assert spec.objective in OBJECTIVES
    assert spec.aggregation in LOSS_AGGREGATIONS
    assert spec.clipping in CLIPPINGS
    assert (spec.clipping in CLIP_MASKS) == (spec.clipping != "none")
    assert spec.clipping == "surrogate" or spec.instead_of_clipping  # the config's error needs the words


def test_derived_names_are_the_ones_grpo_lab_has_always_had():
    assert LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
    assert CLIP_LOSSES == ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
    assert GLOBAL_NORMALIZER_LOSSES == {"dapo", "cispo", "vespo"}


def test_epsilon_high_falls_back_to_epsilon_low():
    assert LossSettings(epsilon_low=0.3).epsilon_high == 0.3
    assert LossSettings(epsilon_low=0.3, epsilon_high=0.28).epsilon_high == 0.28


def test_settings_from_config_read_every_field_by_name():
    config = GRPOConfig(output_dir="unused", loss_type="vespo", epsilon=0.1, beta=0.04, vespo_k_neg=4.0,
                        importance_sampling_level="sequence", max_completion_length=7, use_bias_correction_kl=True)
    settings = LossSettings.from_config(config)
    assert settings.epsilon_low == 0.1 and settings.epsilon_high == 0.1  # None in the config: epsilon
    for field in dataclasses.fields(LossSettings):
        if field.name not in ("epsilon_low", "epsilon_high"):
            assert getattr(settings, field.name) == getattr(config, field.name), field.name


def test_policy_loss_takes_settings_or_their_fields_as_keywords():
    logprobs_BT = torch.tensor([[-0.5, -1.0], [-0.7, -1.2]], dtype=torch.float64)
    old_BT = logprobs_BT - torch.tensor([[0.1, -0.3], [0.0, 0.4]], dtype=torch.float64)
    advantages_B, mask_BT = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.ones(2, 2)
    fields = {"loss_type": "bnpo", "epsilon_low": 0.2, "epsilon_high": 0.28, "delta": 1.3}
    by_keywords = policy_loss(logprobs_BT, old_BT, advantages_B, mask_BT, **fields)
    by_settings = policy_loss(logprobs_BT, old_BT, advantages_B, mask_BT, settings=LossSettings(**fields))
    assert_close(by_settings.loss, by_keywords.loss, rtol=0, atol=0)
    with pytest.raises(TypeError, match="not both"):
        policy_loss(logprobs_BT, old_BT, advantages_B, mask_BT, settings=LossSettings(**fields), beta=0.1)


def test_unknown_loss_type_raises_in_the_loss_and_clips_nothing_in_diagnostics():
    with pytest.raises(ValueError, match="Unknown loss_type 'ppo'"):
        policy_loss(torch.zeros(1, 2), None, torch.ones(1), torch.ones(1, 2), loss_type="ppo")
    diagnostics = clip_diagnostics(torch.full((1, 2), 9.0), torch.ones(1), torch.ones(1, 2),
                                   epsilon_low=0.2, epsilon_high=0.2, loss_type="ppo")
    assert not diagnostics.is_region_clipped_BT.any()


def test_the_config_reads_the_registry_without_loading_torch():
    code = ("import sys; from grpo_lab.config.grpo_config import GRPOConfig; "
            "GRPOConfig(output_dir='unused', loss_type='cispo', "
            "epsilon_high=5.0); assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
