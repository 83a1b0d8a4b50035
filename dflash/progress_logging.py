"""Log lines and tqdm progress bars on one console.

A bar redraws its line with ``\\r`` and no newline; a log record written to the same stream
lands after the bar's text, glued onto it. Inside :func:`log_above_progress_bars` every console
handler goes through ``tqdm.write`` instead (``tqdm.contrib.logging.logging_redirect_tqdm``),
which clears the bars, prints the line, and redraws them below it.

Loggers are collected when the block is entered: the root logger (``dflash``'s records reach it)
and every logger that prints to the console itself, such as ``torch`` and ``transformers`` once
they are imported. So the CLI wraps each command in it, and a training loop is wrapped again
after torch and transformers are loaded (nesting is fine).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator


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
