"""dflash.run.settle: a run's config is settled once, before torch is imported. ``dflash train``
resolves the drafter's shape once on a fresh start and once on a resumed one (the CLI, the input
checks, the Trainer and the checkpoint it loads used to resolve it up to 8 times), and a saved run's
shape is compared as saved, by the rule only where a run saved before the rule left it empty."""

import subprocess
import sys
import textwrap

import pytest
from tiny import TINY_TRAINING, train_config, training_inputs

import dflash.run.drafter_shape
from dflash.cli import main
from dflash.drafter.files import CheckpointError
from dflash.run.resume import check_resume_config
from dflash.run.settle import settle


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return training_inputs(tmp_path_factory.mktemp("settle"))


@pytest.fixture
def resolutions(monkeypatch):
    """How many times the drafter's shape was resolved, wherever a module holds the function."""
    original = dflash.run.drafter_shape.resolve_drafter_shape
    calls = []

    def counted(config):
        calls.append(config)
        return original(config)

    for module in [m for name, m in sys.modules.items() if name.startswith("dflash")]:
        if getattr(module, "resolve_drafter_shape", None) is original:
            monkeypatch.setattr(module, "resolve_drafter_shape", counted)
    return calls


def _train(inputs, out, *extra):
    flags = {**TINY_TRAINING, "target": inputs["target"], "data": inputs["data"], "out": out, "cpu_threads": 1}
    args = ["train"]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        args += [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    return main(args + list(extra))


def test_the_drafter_shape_is_resolved_once_on_a_fresh_and_on_a_resumed_start(inputs, tmp_path, resolutions):
    out = tmp_path / "run"
    assert _train(inputs, out, "--steps", "3") == 0
    assert len(resolutions) == 1
    resolutions.clear()
    assert _train(inputs, out, "--steps", "4", "--resume") == 0
    assert len(resolutions) == 1


def test_settling_imports_no_torch_before_the_device_checks(inputs, tmp_path):
    code = textwrap.dedent(f"""\
        import sys
        import dflash.cli, dflash.commands.train
        import dflash.run.preflight as preflight
        from dflash.config import TrainConfig
        from dflash.run.settle import settle
        preflight.check_devices = preflight.check_linear_attention_kernels = lambda *args: None
        settle(TrainConfig(target={str(inputs["target"])!r}, data={str(inputs["data"])!r},
                           out={str(tmp_path / "out")!r}, num_target_layers=2))
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "[]"


def test_a_shape_left_empty_by_a_run_saved_before_the_rule_is_compared_by_the_rule(inputs, tmp_path, resolutions):
    def settled(**values):
        return settle(train_config(target=inputs["target"], data=inputs["data"], out=tmp_path / "run", **values))

    by_the_rule = settled(block_size=None)
    check_resume_config(by_the_rule.to_dict(), by_the_rule, tmp_path)  # saved settled: compared as saved
    assert len(resolutions) == 1
    before_the_rule = {**by_the_rule.to_dict(), "block_size": None, "num_draft_layers": None}
    check_resume_config(before_the_rule, by_the_rule, tmp_path)  # filled by the rule, as the current one was
    with pytest.raises(CheckpointError, match=r"different config \(block_size: 8 -> 4"):
        check_resume_config(before_the_rule, settled(block_size=4), tmp_path)
