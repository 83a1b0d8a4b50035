"""Apply unified-diff hunks to source text: exact context, offsets allowed, never fuzz.

A patch that does not fit raises :class:`PatchDoesNotFit` naming the hunk and
the first line that differs, and changes nothing: the caller gets either the
fully patched text or the exception.
"""

from __future__ import annotations

import unidiff


class PatchDoesNotFit(Exception):
    """A hunk's context or removed lines are not in the source, exactly."""


def _side(hunk: unidiff.Hunk, *, target: bool, eol: str) -> list[str]:
    keep = (lambda line: not line.is_removed) if target else (lambda line: not line.is_added)
    return [_with_eol(line.value, eol) for line in hunk if keep(line)]


def _with_eol(line: str, eol: str) -> str:
    return line[:-1] + eol if eol != "\n" and line.endswith("\n") and not line.endswith("\r\n") else line


def _find(lines: list[str], needle: list[str], expected: int, lower: int) -> int | None:
    """Index of ``needle`` in ``lines`` at or after ``lower``, nearest to ``expected``."""
    last = len(lines) - len(needle)
    expected = min(max(expected, lower), max(last, lower))
    for delta in range(max(expected - lower, last - expected) + 1):
        for start in {expected - delta, expected + delta}:
            if lower <= start <= last and lines[start : start + len(needle)] == needle:
                return start
    return None


def _first_difference(lines: list[str], needle: list[str], start: int) -> str:
    for offset, want in enumerate(needle):
        have = lines[start + offset] if start + offset < len(lines) else "<end of file>"
        if have != want:
            return f"line {start + offset + 1}: expected {want!r}, found {have!r}"
    return "the file is shorter than the hunk"


def apply_hunks(source: str, patched_file: unidiff.PatchedFile, *, label: str) -> str:
    """Return ``source`` with every hunk of ``patched_file`` applied.

    Args:
        source: the module's text as read from disk.
        patched_file: one file's hunks, from ``unidiff.PatchSet``.
        label: names the patch in error messages (e.g. the patch file name).

    Raises:
        PatchDoesNotFit: some hunk's context/removed lines are not found exactly
            (after the previous hunk); the message names the hunk and the first
            differing line at the expected position.
    """
    lines = source.splitlines(keepends=True)
    # A file checked out with CRLF endings (git autocrlf) gets its hunks in CRLF too.
    eol = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    out: list[str] = []
    cursor = 0
    offset = 0
    for hunk in patched_file:
        old = _side(hunk, target=False, eol=eol)
        expected = max(hunk.source_start - 1 + offset, cursor)
        start = _find(lines, old, expected, cursor)
        if start is None:
            raise PatchDoesNotFit(
                f"{label}: hunk {hunk.section_header or ''} @@ -{hunk.source_start},{hunk.source_length} "
                f"does not match {patched_file.path} ({_first_difference(lines, old, expected)})"
            )
        out.extend(lines[cursor:start])
        out.extend(_side(hunk, target=True, eol=eol))
        cursor = start + len(old)
        offset = start - (hunk.source_start - 1)
    out.extend(lines[cursor:])
    return "".join(out)
