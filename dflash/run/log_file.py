"""A run's log in its directory (``<out>/train.log``, :data:`dflash.run.layout.LOG_NAME`): every log line
``dflash train`` writes on the console (its main process's: rank 0 under torchrun), from the settling
of its flags to its last word, and the summary it prints, appended by each start and resume, so a
run's history stays with its checkpoints (a console scrolls away, and ``| tee`` is the user's to
remember). Progress bars are not log lines and are not kept.

The lines logged before ``--out`` is known to be the run's (its flags settled, its lock taken) are
held in memory and written first.
"""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

from dflash.progress_logging import LOG_FORMAT
from dflash.run.layout import LOG_NAME


class RunLog:
    """From its creation, the log records that reach the root logger, kept until :meth:`write_to`
    names the run directory and then appended to its log file; :meth:`close` ends both."""

    def __init__(self) -> None:
        # Never flushed by itself: until write_to there is nowhere to write.
        self._early = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1)
        self._file: logging.FileHandler | None = None
        logging.getLogger().addHandler(self._early)

    def write_to(self, out: str | Path) -> None:
        """Append this process's log records to ``out``'s log file, the held ones first."""
        root = logging.getLogger()
        self._file = logging.FileHandler(Path(out) / LOG_NAME, mode="a", encoding="utf-8")
        self._file.setFormatter(logging.Formatter(LOG_FORMAT))
        self._early.setTarget(self._file)
        self._early.flush()
        root.removeHandler(self._early)
        root.addHandler(self._file)

    def note(self, text: str) -> None:
        """``text`` (what the command prints, not logs) into the log file only."""
        if self._file is not None:
            record = {"name": "dflash", "levelno": logging.INFO, "levelname": "INFO", "msg": text}
            self._file.handle(logging.makeLogRecord(record))

    def close(self) -> None:
        root = logging.getLogger()
        root.removeHandler(self._early)
        self._early.close()
        if self._file is not None:
            root.removeHandler(self._file)
            self._file.close()
