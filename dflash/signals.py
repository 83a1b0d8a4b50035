"""Stopping long work on a signal: the first SIGTERM (what SLURM and Kubernetes send before they kill a
job) or SIGINT (Ctrl-C) asks the work to stop cleanly; a second one ends the process at once.

Training finishes the step in flight and saves a checkpoint, tokenizing keeps its finished parts,
regenerating replies keeps what its journals hold; each then raises :class:`Stopped`, having said what
it kept. After the first signal the handlers go back to the defaults, so the second ends the process
even while the main thread is inside a long native call. Only the main thread may install handlers:
elsewhere :meth:`StopRequest.installed` installs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

#: The signals that ask to stop.
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(KeyboardInterrupt):
    """Work stopped by a first SIGTERM or SIGINT, after keeping what it had done (and saying what).

    A KeyboardInterrupt, like the Ctrl-C it often is: ``except Exception`` on its way out lets it
    through.

    Args:
        signum (int): the signal.
        work (str, optional): what stopped (``"tokenizing"``); None for training, whose message
            names the step instead.
        step (int, optional): the last training step completed (and saved, unless --no-save).
    """

    def __init__(self, signum: int, work: str | None = None, *, step: int | None = None) -> None:
        message = f"stopped by {signal.Signals(signum).name}"
        if work is not None:
            message = f"{work} {message}"
        if step is not None:
            message += f" after step {step}"
        super().__init__(message)
        self.signum, self.step = signum, step


class StopRequest:
    """Handlers of :data:`SIGNALS` while :meth:`installed`: the first signal is logged with what the
    work does about it and recorded (:attr:`signum`, :attr:`requested`) for the work to act on between
    its steps, or, with ``interrupting``, raises :class:`Stopped` in the main thread at once (work that
    waits for threads, which polling would not reach).

    Args:
        doing (str): what happens on the first signal, for the warning
            (``"stopping the tokenizing after the parts in flight"``).
        interrupting (str, optional): the work's name, for the :class:`Stopped` raised at once.
    """

    def __init__(self, doing: str, *, interrupting: str | None = None) -> None:
        self.doing, self.interrupting = doing, interrupting
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        logger.warning("%s received: %s (send it again to exit at once)", signal.Signals(signum).name, self.doing)
        if self.interrupting is not None:
            raise Stopped(signum, self.interrupting)
