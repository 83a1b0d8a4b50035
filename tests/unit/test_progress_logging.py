"""Log lines are printed above tqdm progress bars, not glued onto them."""

import contextlib
import logging
import sys

from tqdm import tqdm

from dflash.progress_logging import console_loggers, log_above_progress_bars


@contextlib.contextmanager
def _console_logger():
    """A logger printing to stderr itself, like torch's and transformers'. Made inside the test:
    pytest swaps sys.stderr between a fixture's setup and the test."""
    logger = logging.getLogger("dflash.test.console")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield logger
    finally:
        logger.removeHandler(handler)


def _text_before(message: str, err: str) -> str:
    assert message in err, err
    return err.split(message)[0]


def test_a_log_line_during_a_bar_starts_on_a_cleared_line(capsys):
    with _console_logger() as console_logger, log_above_progress_bars():
        bar = tqdm(total=4, desc="train", file=sys.stderr)
        bar.update(1)
        console_logger.warning("step 1: recompiled")
        bar.close()
    err = capsys.readouterr().err
    assert "LOG step 1: recompiled\n" in err
    assert _text_before("LOG step 1", err).endswith("\r")  # tqdm.write cleared the bar first


def test_without_it_the_line_is_glued_onto_the_bar(capsys):
    with _console_logger() as console_logger:
        bar = tqdm(total=4, desc="train", file=sys.stderr)
        bar.update(1)
        console_logger.warning("step 1: recompiled")
        bar.close()
    assert not _text_before("LOG step 1", capsys.readouterr().err).endswith("\r")


def test_only_loggers_that_print_to_the_console_are_taken():
    quiet = logging.getLogger("dflash.test.quiet")
    with _console_logger() as console_logger:
        assert console_logger in console_loggers() and quiet not in console_loggers()
        before = list(console_logger.handlers)
        with log_above_progress_bars():
            assert not [h for h in console_logger.handlers if type(h) is logging.StreamHandler]
        assert console_logger.handlers == before  # restored


def test_the_cli_runs_each_command_with_the_redirection(capsys, monkeypatch):
    import dflash.commands.patches as patches
    from dflash.cli import main

    def status(args):
        bar = tqdm(total=2, desc="status", file=sys.stderr)
        bar.update(1)
        console_logger.warning("inside a command")
        bar.close()
        return 0

    monkeypatch.setattr(patches, "_status", status)
    with _console_logger() as console_logger:
        assert main(["patches", "status"]) == 0
    assert _text_before("LOG inside a command", capsys.readouterr().err).endswith("\r")
