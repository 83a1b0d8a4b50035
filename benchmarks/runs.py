"""A ``dflash`` command in a fresh interpreter, as the benchmarks run it: its log (stderr) written to a
file as it runs, so a run stopped by a time limit still leaves what it printed, and its stdout kept."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Run:
    """A finished command: return code, its log followed by its stdout, its stdout alone, wall seconds."""

    returncode: int
    log: str
    stdout: str
    seconds: float

    def checked(self, what: str, ok: tuple[int, ...] = (0,)) -> Run:
        """The run, or SystemExit quoting its log's tail when its return code is not in ``ok``."""
        if self.returncode not in ok:
            raise SystemExit(f"{what} failed, rc {self.returncode}:\n{self.log[-4000:]}")
        return self


def run_logged(command: list[str], log_path: Path, *, timeout: float | None = None, env: dict | None = None) -> Run:
    """Run ``command`` (printed first) with stderr written to ``log_path``; stdout captured.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds.
    """
    print("$", " ".join(map(str, command)), flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=log_file, text=True, timeout=timeout, env=env)
    return Run(done.returncode, log_path.read_text() + done.stdout, done.stdout, time.perf_counter() - start)
