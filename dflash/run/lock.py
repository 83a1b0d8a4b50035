"""One training per output directory: a lock file in ``--out`` held for the whole run.

Two trainings into one ``--out`` would prune and replace each other's checkpoints (one died
with a ``FileNotFoundError`` when the other's stale-temp cleanup removed its half-written
checkpoint). The lock is ``<out>/train.lock``:

- Mutual exclusion is an exclusive ``flock`` on that file, which the kernel drops when the
  holder exits or is killed, so a dead run never blocks the next one on the same host.
- The file names the holder (pid, host, start time, command) for the refusal message.
- A lock whose host is another machine is reported and left alone: ``flock`` may not reach
  across hosts on a shared filesystem, and a pid cannot be checked from here.
- A file left by a killed run on this host (its pid no longer running) is stale: the next
  run takes it over and says so.

Usage (the trainer wraps the whole run, from before the first write into ``--out``)::

    with run_lock(config.out):
        ...  # build, train, save
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash.run.layout import LOCK_NAME

logger = logging.getLogger(__name__)


class RunLockError(ValueError):
    """The lock of this ``--out`` cannot be taken (another training holds it); the message names
    the holder and the fix."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock, as written into the lock file."""

    pid: int
    host: str
    started: str
    command: str

    @classmethod
    def me(cls) -> Holder:
        return cls(
            pid=os.getpid(),
            host=socket.gethostname(),
            started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            command=" ".join(sys.argv),
        )

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started} (`{self.command}`)"


def _read_holder(fd: int) -> Holder | None:
    """The holder written in the open lock file; None if it is empty or unreadable (a crash mid-write)."""
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0).decode())
        return Holder(int(data["pid"]), str(data["host"]), str(data["started"]), str(data["command"]))
    except (ValueError, KeyError, TypeError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _open_locked(path: Path) -> int:
    """An fd of ``path`` holding an exclusive flock on the file the path names now.

    Raises:
        RunLockError: another process holds the flock, or the filesystem has no locks.
    """
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _read_holder(fd)
            os.close(fd)
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise RunLockError(
                    f"cannot lock {path} ({error}): the filesystem of --out does not support file locks; "
                    "train into a directory on another filesystem"
                ) from None
            raise _in_use(path, holder) from None
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            return fd
        os.close(fd)  # the holder released (and removed) the file between our open and flock: retry


def acquire(out: str | os.PathLike) -> tuple[int, Path]:
    """Take the lock of ``out`` (created if missing); returns ``(fd, lock path)`` for :func:`release`.

    Raises:
        RunLockError: a live training holds it (on this host), or a lock file names another
            host (not checked, not broken: the message says how to clear it).
        OSError: ``out`` cannot be created or written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    fd = _open_locked(path)
    previous, me = _read_holder(fd), Holder.me()
    if previous is not None and previous.host != me.host:
        os.close(fd)
        raise _in_use(path, previous)
    if previous is not None:
        state = "still running: a reused pid" if _pid_running(previous.pid) else "no longer running"
        logger.warning("%s: taking over a stale lock of %s (%s)", path, previous.describe(), state)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me.__dict__) + "\n").encode(), 0)
    os.fsync(fd)
    return fd, path


def training_holder(out: str | os.PathLike) -> Holder | None:
    """The training that holds the lock of ``out`` now: its holder when a process on this host holds
    the flock, or when the lock file names another host (which cannot be checked from here); None
    when there is no lock file or nobody holds it (a run that was killed). Never takes the lock."""
    import fcntl

    path = Path(out) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        holder = _read_holder(fd)
        if holder is not None and holder.host != socket.gethostname():
            return holder
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            held = error.errno in (errno.EAGAIN, errno.EACCES)
            return (holder or Holder(0, "?", "?", "?")) if held else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_free(out: str | os.PathLike) -> None:
    """Refuse ``out`` while a training holds its lock (:func:`training_holder`), without taking it:
    ``dflash train`` asks before it checks its other inputs and imports torch and transformers, so a
    second run into a busy ``--out`` is refused in a second, not after seconds of imports (the lock
    itself is taken later, when the run first writes into ``out``; it makes the final decision).

    Raises:
        RunLockError: the message of :func:`acquire`, naming the holder and the fix.
    """
    holder = training_holder(out)
    if holder is not None:
        raise _in_use(Path(out) / LOCK_NAME, holder)


def _in_use(path: Path, holder: Holder | None) -> RunLockError:
    """The refusal of the lock file ``path``, held by ``holder`` (None, or :func:`training_holder`'s pid 0:
    a file without a readable holder)."""
    here = socket.gethostname()
    if holder is not None and holder.host not in (here, "?"):
        return RunLockError(
            f"{path.parent} has a lock from another host: {holder.describe()}; it cannot be checked from "
            f"{here}. If that training is no longer running, delete {path}; else train into another --out"
        )
    who = holder.describe() if holder is not None and holder.pid else "another process"
    return RunLockError(
        f"{path.parent} is in use by another training: {who}; lock file {path}. "
        "Wait for it to finish or stop it, or train into another --out"
    )


def release(fd: int, path: Path) -> None:
    """Remove the lock file, then drop the flock (in that order, see :func:`_open_locked`)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.close(fd)


@contextlib.contextmanager
def run_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Hold the lock of ``out`` for the ``with`` block; yields the lock file's path.

    Raises:
        RunLockError: see :func:`acquire`.
    """
    fd, path = acquire(out)
    logger.debug("holding the run lock %s", path)
    try:
        yield path
    finally:
        release(fd, path)
