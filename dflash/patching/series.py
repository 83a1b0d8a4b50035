"""Read the patch series: ``patches/series``, DEP-3 headers, unified diffs.

The series ships inside the package as ``dflash.patch_series`` (``setup.py``
maps the top-level ``patches/`` folder to it), so the import hook, the wheel
builder and the PR kit all read the same files.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import unidiff
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dflash.patching.plan import series_dir


class SeriesError(ValueError):
    """The patch series itself is malformed (a packaging bug, not a torch mismatch)."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One ``.patch`` file of the series.

    Attributes:
        file_name: e.g. ``0001-fx-tracing-flag-thread-local.patch``.
        name: the concern (``Patch-Name:``); variants of one concern share it.
        header: every DEP-3 field, as written.
        diff_text: the unified diff below the ``---`` line.
        torch_versions: the releases this variant is written for (``Torch-Versions:``).
        verified_on: releases it was applied to and checked on (``Verified-On:``).
        applied_upstream: first torch release that has the fix (``Applied-Upstream:``), if any.
        affects_versions: the releases that have the bug (``Affects-Versions:``; absent: all).
    """

    file_name: str
    name: str
    header: dict[str, str]
    diff_text: str
    torch_versions: SpecifierSet
    verified_on: tuple[Version, ...]
    applied_upstream: Version | None
    affects_versions: SpecifierSet | None = None

    @functools.cached_property
    def files(self) -> tuple[unidiff.PatchedFile, ...]:
        return tuple(unidiff.PatchSet(self.diff_text))

    @property
    def modules(self) -> tuple[str, ...]:
        """Dotted names of the torch modules this patch edits."""
        return tuple(module_name(f.path) for f in self.files)

    @property
    def description(self) -> str:
        return self.header.get("Description", "").strip()


def module_name(path: str) -> str:
    """``torch/compiler/__init__.py`` -> ``torch.compiler``."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def parse_header(text: str) -> dict[str, str]:
    """DEP-3 fields: ``Name: value`` lines, continued by lines that start with a space.

    (``email.parser`` reads the same syntax but costs ~35 ms to import, and this
    runs while ``import torch`` is in progress.)
    """
    fields: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line[:1] in (" ", "\t") and name is not None:
            fields[name] += "\n" + line[1:]
        elif (match := re.match(r"([A-Za-z][A-Za-z0-9-]*):\s?(.*)", line)) is not None:
            name = match.group(1)
            fields[name] = match.group(2)
    return fields


def parse_patch(file_name: str, text: str) -> Patch:
    """Split a series file into its DEP-3 header and its diff.

    Raises:
        SeriesError: no ``---`` separator, or a required field missing or malformed.
    """
    head, sep, diff_text = text.partition("\n---\n")
    if not sep:
        raise SeriesError(f"{file_name}: no '---' line between the DEP-3 header and the diff")
    header = parse_header(head)
    try:
        name = header["Patch-Name"]
        torch_versions = SpecifierSet(header["Torch-Versions"])
        verified_on = tuple(Version(v.strip()) for v in header.get("Verified-On", "").split(",") if v.strip())
        upstream = header.get("Applied-Upstream", "").strip()
        applied_upstream = Version(upstream) if upstream and upstream != "no" else None
        affects = SpecifierSet(header["Affects-Versions"]) if "Affects-Versions" in header else None
    except KeyError as missing:
        raise SeriesError(f"{file_name}: DEP-3 header lacks the field {missing}") from None
    except ValueError as bad:
        raise SeriesError(f"{file_name}: malformed version field in the DEP-3 header: {bad}") from None
    return Patch(file_name, name, header, diff_text, torch_versions, verified_on, applied_upstream, affects)


@functools.cache
def load_series() -> tuple[Patch, ...]:
    """All patches, in ``series`` order."""
    root = series_dir()
    names = [line.split("#", 1)[0].strip() for line in (root / "series").read_text().splitlines()]
    return tuple(parse_patch(n, (root / n).read_text(encoding="utf-8")) for n in names if n)


def concerns() -> dict[str, list[Patch]]:
    """Concern name -> its variants, in series order."""
    out: dict[str, list[Patch]] = {}
    for patch in load_series():
        out.setdefault(patch.name, []).append(patch)
    return out
