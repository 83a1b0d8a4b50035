"""Log lines and tqdm progress bars on one console.

A bar redraws its line with ``\\r`` and no newline; a log record written to the same stream
lands after the bar's text, glued onto it. Inside :func:`log_above_progress_bars` every console
handler goes through ``tqdm.write`` instead (``tqdm.contrib.logging.logging_redirect_tqdm``),
which clears the bars, prints the line, and redraws them below it.

Loggers are collected when the block is entered: the root logger (``dflash``'s records reach it)
and every logger that prints to the console itself, such as ``torch`` and ``transformers`` once
they are imported. So the CLI wraps each command in it, and a training loop is wrapped again
after torch and transformers are loaded (nesting is fine).

:func:`output_may_close` keeps a command running when whoever reads its console goes away: a
``| tee log`` killed by the same Ctrl-C that asks training to stop, a closed terminal, ``| head``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

#: The format of a log line, on the console and in a run's log file (:mod:`dflash.run.log_file`).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _prints_to_console(logger: logging.Logger) -> bool:
    return any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr) for h in logger.handlers)


def console_loggers() -> list[logging.Logger]:
    """The root logger and every existing logger with its own stdout/stderr handler."""
    existing = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    return [logger for logger in existing if _prints_to_console(logger)]


@contextlib.contextmanager
def log_above_progress_bars() -> Iterator[None]:
    """Route the console loggers' records through ``tqdm.write`` for the ``with`` block (formatter,
    filters and stream of each handler kept), restoring the handlers afterwards."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=console_loggers()):
        yield


class _OutputThatMayClose:
    """A text stream whose writes and flushes, once its reader has gone (``BrokenPipeError``), go
    to the null device: the file descriptor is pointed there, so the stream's own buffer, later
    writes and C-level writes to the same descriptor are all dropped without an error."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_null()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_null()

    def _to_null(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    # It stands for the stream it wraps: handlers made before it (torch's loggers, at import) still
    # count as console handlers (console_loggers, and tqdm's own test of a handler's stream).
    def __eq__(self, other) -> bool:
        return other is self or other is self._stream

    def __hash__(self) -> int:
        return hash(self._stream)


@contextlib.contextmanager
def output_may_close() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` outlive their reader for the ``with`` block: a write after
    the pipe or terminal closed is dropped instead of raising ``BrokenPipeError``, so a training run
    goes on to its next checkpoint (or its signal's) and exits with its own status. Enter it before
    logging and progress bars take hold of the streams."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _OutputThatMayClose(sys.stdout), _OutputThatMayClose(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
