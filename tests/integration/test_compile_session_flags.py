"""Patch 0004 (compile-session-flags-thread-local): the per-thread session flags keep the module globals.

torch's own compile and export sessions set only the calling thread's flags; code outside torch that
saves, sets and restores ``torch.compiler._is_compiling_flag`` (``_is_exporting_flag``,
``_is_non_strict_tracing_flag`` where the release has it) still forces the answers, process-wide as on
plain torch. Threads: an export held open in a worker thread with events (a few seconds).
"""

from __future__ import annotations

import threading

import pytest
from tiny import in_thread

torch = pytest.importorskip("torch")

TIMEOUT_S = 60

# (module global, the reader it forces): the third exists from torch 2.12.
FLAGS = [
    ("_is_compiling_flag", "is_compiling"),
    ("_is_exporting_flag", "is_exporting"),
    ("_is_non_strict_tracing_flag", "_is_non_strict_tracing"),
]


@pytest.mark.parametrize("name, reader", FLAGS)
def test_an_old_style_writer_still_forces_the_answer_in_every_thread(name, reader):
    if not hasattr(torch.compiler, reader):
        pytest.skip(f"torch.compiler.{reader} does not exist in torch {torch.__version__}")
    read = getattr(torch.compiler, reader)
    old = getattr(torch.compiler, name)  # e.g. old = torch.compiler._is_compiling_flag
    assert old is False
    setattr(torch.compiler, name, True)
    try:
        assert read() is True
        assert in_thread(read, TIMEOUT_S) is True
    finally:
        setattr(torch.compiler, name, old)
    assert read() is False and in_thread(read, TIMEOUT_S) is False


def test_an_export_in_another_thread_still_does_not_leak_into_an_eager_thread():
    entered, release = threading.Event(), threading.Event()

    class Blocking(torch.nn.Module):
        def forward(self, x):
            entered.set()
            release.wait(TIMEOUT_S)
            return x.sin()

    errors = []

    def export():
        try:
            torch.export.export(Blocking(), (torch.randn(4),), strict=False)
        except Exception as e:  # re-raised below, not lost in the thread
            errors.append(e)

    thread = threading.Thread(target=export, daemon=True)
    thread.start()
    try:
        assert entered.wait(TIMEOUT_S), "the export never reached forward()"
        seen = (torch.compiler.is_compiling(), torch.compiler.is_exporting(), torch.compiler._is_compiling_flag)
    finally:
        release.set()
        thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "the export did not finish"
    assert not errors, errors
    assert seen == (False, False, False), f"(is_compiling, is_exporting, _is_compiling_flag) here: {seen}"
