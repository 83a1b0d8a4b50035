"""Elastic resume: ``dflash train --resume`` under another device layout continues exactly when a
step's rows can be kept (``--grad-accum`` adjusted), says what changed, and refuses with the
reason and the fix when they cannot. CPU "devices": threaded (``cpu:0-1``) -> one device and back,
each equal bit for bit to the run that never stopped. The resume rules live in ``dflash.run.resume``,
which ``dflash.run.preflight`` imports instead of the trainer (tests/integration/test_preflight_imports.py)."""

import json
import logging

import pytest
from safetensors.torch import load_file
from tiny import record_losses, train_config, training_inputs

from dflash.drafter.files import CheckpointError
from dflash.run.resume import check_process_count, check_resume_config, resumed_values
from dflash.run.settle import settle
from dflash.train.trainer import Trainer

THREADED = dict(target_devices="cpu", drafter_devices="cpu:0-1", grad_accum=1)
LOCAL = dict(device="cpu", grad_accum=2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return training_inputs(tmp_path_factory.mktemp("elastic"))


def _trainer(assets, out, **layout):
    return Trainer(settle(train_config(target=assets["target"], data=assets["data"], out=out, save_every=3, **layout)))


def _final(out):
    """(the last checkpoint's weights, the loss of every logged step)."""
    weights = load_file(out / "checkpoints" / "step_00000006" / "model.safetensors")
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return weights, losses


def _stop_after_3(assets, out, **layout):
    """A 6-step run killed after its step-3 checkpoint (what a preempted job leaves)."""
    trainer = record_losses(_trainer(assets, out, **layout), crash_after=3)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()


@pytest.mark.parametrize(
    "first, then, flags",
    [
        (THREADED, LOCAL, ["--device", "cpu"]),
        (LOCAL, THREADED, ["--target-devices", "cpu", "--drafter-devices", "cpu:0-1"]),
    ],
    ids=["threaded-to-local", "local-to-threaded"],
)
def test_a_resume_under_another_layout_continues_exactly(assets, tmp_path, caplog, monkeypatch, first, then, flags):
    from dflash.cli import main

    monkeypatch.setattr("dflash.devices.usable_cores", lambda: 2)  # two drafter threads on any host
    _trainer(assets, tmp_path / "reference", **first).train()
    _stop_after_3(assets, tmp_path / "run", **first)
    with caplog.at_level(logging.INFO, logger="dflash.run.resume"):
        assert main(["train", "--resume", "--out", str(tmp_path / "run"), *flags, "--no-progress"]) == 0
    assert "resuming under another layout: " in caplog.text
    assert "the same 4 rows per process in the same order, so the run continues with the same batches" in caplog.text
    assert f"--grad-accum {then['grad_accum']} x " in caplog.text
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["grad_accum"] == then["grad_accum"]
    (reference, reference_losses), (resumed, resumed_losses) = _final(tmp_path / "reference"), _final(tmp_path / "run")
    assert resumed_losses == reference_losses  # bitwise: the same batches, anchors and gradient sums
    assert reference.keys() == resumed.keys() and all((reference[k] == resumed[k]).all() for k in reference)


def test_a_layout_that_cannot_keep_a_step_is_refused_with_the_fix(assets, tmp_path, monkeypatch):
    monkeypatch.setattr("dflash.devices.usable_cores", lambda: 4)
    _stop_after_3(assets, tmp_path, **THREADED)
    saved = json.loads((tmp_path / "train_config.json").read_text())
    given = {"resume": True, "out": str(tmp_path), "drafter_devices": "cpu:0-2"}
    with pytest.raises(CheckpointError) as raised:
        Trainer(settle(train_config(**resumed_values(saved, given))))
    assert (
        "a step of this run trains on 4 rows per process (--batch-size 2 x --grad-accum 1 x 2 drafter replicas on "
        "cpu:0-1), the resumed layout on 6 (--batch-size 2 x --grad-accum 1 x 3 drafter replicas on cpu:0-2)"
    ) in str(raised.value)
    assert "use 1 or 2 drafter device(s)" in str(raised.value)
    local = {"resume": True, "out": str(tmp_path), "device": "cpu"}
    with pytest.raises(CheckpointError, match=r"pass --grad-accum 2 \(or leave it out\)"):
        Trainer(settle(train_config(**resumed_values(saved, {**local, "grad_accum": 3}))))
    varied = {**saved, "vary_seq_len": 2}
    with pytest.raises(CheckpointError, match="--vary-seq-len 2 cycles the sequence lengths per drafter replica"):
        check_resume_config(varied, train_config(**resumed_values(varied, local)), tmp_path)


def test_another_process_count_is_refused_with_the_reason(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"own shard of the data with its own anchor stream .* resume with 2 torch"
    ):
        check_process_count(2, 1, tmp_path)
    check_process_count(2, 2, tmp_path)
