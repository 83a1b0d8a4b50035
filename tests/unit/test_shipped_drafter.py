"""dflash eval on a drafter stripped for serving (config.json, model.safetensors, modeling_dflash.py:
no training state, no manifest): it loads, verified against the manifest where there is one, with a
warning where there is none; an error never advises deleting the directory the user passed; and
``dflash train --resume`` stays strict. The last test runs ``dflash eval`` on a tiny target (~5 s).
"""

import logging
import shutil

import pytest
import torch
from tiny import make_target, save_random_drafter, write_chat_data

from dflash.drafter.files import WEIGHTS_NAME, CheckpointError
from dflash.drafter.hf_config import MODELING_FILE
from dflash.evaluation.measure import load_drafter
from dflash.run.checkpoint import STATE_NAME
from dflash.run.layout import MANIFEST_NAME
from dflash.run.step_dirs import find_checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(target directory, run directory holding one full checkpoint of a random drafter)."""
    root = tmp_path_factory.mktemp("shipped")
    target_dir = make_target(root / "target", num_layers=5)
    save_random_drafter(target_dir, root / "run", step=7)
    return target_dir, root / "run"


def _ship(run, to, *, drop):
    """A copy of the run's step directory as users ship it: without the files in ``drop``."""
    shipped = shutil.copytree(run / "checkpoints" / "step_00000007", to)
    for name in drop:
        (shipped / name).unlink()
    return shipped


@pytest.mark.parametrize(
    "drop", [(STATE_NAME,), (STATE_NAME, MANIFEST_NAME), (STATE_NAME, MANIFEST_NAME, MODELING_FILE)]
)
def test_a_stripped_drafter_loads_and_says_whether_it_was_verified(run, tmp_path, caplog, drop):
    shipped = _ship(run[1], tmp_path / "my-drafter", drop=drop)
    with caplog.at_level(logging.WARNING, logger="dflash.run"):
        drafter = load_drafter(shipped, device=torch.device("cpu"), dtype=torch.float32)
    assert drafter.config.block_size == 4
    unverified = f"{shipped} has no manifest.json (a drafter shipped without it): its files were not verified"
    assert (unverified in caplog.text) == (MANIFEST_NAME in drop)


def test_eval_verifies_only_what_it_reads_and_never_advises_deleting_the_passed_directory(run, tmp_path):
    shipped = _ship(run[1], tmp_path / "my-drafter", drop=(STATE_NAME,))
    weights = shipped / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.raises(CheckpointError) as raised:
        load_drafter(shipped, device=torch.device("cpu"), dtype=torch.float32)
    message = str(raised.value)
    assert f"{weights}: " in message and "cut short" in message and MANIFEST_NAME in message
    # Deleting the manifest (a hand edit on purpose) is advice; deleting the directory never is.
    assert "delete" not in message.replace(f"delete {shipped / MANIFEST_NAME}:", "")
    assert f"copy {shipped} again from where it came from, or pass another drafter directory" in str(raised.value)
    (shipped / MANIFEST_NAME).unlink()
    weights.unlink()
    with pytest.raises(CheckpointError, match=f"{weights}: missing; a drafter needs config.json and model.safetensors"):
        load_drafter(shipped, device=torch.device("cpu"), dtype=torch.float32)


def test_resume_still_needs_the_manifest_and_the_training_state(run, tmp_path):
    stripped = shutil.copytree(run[1], tmp_path / "run")
    step_dir = stripped / "checkpoints" / "step_00000007"
    (step_dir / STATE_NAME).unlink()
    with pytest.raises(
        CheckpointError, match=f"{step_dir / STATE_NAME}: missing from the checkpoint; delete {step_dir}"
    ):
        find_checkpoint(stripped)
    (step_dir / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing or unreadable"):
        find_checkpoint(stripped)


def test_dflash_eval_runs_on_a_shipped_drafter(run, tmp_path, capsys, caplog):
    from dflash.cli import main

    target_dir, run_dir = run
    shipped = _ship(run_dir, tmp_path / "my-drafter", drop=(STATE_NAME, MANIFEST_NAME, MODELING_FILE))
    data = write_chat_data(tmp_path / "heldout.jsonl", repeat=1)
    argv = ["eval", "--drafter", str(shipped), "--target", str(target_dir), "--data", str(data), "--device", "cpu"]
    assert main([*argv, "--num-prompts", "2", "--max-new-tokens", "4", "--cpu-threads", "1"]) == 0
    assert "acceptance length tau" in capsys.readouterr().out
    assert "its files were not verified" in caplog.text
