"""``dflash eval`` decides from the drafter's and the target's config.json, before loading either,
whether the drafter fits the target (hidden size, layer count and ids, vocabulary), and says so in
terms of the models --drafter and --target name, with only flags eval has. It was "target_hidden
has 96 features, expected K*H = 64" after the target loaded, or a "--target-layer-ids" eval does not
take."""

import json
import re
import shutil

import pytest
from tiny import make_target, save_random_drafter

import dflash.commands.evaluate
import dflash.evaluation.measure
import dflash.target_model.files
import dflash.target_model.model
from dflash.drafter.files import CheckpointError, check_drafter_fits_target


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(target directory, run directory of a drafter trained for it: 5 layers, hidden 32, taps [1, 2])."""
    root = tmp_path_factory.mktemp("fit")
    target = make_target(root / "target", num_layers=5)
    save_random_drafter(target, root / "run")
    (root / "run" / "train_config.json").write_text(json.dumps({"target": str(target)}))
    return target, root / "run"


def _other_target(target, tmp_path, **changes):
    """A copy of ``target`` whose config.json says ``changes`` (never loaded: only its config is read)."""
    other = shutil.copytree(target, tmp_path / "other-target")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, **changes}))
    return other


def _eval_flags() -> set[str]:
    import argparse

    from dflash.commands import evaluate

    parser = argparse.ArgumentParser()
    evaluate.register(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["eval"]
    return {flag for action in sub._actions for flag in action.option_strings}


@pytest.fixture
def nothing_loads(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the configs were compared")

    # The command binds load_tokenizer at import: patch its name too, and import it before any patch
    # (top of file), so a first import under the patch cannot bind `fail` for later tests.
    for owner, name in (
        (dflash.target_model.model, "load_target"),
        (dflash.target_model.files, "load_tokenizer"),
        (dflash.commands.evaluate, "load_tokenizer"),
    ):
        monkeypatch.setattr(owner, name, fail)
    monkeypatch.setattr(dflash.evaluation.measure, "load_drafter", fail)


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"hidden_size": 48}, "the drafter reads hidden states of size 32, the target's are 48 (hidden_size)"),
        (
            {"num_hidden_layers": 2},
            "the drafter was trained on a 5-layer target and taps its layers [1, 2], the target has 2 decoder "
            "layers (num_hidden_layers)",
        ),
        ({"num_hidden_layers": 6}, "trained on a 5-layer target and taps its layers [1, 2], the target has 6"),
        ({"vocab_size": 151936}, "the drafter's vocabulary has 300 tokens, the target's 151936 (vocab_size"),
        ({"text_config": {"hidden_size": 64, "num_hidden_layers": 5, "vocab_size": 300}}, "the target's are 64"),
    ],
)
def test_eval_names_what_does_not_fit_before_loading_anything(run, tmp_path, caplog, nothing_loads, changes, said):
    from dflash.cli import main

    target, run_dir = run
    other = _other_target(target, tmp_path, **changes)
    assert main(["eval", "--drafter", str(run_dir), "--target", str(other), "--device", "cpu"]) == 2
    message = caplog.records[-1].getMessage()
    assert said in message
    assert f"does not fit the target {other}" in message
    assert f"pass --target with the target it was trained against (its run's train_config.json names {target})" in (
        message
    )
    assert set(re.findall(r"--[a-z][a-z-]+", message)) <= _eval_flags()


def test_a_shipped_drafter_without_its_geometry_is_refused(run, tmp_path):
    target, run_dir = run
    shipped = shutil.copytree(run_dir / "checkpoints" / "step_00000007", tmp_path / "shipped")
    (shipped / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    with pytest.raises(CheckpointError, match=r"has no hidden_size, num_target_layers, vocab_size, dflash_config"):
        check_drafter_fits_target(shipped, target)


def test_a_drafter_that_fits_passes_and_the_fix_names_no_run_for_a_shipped_one(run, tmp_path):
    target, run_dir = run
    step_dir = run_dir / "checkpoints" / "step_00000007"
    check_drafter_fits_target(step_dir, target)
    with pytest.raises(CheckpointError, match="pass --target with the model the drafter was trained for, or a "):
        check_drafter_fits_target(step_dir, _other_target(target, tmp_path, hidden_size=48))
