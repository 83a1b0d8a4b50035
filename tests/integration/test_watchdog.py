"""dflash.watchdog: a process that stops making progress, even one whose thread holds the GIL while
it waits in C, prints every thread's stack and fails, in a child and in this process's nesting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash import watchdog

#: A thread stuck in C while it holds the GIL (ctypes.PyDLL keeps the GIL across the call): no
#: Python thread runs again, so only a watchdog that needs no GIL can tell.
PLANTED = """
import ctypes, threading, time
def stuck_holding_the_gil():
    ctypes.PyDLL(None).sleep(600)
threading.Thread(target=stuck_holding_the_gil).start()
time.sleep(600)
"""


@pytest.mark.parametrize("patches", ["1", "0"])  # the watchdog is armed on plain torch's runs too
def test_a_planted_hang_in_a_child_is_reported_with_every_threads_stack(patches):
    env = dict(watchdog.os.environ, DFLASH_PATCHES=patches)
    with pytest.raises(watchdog.Hang, match=r"(?s)made no progress in 2 s; every thread's stack:.*Timeout \(") as hang:
        watchdog.run_watched([sys.executable, "-c", PLANTED], seconds=2, env=env)
    assert "in stuck_holding_the_gil" in str(hang.value) and "in <module>" in str(hang.value)


def test_a_child_that_finishes_is_returned_and_gives_its_children_a_shorter_time():
    code = "import os; print(os.environ['DFLASH_WATCHDOG_S'])"  # what the child's own children inherit
    done = watchdog.run_watched([sys.executable, "-c", code], seconds=10)
    assert done.returncode == 0 and float(done.stdout) == 10 * watchdog.CHILD_SHARE


def test_a_child_whose_watchdog_never_fires_is_killed_and_named(monkeypatch):
    monkeypatch.setattr(watchdog, "_GRACE_S", 1.0)
    with pytest.raises(watchdog.Hang, match="still running .* and was killed; no stacks"):
        # -S: no site, so no startup hook and no watchdog in the child.
        watchdog.run_watched([sys.executable, "-S", "-c", "import time; time.sleep(60)"], seconds=1)


def test_nested_watches_keep_the_earliest_one_that_ends_the_process():
    code = """
import time
from dflash import watchdog
with watchdog.watching(60):
    with watchdog.watching(1.5, exit=False, repeat=True):   # inside one that exits: dumps only when that one fires
        time.sleep(3)
    print("inner left", flush=True)
    with watchdog.watching(1.0):                              # earlier than the outer: this one fires
        time.sleep(30)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "inner left\n"
    assert done.stderr.count(watchdog.HEADER) == 1 and "line 9 in <module>" in done.stderr


STALLED_RUN = """
import sys, time
sys.path.insert(0, {tests!r})
from tiny import make_target, train_config, write_chat_data
from dflash.run.settle import settle
from dflash.train.trainer import Trainer
from pathlib import Path

root = Path({root!r})
config = train_config(
    target=make_target(root / "target", num_layers=5), data=write_chat_data(root / "d.jsonl"), out=root / "run",
    steps=3, stall_minutes=0.02,
)
trainer = Trainer(settle(config))
run = trainer.engine.run

def stuck_in_step_two(step, **kwargs):
    if step == 2:
        time.sleep(4)  # no progress for over three times the 1.2 s the watchdog allows
    return run(step, **kwargs)

trainer.engine.run = stuck_in_step_two
trainer.train()
print("trained", trainer.step)
"""


def test_a_training_step_that_makes_no_progress_dumps_every_threads_stack_and_goes_on(tmp_path):
    from pathlib import Path

    script = STALLED_RUN.format(tests=str(Path(__file__).parents[1]), root=str(tmp_path))
    # Without this test run's own watchdog in the child: one that ends the process would govern there.
    env = {k: v for k, v in watchdog.os.environ.items() if k != watchdog.ENV}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("trained 3"), done.stderr[-3000:]
    dumps = done.stderr.count(watchdog.HEADER)
    assert dumps >= 2, done.stderr[-3000:]  # repeated while the step stays stuck
    assert "in stuck_in_step_two" in done.stderr
