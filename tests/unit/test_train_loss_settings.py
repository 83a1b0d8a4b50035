"""The loss settings (dflash/train/loss_settings.py): built from the config alone, checked, frozen, and
the only place the loss functions read their settings from."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from tiny import loss_settings

from dflash.config import TrainConfig, paper_gamma
from dflash.train import loss, selector_loss, step
from dflash.train.loss_settings import LossSettings, position_weights

#: Every function the settings travel through on their way to the loss.
TAKE_SETTINGS = (loss.dflash_loss, loss.chunk_loss, step.drafter_forward_loss, step.drafter_step)
#: The names the loss's settings had as keyword arguments before they were one object.
SETTING_NAMES = {f.name for f in dataclasses.fields(LossSettings)} | {"chunk_blocks", "insert_gold"}


@pytest.mark.parametrize("function", TAKE_SETTINGS, ids=lambda f: f.__name__)
def test_the_loss_functions_take_the_settings_without_a_default(function):
    parameters = inspect.signature(function).parameters
    assert "settings" in parameters, f"{function.__name__} takes no LossSettings"
    assert parameters["settings"].default is inspect.Parameter.empty


@pytest.mark.parametrize("function", (*TAKE_SETTINGS, selector_loss.selector_loss), ids=lambda f: f.__name__)
def test_no_loss_function_has_a_setting_of_its_own(function):
    """A caller that leaves a setting out must not train another objective than ``dflash train``
    (``missing_gold`` defaulted to "exclude" in four signatures while the config said "insert")."""
    own = sorted(SETTING_NAMES & set(inspect.signature(function).parameters))
    assert not own, f"{function.__name__} takes loss settings of its own: {own}"


def test_the_settings_have_no_defaults_and_cannot_change():
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(LossSettings))
    settings = loss_settings(block_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.missing_gold = "exclude"


def test_the_settings_are_the_configs():
    config = TrainConfig(dpace=True, dpace_alpha=0.25, soft_label_weight=0.5, loss_chunk_blocks=3)
    settings = LossSettings.from_config(config, block_size=16, mask_token_id=9, selector=True)
    assert settings == LossSettings(
        mask_token_id=9,
        block_size=16,
        gamma=7.0,  # the paper's for block size 16
        soft_label_weight=0.5,
        position_weighting="dpace",
        dpace_alpha=0.25,
        chunk_blocks=3,
        selector_weight=config.selector_loss_weight,
        missing_gold=config.selector_missing_gold,
        selector_target=config.selector_target,
    )
    default = loss_settings(block_size=8)
    assert (default.missing_gold, default.position_weighting, default.gamma) == ("insert", "decay", 4.0)


def test_paper_gamma_and_position_weights():
    assert [paper_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    w = position_weights(16, 7.0)
    assert w.dtype == torch.float32 and w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[1:], torch.exp(-torch.arange(15.0) / 7.0))
    torch.testing.assert_close(position_weights(4, 2.0), torch.tensor([0, 1, math.exp(-0.5), math.exp(-1)]))
    with pytest.raises(ValueError, match=r"no decay for block size 12 .* pass --gamma"):
        loss_settings(block_size=12)
    assert loss_settings(block_size=12, gamma=6.0).gamma == 6.0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("position_weighting", "linear", "position_weighting must be one of decay, dpace; got 'linear'"),
        ("missing_gold", "swap", "missing_gold must be one of exclude, insert; got 'swap'"),
        ("dpace_alpha", 1.5, r"dpace_alpha must be in \[0, 1\]"),
        ("soft_label_weight", -0.1, r"soft_label_weight must be in \[0, 1\]"),
        ("chunk_blocks", 0, "chunk_blocks must be >= 1"),
        ("gamma", 0.0, "gamma must be > 0"),
        ("block_size", 1, "block_size must be >= 2"),
        ("selector_weight", -1.0, "selector_weight must be >= 0"),
    ],
)
def test_bad_settings_are_refused_when_built(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(loss_settings(block_size=8), **{field: value})


def test_the_soft_selector_target_reads_the_targets_last_hidden_state_only_with_a_selector():
    assert not loss_settings(block_size=8).needs_last_hidden
    assert loss_settings(block_size=8, selector_target="soft").needs_last_hidden
    assert not loss_settings(block_size=8, selector_target="soft", selector_loss_weight=0.0).needs_last_hidden
    dflash = loss_settings(block_size=8, selector_target="soft", selector=False)
    assert dflash.selector_target is None and not dflash.needs_last_hidden
