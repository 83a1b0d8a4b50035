"""The ``dflash`` command line: options that every subcommand takes."""

import pytest

from dflash import __version__
from dflash.cli import build_parser


@pytest.mark.parametrize(
    "argv, verbose",
    [
        (["train"], False),
        (["-v", "train"], True),
        (["train", "-v"], True),
        (["eval", "--drafter", "runs/dflash", "--verbose"], True),
        (["patches", "status", "-v"], True),
        (["-v", "patches", "status"], True),
    ],
)
def test_verbose_is_taken_before_or_after_the_subcommand(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"dflash {__version__}"


def test_verbose_turns_on_dflash_debug_lines(tmp_path):
    import logging

    from dflash.cli import main

    try:
        main(["train", "-v", "--resume", "--out", str(tmp_path / "none")])
        assert logging.getLogger("dflash").getEffectiveLevel() == logging.DEBUG
        main(["train", "--resume", "--out", str(tmp_path / "none")])
        assert logging.getLogger("dflash").level == logging.NOTSET
    finally:
        logging.getLogger("dflash").setLevel(logging.NOTSET)


@pytest.mark.parametrize(
    "argv, usage, unknown, meant",
    [
        (["train", "--stepz", "3"], "dflash train", "--stepz 3", "--steps"),
        (["eval", "--drafter", "d", "--num-promts=3"], "dflash eval", "--num-promts=3", "--num-prompts"),
        (["patches", "status", "--jsn"], "dflash patches status", "--jsn", "--json"),
        # A prefix is no flag: argparse would take it for --max-anchors, and for another flag once one
        # sharing the prefix is added.
        (["train", "--max-anchor", "8"], "dflash train", "--max-anchor 8", "--max-anchors"),
    ],
)
def test_a_misspelled_flag_is_named_by_its_command_with_the_flag_it_meant(argv, usage, unknown, meant, capsys):
    from dflash.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"usage: {usage} ")
    assert f"unrecognized arguments: {unknown} (did you mean {meant}?)" in err


def test_patches_verify_help_lists_the_bug_classes_of_the_catalogue(capsys):
    """It said A-K after class L was added to the catalogue."""
    from dflash.patchtools.verify.catalogue import BUG_CLASSES

    with pytest.raises(SystemExit):
        build_parser().parse_args(["patches", "verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "L" in BUG_CLASSES and f"(default: all, {', '.join(BUG_CLASSES)})" in text
