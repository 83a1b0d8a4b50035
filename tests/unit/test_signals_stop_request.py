"""dflash.signals: the first SIGTERM/SIGINT is recorded (or, interrupting, raised) and the default
handlers come back, so a second one ends the process; outside the main thread nothing is installed."""

import os
import signal
import threading

import pytest

from dflash.signals import Stopped, StopRequest


def test_the_first_signal_is_recorded_for_the_work_and_the_defaults_come_back(caplog):
    before = signal.getsignal(signal.SIGINT)
    with StopRequest("finishing this step").installed() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # a second one ends the process
    assert signal.getsignal(signal.SIGINT) is before
    assert "SIGINT received: finishing this step (send it again to exit at once)" in caplog.text


def test_an_interrupting_request_raises_stopped_naming_the_work_and_the_signal():
    with pytest.raises(Stopped, match="^tokenizing stopped by SIGTERM$") as stopped:
        with StopRequest("stopping", interrupting="tokenizing").installed():
            os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.signum == signal.SIGTERM and stopped.value.step is None
    assert str(Stopped(signal.SIGTERM, step=5)) == "stopped by SIGTERM after step 5"


def test_outside_the_main_thread_nothing_is_installed():
    before, seen = signal.getsignal(signal.SIGTERM), []

    def in_thread():
        with StopRequest("stopping").installed() as stop:
            seen.append((stop.requested, signal.getsignal(signal.SIGTERM)))

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen == [(False, before)]
