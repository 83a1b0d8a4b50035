"""Held-out acceptance during a run trained from scratch (`--eval-data`, `--eval-every`): measured
before step 1, every N steps and after the last, as dflash eval measures it, into the log,
metrics.jsonl, TensorBoard and acceptance.json, without changing what the run trains; at
`--eval-temperature` sampled, as dflash eval --temperature measures it."""

from __future__ import annotations

import json

import pytest
from tiny import make_target, record_losses, train_config, write_chat_data

from dflash.run import acceptance_log
from dflash.run.layout import step_dir_name
from dflash.run.settle import settle
from dflash.train.trainer import Trainer


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("heldout")
    return {
        "target": make_target(root / "target", num_layers=5),
        "data": write_chat_data(root / "train.jsonl"),
        "heldout": write_chat_data(root / "heldout.jsonl", repeat=1),
    }


def _train(inputs, out, **values):
    trainer = record_losses(
        Trainer(settle(train_config(target=inputs["target"], data=inputs["data"], out=out, **values)))
    )
    trainer.train()
    return trainer


def test_a_scratch_run_measures_acceptance_every_n_steps_without_changing_its_training(inputs, tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    heldout = dict(eval_data=str(inputs["heldout"]), eval_prompts=2, eval_max_new_tokens=8, eval_every=2)
    with caplog.at_level("INFO", logger="dflash.train"):
        measured = _train(inputs, tmp_path / "measured", **heldout)
    plain = _train(inputs, tmp_path / "plain")
    assert measured.losses == plain.losses  # training waited, nothing it draws moved

    rows = [json.loads(line) for line in (tmp_path / "measured" / "metrics.jsonl").read_text().splitlines()]
    measurements = [row for row in rows if "heldout/tau_per_prompt" in row]
    assert [row["step"] for row in measurements] == [0, 2, 4, 6]  # before step 1, --eval-every 2, after the last
    assert all(row["heldout/tau_per_prompt"] >= 1 and row["heldout/mismatches"] == 0 for row in measurements)
    assert list(measured.acceptance) == ["before step 1", "at step 2", "at step 4", "after the last step"]
    assert caplog.text.count("held-out acceptance") == 4 and "% of the run's time so far" in caplog.text

    events = EventAccumulator(str(tmp_path / "measured" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("heldout/tau_per_prompt")] == [0, 2, 4, 6]

    log = acceptance_log.read(tmp_path / "measured")
    # --save-every 3: step 6's checkpoint is the last one; steps 2 and 4 have none.
    assert [m["checkpoint"] for m in log] == [None, None, None, step_dir_name(6)]
    assert {m["data"] for m in log} == {str(inputs["heldout"])}


def test_held_out_acceptance_is_measured_at_the_chosen_temperature(inputs, tmp_path, caplog):
    heldout = dict(eval_data=str(inputs["heldout"]), eval_prompts=2, eval_max_new_tokens=8, eval_temperature=1.0)
    with caplog.at_level("INFO", logger="dflash.train"):
        _train(inputs, tmp_path / "sampled", **heldout)
    assert caplog.text.count("held-out acceptance") == 2 and caplog.text.count("sampled at temperature 1:") == 2
    log = acceptance_log.read(tmp_path / "sampled")
    assert [m["decoding"] for m in log] == ["temperature 1", "temperature 1"]
    assert all(m["mismatches"] is None and set(m["intervals"]) >= {"tau_per_prompt"} for m in log)
    rows = [json.loads(line) for line in (tmp_path / "sampled" / "metrics.jsonl").read_text().splitlines()]
    measurements = [row for row in rows if "heldout/tau_per_prompt" in row]
    assert len(measurements) == 2 and not any("heldout/mismatches" in row for row in measurements)


def test_a_negative_held_out_temperature_is_refused():
    from dflash.config import TrainConfig

    with pytest.raises(ValueError, match=r"eval_temperature must be 0 \(greedy\) or a positive number, got -0.5"):
        TrainConfig(eval_temperature=-0.5)


def test_a_held_out_temperature_without_held_out_conversations_is_refused(tmp_path, caplog):
    """--eval-temperature alone was accepted and measured nothing."""
    from dflash.cli import main
    from dflash.config import TrainConfig

    assert main(["train", "--eval-temperature", "0.7", "--out", str(tmp_path / "x")]) == 2
    assert "--eval-temperature: held-out acceptance needs held-out conversations; pass --eval-data" in caplog.text
    assert TrainConfig(eval_temperature=0.7, eval_data=str(tmp_path / "heldout.jsonl")).eval_temperature == 0.7


def test_the_held_out_temperature_defaults_to_greedy():
    """dflash.config may not import dflash.evaluation (tests/unit/test_package_layout.py), so its
    default is written there again; this keeps it GREEDY's."""
    from dflash.config import TrainConfig
    from dflash.evaluation.sampling_settings import GREEDY

    assert TrainConfig.eval_temperature == GREEDY.temperature
