"""Warnings said once per process: a warning about one file that several readers of it hit in one
command (``checkpoints/latest`` naming a deleted step: preflight, the resume check and the trainer's
load; an unreadable part of the token cache: its completeness check and the tokenizing after it)."""

from __future__ import annotations

import logging
import threading


class OncePerProcess(logging.Filter):
    """Drops a warning (or error) whose text its logger already passed in this process; other
    records pass."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        text = record.getMessage()
        with self._lock:
            if text in self._seen:
                return False
            self._seen.add(text)
        return True


def once_per_process(logger: logging.Logger) -> logging.Logger:
    """``logger`` with an :class:`OncePerProcess` filter: each of its warnings is logged once."""
    logger.addFilter(OncePerProcess())
    return logger
