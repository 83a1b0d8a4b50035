"""The defaults the README and docs quote (`` `--flag` (default VALUE ``) are the code's: each is
read from the parser that takes the flag (``dflash`` and its subcommands, ``dflash train``'s from
TrainConfig, pytest's options of this repository's conftests), so a default changed in code and not in
a document fails here. docs/results.md is left out: its flags are those of dated measurements."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

from dflash.cli import build_parser
from dflash.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "stress" / "README.md", ROOT / "benchmarks" / "README.md"] + [
    path for path in sorted((ROOT / "docs").glob("*.md")) if path.name != "results.md"
]
#: `--flag` (default 10 / `--flag`, default 1200 / `--flag` (default `insert`: a flag and the default the text gives it.
QUOTED = re.compile(r"`(--[a-z0-9-]+)`,?\s+\(?default:?\s+`?([^`\s,;)]+)`?")


def _parser_defaults(parser: argparse.ArgumentParser, found: dict[str, set[str]]) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                _parser_defaults(command, found)
        elif action.default not in (None, argparse.SUPPRESS):
            for flag in action.option_strings:
                found.setdefault(flag, set()).add(str(action.default))


class _Options:
    """Records what a conftest's ``pytest_addoption`` adds (pytest's parser and its groups alike)."""

    def __init__(self, found: dict[str, set[str]]):
        self.found = found

    def getgroup(self, *args, **kwargs):
        return self

    def addoption(self, *flags, default=None, **kwargs):
        for flag in flags:
            self.found.setdefault(flag, set()).add(str(default))


def _conftest_defaults(found: dict[str, set[str]]) -> None:
    for path in (ROOT / "conftest.py", ROOT / "stress" / "conftest.py"):
        spec = importlib.util.spec_from_file_location(f"_conftest_{path.parent.name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.pytest_addoption(_Options(found))


def code_defaults() -> dict[str, set[str]]:
    """Each flag's defaults in code, as text (a flag of several commands may have several)."""
    found: dict[str, set[str]] = {}
    _parser_defaults(build_parser(), found)
    for name, value in TrainConfig.defaults().items():
        if value is not None:
            found.setdefault("--" + name.replace("_", "-"), set()).add(str(value))
    _conftest_defaults(found)
    return found


def _same(quoted: str, defaults: set[str]) -> bool:
    for default in defaults:
        try:
            if float(quoted) == float(default):
                return True
        except ValueError:
            if quoted == default:
                return True
    return False


def test_every_default_the_docs_quote_is_the_codes():
    defaults = code_defaults()
    quotes = [
        (path.relative_to(ROOT), flag, value) for path in DOCUMENTS for flag, value in QUOTED.findall(path.read_text())
    ]
    assert len(quotes) >= 6  # the pattern still finds what the documents quote
    wrong = [
        f"{path}: {flag} default {value}, the code's {sorted(defaults.get(flag, {'(no such flag)'}))}"
        for path, flag, value in quotes
        if not _same(value, defaults.get(flag, set()))
    ]
    assert not wrong, "documents quote defaults the code does not have:\n" + "\n".join(wrong)
