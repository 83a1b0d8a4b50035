"""``--out``: an empty one, one inside another run (``<run>/checkpoints``) and a non-empty directory
that is not a run are refused before anything loads (the last unless ``--allow-nonempty-out``); a
disk that cannot hold the next checkpoint is refused at start with the sizes, not found at the
first save, and one that cannot hold ``--keep-last`` of them is warned about. The run's file names
are written in dflash/run/layout.py only, which lists a run's steps and finds the run of a directory."""

import ast
import logging
from collections import namedtuple
from pathlib import Path

import pytest
from tiny import inputs_config, training_inputs

import dflash
import dflash.run.layout
from dflash.config import TrainConfig
from dflash.run.layout import (
    CHECKPOINT_OVERHEAD,
    LATEST_NAME,
    SAVED_CONFIG_NAME,
    checkpoint_bytes,
    checkpoints_dir,
    holds_run,
    run_of,
    saved_steps,
)
from dflash.run.preflight import validate_inputs
from dflash.run.settle import settle
from dflash.train.trainer import Trainer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return training_inputs(tmp_path_factory.mktemp("run-dir"))


_config = inputs_config


def test_an_empty_out_is_refused():
    from dflash.cli import main

    with pytest.raises(ValueError, match="out must name a directory, got an empty one"):
        TrainConfig(out="")
    assert main(["train", "--out", "", "--steps", "1"]) == 2


def test_an_out_inside_another_run_is_refused(assets, tmp_path):
    Trainer(settle(_config(assets, tmp_path / "run", steps=1))).train()
    for inside in (tmp_path / "run" / "checkpoints", tmp_path / "run" / "deeper" / "out"):
        with pytest.raises(ValueError, match=f"--out {inside} is inside the run {tmp_path / 'run'}: .*--out "):
            validate_inputs(_config(assets, inside))


def test_a_directory_with_other_files_is_refused_unless_asked_for(assets, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    for name in ("notes.txt", "photos", "thesis.tex", "a.py"):
        (home / name).write_text("mine")
    with pytest.raises(
        ValueError, match=r"already holds files that are not a run's \(a\.py, notes\.txt, photos and 1 "
    ):
        validate_inputs(_config(assets, home))
    validate_inputs(_config(assets, home, allow_nonempty_out=True))
    # A run's own files (one stopped before its first checkpoint) are not other files.
    stopped = tmp_path / "stopped"
    for name in ("tokenized", "regenerated_train.jsonl.shard-0-of-1.partial", "metrics.jsonl", ".tmp-x"):
        (stopped / name).parent.mkdir(parents=True, exist_ok=True)
        (stopped / name).write_text("")
    validate_inputs(_config(assets, stopped))


Usage = namedtuple("Usage", "total used free")


def test_a_disk_that_cannot_hold_the_next_checkpoint_is_refused_at_start(assets, tmp_path, monkeypatch):
    trainer = Trainer(settle(_config(assets, tmp_path / "measured", steps=1, save_every=1)))
    trainer.train()
    step_dir = tmp_path / "measured" / "checkpoints" / "step_00000001"
    written = sum(p.stat().st_size for p in step_dir.iterdir())
    estimate = trainer._checkpoint_size(trainer.drafter)
    assert written <= estimate <= written + CHECKPOINT_OVERHEAD  # the tensors to the byte, the rest bounded

    monkeypatch.setattr(dflash.run.layout.shutil, "disk_usage", lambda path: Usage(10**12, 10**12, estimate - 1))
    with pytest.raises(ValueError, match=r"MB free, but a checkpoint of this run takes about .* MB: the first save"):
        Trainer(settle(_config(assets, tmp_path / "full", steps=2)))  # refused while it is built: before any step
    Trainer(settle(_config(assets, tmp_path / "nosave", steps=2, save=False)))  # nothing to save: no check


def test_a_disk_that_holds_fewer_than_keep_last_checkpoints_is_warned_about(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dflash.run.layout.shutil, "disk_usage", lambda path: Usage(10**12, 10**12, 25 * 10**8))
    with caplog.at_level(logging.WARNING, logger="dflash.run.layout"):
        dflash.run.layout.check_free_space(tmp_path, checkpoint_size=10**9, keep_last=3)
    assert (
        "2.5 GB free, a checkpoint takes about 1.0 GB and --keep-last 3 keeps 3 of them (plus the one being "
        "written): the disk fills after 2 more save(s)"
    ) in caplog.text
    assert "or pass --keep-last 1" in caplog.text
    assert checkpoint_bytes(10**9, export_itemsize=2) == 14 * 10**9 + CHECKPOINT_OVERHEAD  # bf16: fp32 master kept


def _string_constants(tree):
    """The string literals of a module, its docstrings left out."""
    documented = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, documented) and node.body and isinstance(node.body[0], ast.Expr)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_a_run_file_name_is_written_in_the_layout_only():
    """``"checkpoints"`` was written 13 times beside ``CHECKPOINTS_DIR``: one rename and the run's
    readers and writers disagree."""
    names = {v for k, v in vars(dflash.run.layout).items() if k.isupper() and isinstance(v, str)}
    assert {"checkpoints", "latest", "train_config.json", "manifest.json", "train.lock"} <= names
    package = Path(dflash.__file__).parent
    layout = Path(dflash.run.layout.__file__)
    written = [
        f"{path.relative_to(package)}:{node.lineno} {node.value!r}"
        for path in package.rglob("*.py")
        if path != layout
        for node in _string_constants(ast.parse(path.read_text()))
        if node.value in names
    ]
    assert not written


def test_the_steps_and_the_run_of_a_directory(tmp_path):
    run = tmp_path / "run"
    checkpoints = checkpoints_dir(run)
    for name in ("step_00000002", "step_00000010", "step_00000011.tmp"):
        (checkpoints / name).mkdir(parents=True)
    (checkpoints / LATEST_NAME).write_text("step_00000010\n")
    (checkpoints / "step_00000003").write_text("a file, not a step directory")
    assert [p.name for p in saved_steps(run)] == ["step_00000002", "step_00000010"]
    for inside in (run, checkpoints, checkpoints / "step_00000010", checkpoints / "step_00000011.tmp"):
        assert run_of(inside) == run
    shipped = tmp_path / "shipped" / "my-dflash"
    shipped.mkdir(parents=True)
    assert run_of(shipped) is None and saved_steps(shipped) == [] and not holds_run(shipped)
    (tmp_path / "young").mkdir()
    (tmp_path / "young" / SAVED_CONFIG_NAME).write_text("{}")  # a run before its first checkpoint
    assert run_of(tmp_path / "young") == tmp_path / "young"
