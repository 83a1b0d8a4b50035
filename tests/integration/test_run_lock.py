"""The ``--out`` lock: a second training is refused naming the first; a killed run's lock is
taken over; another host's lock is reported, never broken.

Subprocess tests: real processes (no torch import, well under a second each).
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from dflash.run.layout import LOCK_NAME
from dflash.run.lock import RunLockError, run_lock

HOLD = textwrap.dedent("""\
    import logging, sys
    from dflash.run.lock import RunLockError, run_lock
    logging.basicConfig(level=logging.INFO)
    try:
        with run_lock(sys.argv[1]):
            print("locked", flush=True)
            sys.stdin.read()  # hold until the test closes stdin (or kills us)
    except RunLockError as error:
        print(f"refused: {error}", flush=True)
    """)


def _holder(out):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
    return proc


def _try(out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HOLD, str(out)], input="", capture_output=True, text=True, timeout=60)


def test_a_second_process_is_refused_until_the_first_is_killed(tmp_path):
    out = tmp_path / "run"
    first = _holder(out)
    try:
        second = _try(out)
        assert second.stdout.startswith("refused: "), second.stdout + second.stderr
        assert f"pid {first.pid} on host {socket.gethostname()}" in second.stdout
        assert str(out / LOCK_NAME) in second.stdout and "train into another --out" in second.stdout
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == first.pid  # left behind by the kill

    third = _try(out)
    assert third.stdout.strip() == "locked", third.stdout + third.stderr
    assert f"taking over a stale lock of pid {first.pid}" in third.stderr and "no longer running" in third.stderr
    assert not (out / LOCK_NAME).exists()  # a run that ends normally removes its lock


def test_a_lock_released_normally_lets_the_next_run_in_silently(tmp_path):
    first = _holder(tmp_path)
    first.communicate("")
    assert first.returncode == 0 and not (tmp_path / LOCK_NAME).exists()
    again = _try(tmp_path)
    assert again.stdout.strip() == "locked" and "stale" not in again.stderr


def test_another_hosts_lock_is_reported_and_left_alone(tmp_path):
    text = json.dumps({"pid": 4242, "host": "gpu-node-7", "started": "2025-01-01T00:00:00", "command": "dflash train"})
    (tmp_path / LOCK_NAME).write_text(text)
    with pytest.raises(RunLockError, match="lock from another host: pid 4242 on host gpu-node-7") as error:
        with run_lock(tmp_path):
            pass
    assert f"delete {tmp_path / LOCK_NAME}" in str(error.value)
    assert (tmp_path / LOCK_NAME).read_text() == text


def test_one_process_cannot_hold_the_lock_twice(tmp_path):
    with run_lock(tmp_path):
        with pytest.raises(RunLockError, match=f"pid {os.getpid()}"):
            with run_lock(tmp_path):
                pass
    with run_lock(tmp_path):  # released: free again
        pass


COUNT = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from dflash.run.lock import RunLockError, run_lock
    out, rounds = Path(sys.argv[1]), int(sys.argv[2])
    done = 0
    while done < rounds:
        try:
            with run_lock(out):
                counter = out / "counter"
                value = int(counter.read_text())
                time.sleep(0.001)  # widen the window a second holder would race in
                counter.write_text(str(value + 1))
        except RunLockError:
            continue
        done += 1
    """)


def test_processes_taking_turns_never_hold_it_at_once(tmp_path):
    # Each release removes the file, so a process that opened it just before may flock a
    # removed file; acquire must notice and retry, or two holders lose counter updates.
    (tmp_path / "counter").write_text("0")
    procs = [subprocess.Popen([sys.executable, "-c", COUNT, str(tmp_path), "40"]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert (tmp_path / "counter").read_text() == "120"


def test_eval_says_when_the_run_is_still_training(tmp_path, caplog):
    from dflash.commands.evaluate import _note_training_in_progress, _run_config
    from dflash.run.layout import SAVED_CONFIG_NAME
    from dflash.run.lock import training_holder

    out = tmp_path / "run"
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    (out / SAVED_CONFIG_NAME).write_text("{}")
    first = _holder(out)
    try:
        assert training_holder(out).pid == first.pid
        with caplog.at_level(logging.WARNING, logger="dflash.commands.evaluate"):
            _note_training_in_progress(_run_config(out / "checkpoints" / "step_2"))
        assert f"{out} is still being trained (pid {first.pid} on host" in caplog.text
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The killed run's lock file is left behind, but nobody holds it: nothing is said.
    assert (out / LOCK_NAME).exists() and training_holder(out) is None
    caplog.clear()
    _note_training_in_progress(_run_config(out))
    assert "still being trained" not in caplog.text
