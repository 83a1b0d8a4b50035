"""The refresh's three-way carry of a source diff onto another release (fast, no torch sources needed)."""

import pytest

from dflash.patchtools.refresh import NeedsHuman, carry, merge_lines_apart, unified

BASE = "".join(f"line {i}\n" for i in range(1, 11))


def test_carry_follows_a_release_that_moved_the_code():
    patched = BASE.replace("line 5\n", "line 5\nadded by the patch\n")
    release = "new header\n" * 4 + BASE
    assert carry(BASE, patched, release, where="t") == "new header\n" * 4 + patched


def test_edits_of_neighbouring_lines_merge_but_the_same_line_needs_a_human():
    patched = BASE.replace("line 5\n", "line five, patched\n")
    release = BASE.replace("line 4\n", "line four, retyped\n")
    assert carry(BASE, patched, release, where="t") == BASE.replace("line 4\n", "line four, retyped\n").replace(
        "line 5\n", "line five, patched\n"
    )
    clash = BASE.replace("line 5\n", "line 5 changed upstream\n")
    with pytest.raises(
        NeedsHuman, match=r"t: the patch changes lines 5-5 .*\n.*'line 5\\n'.*\n.*'line five, patched\\n'"
    ):
        carry(BASE, patched, clash, where="t")


def test_insertions_at_the_same_point_conflict():
    assert merge_lines_apart(["a\n", "b\n"], ["a\n", "x\n", "b\n"], ["a\n", "y\n", "b\n"]) is None


def test_unified_has_three_lines_of_context():
    text = unified("torch/t.py", BASE, BASE.replace("line 5\n", "LINE 5\n"))
    assert text.startswith("--- a/torch/t.py\n+++ b/torch/t.py\n@@ -2,7 +2,7 @@\n")
