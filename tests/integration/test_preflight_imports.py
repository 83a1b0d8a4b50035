"""Checks before slow work import no slow module: validating a new run's inputs imports no
transformers and is fast, and checking a resume imports no trainer (dflash/run/preflight.py). Each in
a fresh interpreter, where ``sys.modules`` shows what the checks themselves imported."""

import subprocess
import sys
import textwrap

from tiny import train_config, training_inputs

from dflash.run.settle import settle
from dflash.train.trainer import Trainer


def _run(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_validation_never_imports_transformers(tmp_path):
    inputs = training_inputs(tmp_path / "inputs")
    seconds, imported = _run(f"""\
        import sys, time
        import torch  # the device checks ask torch which devices exist: what is timed is the validation
        from dflash.config import TrainConfig
        from dflash.run.preflight import validate_inputs
        config = TrainConfig(target={str(inputs["target"])!r}, data={str(inputs["data"])!r},
                             out={str(tmp_path / "out")!r}, num_target_layers=2)
        start = time.perf_counter()
        validate_inputs(config)
        print(time.perf_counter() - start, "transformers" in sys.modules)
        """)
    assert imported == "False" and float(seconds) < 0.5


def test_preflight_checks_a_resume_without_importing_the_trainer(tmp_path):
    inputs = training_inputs(tmp_path / "inputs")
    Trainer(settle(train_config(**inputs, out=tmp_path / "run", steps=1, save_every=1, device="cpu"))).train()
    assert _run(f"""\
        import json, sys
        from dflash.config import TrainConfig
        from dflash.run.preflight import validate_inputs
        saved = json.loads(open({str(tmp_path / "run" / "train_config.json")!r}).read())
        validate_inputs(TrainConfig.from_dict({{**saved, "resume": True}}))
        print("dflash.train.trainer" in sys.modules)
        """) == ["False"]
