"""`dflash train` stopped by SIGTERM (what SLURM and Kubernetes send before a kill) or SIGINT at a
random step: it finishes the step, saves a checkpoint, says how to resume and exits 128 + signal;
the resumed run gives the loss curve of an uninterrupted one, bitwise. A second signal ends the
process at once. Real processes and signals: integration tier."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from tiny import make_target, write_chat_data

from dflash.run.layout import LOG_NAME
from dflash.run.step_dirs import find_checkpoint


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    return {"target": make_target(root / "qwen3", num_layers=5), "data": write_chat_data(root / "train.jsonl")}


STEPS = 40


def _train(assets, out, *extra, progress: bool = False):
    flags = ["--target", str(assets["target"]), "--data", str(assets["data"]), "--out", str(out)]
    flags += ["--block-size", "4", "--gamma", "2", "--num-target-layers", "2", "--seq-len", "48"]
    flags += ["--batch-size", "2", "--max-anchors", "4", "--steps", str(STEPS), "--log-every", "1"]
    flags += ["--save-every", "0", "--cpu-threads", "1", *([] if progress else ["--no-progress"]), *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "dflash", "train", *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _losses(out) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _wait_for_steps(out, count: int, proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= count:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    raise AssertionError(f"no step {count} within {timeout} s")


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    proc = _train(assets, out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return _losses(out)


@pytest.mark.parametrize("signum, code, reader_left", [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)])
def test_a_signal_saves_a_checkpoint_and_the_resumed_run_matches(
    assets, reference, tmp_path, signum, code, reader_left
):
    """SIGINT as after `dflash train ... | tee log` and Ctrl-C: the signal ends tee too, and every
    later write hits a closed pipe (the progress bar's first); the run must still save its
    checkpoint, say how to resume (in its log file) and exit 130 (it exited 0, unsaved)."""
    out = tmp_path / "run"
    proc = _train(assets, out, progress=reader_left)
    _wait_for_steps(out, random.Random(signum).randrange(1, STEPS // 2), proc)
    if reader_left:
        proc.stdout.close()
        proc.stderr.close()
    proc.send_signal(signum)
    if reader_left:
        assert proc.wait(timeout=300) == code
        err = (out / LOG_NAME).read_text()
    else:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == code, err[-3000:]
    stopped_at = int(find_checkpoint(out).name.removeprefix("step_"))
    assert 1 <= stopped_at < STEPS and len(_losses(out)) == stopped_at
    assert f"after step {stopped_at}, checkpoint saved" in err and "dflash train --resume --out" in err

    resumed = _train(assets, out, "--resume")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert _losses(out) == reference  # bitwise: the same run as one never interrupted


def test_a_second_signal_exits_at_once(assets, tmp_path):
    out = tmp_path / "run"
    proc = _train(assets, out, "--save-every", "2")
    _wait_for_steps(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    # The first signal switched the handlers back to the defaults: the second one kills.
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode in (-signal.SIGTERM, 143)
    step_dir = find_checkpoint(out)  # whatever was saved is complete (verified against its manifest)
    assert step_dir.name.startswith("step_")
