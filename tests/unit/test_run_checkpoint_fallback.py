"""A run whose ``checkpoints/latest`` is missing (or unusable) stays usable for eval and resume:
the newest complete step directory is taken, with a warning.

The last test trains, resumes and evaluates a tiny target through the CLI (~10 s).
"""

import logging
import shutil

import pytest
import torch
from tiny import make_target, write_chat_data

from dflash.drafter.files import CheckpointError
from dflash.run.checkpoint import save_checkpoint
from dflash.run.layout import MANIFEST_NAME
from dflash.run.step_dirs import find_checkpoint


def _save(out, step):
    return save_checkpoint(
        out,
        step,
        weights={"fc.weight": torch.full((2,), float(step))},
        drafter_config={"architectures": ["DFlashDraftModel"], "rope_parameters": {"rope_theta": 1e6}},
        training_state={"step": step},
        keep_last=3,
    )


def test_a_missing_latest_falls_back_to_the_newest_step(tmp_path, caplog):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    (tmp_path / "checkpoints" / "latest").unlink()
    with caplog.at_level(logging.WARNING, logger="dflash.run"):
        assert find_checkpoint(tmp_path) == newest
        assert find_checkpoint(tmp_path / "checkpoints") == newest
    # Said once: a resume looked it up four times (preflight, the resume check, the trainer) and warned each time.
    assert caplog.text.count("latest is missing; using the newest complete step, step_00000002") == 1


@pytest.mark.parametrize("latest", ["missing", "names a deleted step", "unreadable"])
def test_the_fallback_never_takes_a_half_written_save(tmp_path, latest, monkeypatch):
    complete = _save(tmp_path, 1)

    def killed(*args, **kwargs):  # the process dies while step 2 is being written
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2)
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / "step_00000002.tmp").is_dir()
    pointer = tmp_path / "checkpoints" / "latest"
    if latest == "missing":
        pointer.unlink()
    elif latest == "names a deleted step":
        pointer.write_text("step_00000003\n")
    else:
        pointer.write_bytes(b"\xff\xfe")
    assert find_checkpoint(tmp_path) == complete


def test_a_damaged_newest_step_is_reported_not_skipped(tmp_path):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    (newest / MANIFEST_NAME).unlink()
    (tmp_path / "checkpoints" / "latest").unlink()
    with pytest.raises(CheckpointError, match=f"{newest / MANIFEST_NAME}: missing or unreadable.*delete {newest}"):
        find_checkpoint(tmp_path)


def test_no_step_left_names_the_problem_and_the_fix(tmp_path):
    step = _save(tmp_path, 1)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000007\n")
    shutil.rmtree(step)
    with pytest.raises(CheckpointError, match="latest names step_00000007, which does not exist, and no other step"):
        find_checkpoint(tmp_path)


def test_eval_and_resume_work_after_latest_is_deleted(tmp_path, capsys):
    from dflash.cli import main

    target = make_target(tmp_path / "target", num_layers=5)
    data = write_chat_data(tmp_path / "train.jsonl", repeat=4)
    out = tmp_path / "run"
    flags = ["--target", str(target), "--data", str(data), "--out", str(out), "--block-size", "4", "--gamma", "2"]
    flags += ["--num-target-layers", "2", "--seq-len", "48", "--batch-size", "2", "--max-anchors", "4"]
    flags += ["--save-every", "1", "--no-progress", "--cpu-threads", "1"]
    assert main(["train", *flags, "--steps", "2"]) == 0
    (out / "checkpoints" / "latest").unlink()

    assert main(["eval", "--drafter", str(out), "--device", "cpu", "--num-prompts", "1", "--max-new-tokens", "4"]) == 0
    assert "acceptance length tau" in capsys.readouterr().out
    assert main(["train", *flags, "--steps", "3", "--resume"]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000003"
