"""Every thread's stack when a process stops making progress: a hang is a failure with stacks.

A deadlock in which one thread holds the GIL while it waits inside C++ stops every Python thread,
so a watchdog written in Python (a timer thread, pytest-timeout's thread method, a join with a
timeout) never runs again. ``faulthandler.dump_traceback_later`` arms a C thread that needs no GIL:
when its time is up it writes every thread's Python stack to a file descriptor (headed by
:data:`HEADER`) and, with ``exit``, ends the process with status 1.

Three users:

- **Child processes** (``dflash patches verify``, the bug-class checks, the stress runner, the
  tests' scripts): a parent puts :data:`ENV` (seconds) into the child's environment
  and the startup hook arms the child's watchdog before anything else runs
  (:func:`arm_from_environment`, whatever ``DFLASH_PATCHES`` says) and gives the child's own
  children a shorter time, so the innermost hung process is the one whose stacks are printed.
  :func:`run_watched` does both sides: it raises :class:`Hang` with the child's stacks.
- **In-process tests**: each test runs inside :func:`watching` (the repository's ``conftest.py``).
- **dflash train**: a step that makes no progress for ``--stall-minutes`` dumps every thread's stack
  to stderr, again every as many minutes, and training goes on if it moves (``exit=False, repeat=True``).

faulthandler has one timer per process; :func:`watching` blocks nest, and the timer is set for the
one whose time runs out first among those that end the process (if any; a dump-and-go-on block
inside one that ends the process dumps only when that one fires).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from dflash.environment import WATCHDOG_ENV as ENV

#: What faulthandler writes first when a watchdog fires ("Timeout (0:05:00)!").
HEADER = "Timeout ("
#: Share of its own time a watched process gives each child it starts (the child fires first).
CHILD_SHARE = 0.8


class Hang(RuntimeError):
    """A process stopped making progress; the message holds every thread's stack."""


@dataclass
class _Watch:
    deadline: float
    exit: bool
    repeat: bool
    seconds: float
    file: object  # what faulthandler writes to: a file object or a file descriptor


_watches: list[_Watch] = []
_lock = threading.Lock()
_from_environment: list[float] = []  # the seconds arm_from_environment armed, once per process


def _arm_earliest() -> None:
    # One timer: a watch that ends the process governs while there is one (a dump that lets the
    # process go on could repeat forever in front of it); else the one whose time runs out first.
    faulthandler.cancel_dump_traceback_later()
    candidates = [w for w in _watches if w.exit] or _watches
    if not candidates:
        return
    watch = min(candidates, key=lambda w: w.deadline)
    left = max(watch.deadline - time.monotonic(), 0.001)
    faulthandler.dump_traceback_later(left, repeat=watch.repeat, file=watch.file, exit=watch.exit)


@contextlib.contextmanager
def watching(seconds: float, *, exit: bool = True, repeat: bool = False, file=None) -> Iterator[_Watch]:
    """Within the block, dump every thread's stack to ``file`` (default: stderr; a file object or
    descriptor, open until the block ends) if ``seconds`` pass, then exit 1 with ``exit``, or dump
    again every ``seconds`` with ``repeat``.

    Raises:
        ValueError: ``seconds`` not positive.
    """
    if not seconds > 0:
        raise ValueError(f"a watchdog needs a positive number of seconds, got {seconds!r}")
    watch = _Watch(time.monotonic() + seconds, exit, repeat, seconds, sys.stderr if file is None else file)
    with _lock:
        _watches.append(watch)
        _arm_earliest()
    try:
        yield watch
    finally:
        with _lock:
            _watches.remove(watch)
            _arm_earliest()


def arm_from_environment() -> None:
    """Arm this process's watchdog from :data:`ENV` (the startup hook calls it), and give the
    children it starts :data:`CHILD_SHARE` of that time. Unset or unreadable: nothing. Once per
    process: site may run a ``.pth`` file twice (a venv's site-packages reached by two paths)."""
    try:
        seconds = float(os.environ.get(ENV, ""))
    except ValueError:
        return
    if seconds > 0 and not _from_environment:
        _from_environment.append(seconds)
        _watches.append(_Watch(time.monotonic() + seconds, True, False, seconds, sys.stderr))
        _arm_earliest()
        os.environ[ENV] = f"{seconds * CHILD_SHARE:.1f}"


#: Seconds a parent waits past a child's watchdog before it kills the child itself.
_GRACE_S = 30.0


def run_watched(
    cmd: list[str], *, seconds: float, env: dict[str, str] | None = None, cwd=None
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, cwd=cwd)`` (text output captured) with the child's watchdog set to ``seconds``
    (:data:`ENV`; the child must be a Python with dflash installed, whose startup hook arms it).

    Raises:
        Hang: the child's watchdog fired (the message holds every thread's stack), or the child was
            still running :data:`_GRACE_S` later and was killed.
    """
    what = " ".join(cmd)
    env = {**(os.environ if env is None else env), ENV: f"{seconds:.1f}"}
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=seconds + _GRACE_S)
    except subprocess.TimeoutExpired:
        raise Hang(
            f"hang: {what} was still running {seconds + _GRACE_S:.0f} s after it started and was killed; no stacks "
            "(its watchdog did not fire)"
        ) from None
    stacks = hang_stacks(proc.stderr)
    if proc.returncode != 0 and stacks is not None:
        raise Hang(f"hang: {what} made no progress in {seconds:.0f} s; every thread's stack:\n{stacks}")
    return proc


def hang_stacks(output: str) -> str | None:
    """The stacks a fired watchdog wrote into ``output`` (from its header on), or None."""
    at = output.find(HEADER)
    return None if at < 0 else output[at:]
