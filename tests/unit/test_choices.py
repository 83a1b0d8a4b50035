"""Choice fields (dflash/choices.py): each of TrainConfig's is a ``typing.Literal``, and ``dflash train
--help``, argparse's refusal and the config's own check all read its values from there."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from dflash.choices import literal_choices
from dflash.commands.train import register
from dflash.config import TrainConfig

#: Every field that takes one of a few words.
CHOICE_FIELDS = {
    "arch",
    "overflow",
    "responses",
    "selector_missing_gold",
    "selector_target",
    "selector_codebooks",
    "compile",
    "compile_scope",
    "target_dtype",
    "save_dtype",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash")
    register(parser.add_subparsers())
    return parser


def test_every_choice_field_is_a_literal():
    choices = literal_choices(TrainConfig)
    assert set(choices) == CHOICE_FIELDS
    hints = typing.get_type_hints(TrainConfig)
    plain_words = {f.name for f in dataclasses.fields(TrainConfig) if hints[f.name] in (str, str | None)}
    assert not plain_words & CHOICE_FIELDS
    defaults = TrainConfig.defaults()
    assert all(defaults[name] is None or defaults[name] in values for name, values in choices.items())


@pytest.mark.parametrize("field", sorted(CHOICE_FIELDS))
def test_help_refusal_and_check_read_the_literal(field, capsys):
    values = literal_choices(TrainConfig)[field]
    flag = "--" + field.replace("_", "-")
    parser = _parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    assert f"{flag} {{{','.join(values)}}}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["train", flag, "nonsense"])
    assert f"argument {flag}: invalid choice: 'nonsense' (choose from {', '.join(map(repr, values))})" in (
        capsys.readouterr().err
    )
    for value in values:
        assert getattr(parser.parse_args(["train", flag, value]), field) == value
    with pytest.raises(ValueError, match=f"^{field} must be one of {', '.join(values)}; got 'nonsense'$"):
        TrainConfig(**{field: "nonsense"})


def test_an_optional_choice_takes_the_empty_string_as_its_rule():
    assert _parser().parse_args(["train", "--arch", ""]).arch is None
