"""Everything the kit writes in words: commit messages, per-commit PR descriptions, the cover note.

The *how* of each commit is taken from its patch's DEP-3 ``Description:`` (the paragraphs after the
first; a ``Fix:`` line starts one), so it follows the patch; sentences that speak of this project
(variant notes, which release a patch was checked on, bug-class letters, patch numbers) are dropped.
What is left must pass :func:`internal_references`, which the kit runs on every file it writes.
"""

from __future__ import annotations

import re
import textwrap

from dflash.patching.series import Patch
from dflash.patchtools.upstream.concerns import CONCERNS, UpstreamConcern

# Text that means something only inside this project, or binds the text to one release.
INTERNAL = {
    "project name": r"dflash|DFLASH",
    "bug-class notes": r"torch_races|\bRace class|\bclass(?:es)? [A-Z](?:\b|,)",
    "local paths": r"\.\./shared|/work/|/shared/",
    "patch-series terms": (
        r"Variant for|\bvariants?\b|Patch-Name|Verified-On|Torch-Versions|DEP-3|\bseries\b|\b(?:as in|see) 000\d\b"
        r"|\b\d{4}-(?:" + "|".join(sorted({re.escape(c.name) for c in CONCERNS})) + r")\b"
    ),
    "where a patch was checked": (
        r"Not yet run|\binterpreter\b|checked standalone|toy config|Written against|sources not checked"
    ),
    # Text that says which releases it is for: the kit is for main, so none may.
    "release-bound wording": (
        r"\b[Bb]ackport|\b[Nn]ot applicable to\b|\brelease branch|\b(?:torch|PyTorch) [12]\.\d+"
        r"|\b(?:[Ss]ince|[Uu]p to|[Bb]efore|[Aa]fter|[Ff]rom|[Uu]ntil|[Oo]n|[Ff]or|[Ii]n) [12]\.\d+(?:\.\d+)?\b"
        r"|\b[12]\.\d+(?:\.\d+)? (?:and|or) (?:later|newer|earlier|older)\b|\b[12]\.\d+\+"
        r"|\b(?:on|for) this tree\b|\bthis tree's\b"
    ),
}
_INTERNAL_RE = {what: re.compile(pattern) for what, pattern in INTERNAL.items()}
_SUBSTITUTIONS = (
    (re.compile(r"\s*\((?:race )?class(?:es)? [A-Z][^)]*\)"), ""),
    (re.compile(r"\((?:as in |see )?000\d-([a-z0-9-]+)\)"), r"(\1)"),
    (re.compile(r"\b[Ss]ince [12]\.\d+(?:\.\d+)?,?\s+"), ""),
    (re.compile(r"\(as in 000\d for ([^)]*)\)"), r"(as for \1)"),
    (re.compile(r"pytorch (?:PR|issue) (\d+)"), r"#\1"),
    (re.compile(r"pytorch#(\d+)"), r"#\1"),
)
_PARAGRAPH_LEADS = ("Fix:", "Variant ", "Not yet run", "Race class", "Left alone:", "Not fixed here:")
# Paragraphs about the patch file itself (which releases it is for, where it was checked), not the change.
_DROPPED_LEADS = ("Variant ", "Not yet run", "Race class")


def internal_references(text: str) -> list[str]:
    """``what: 'match'`` for each piece of project-internal or release-bound text in ``text``."""
    return [f"{what}: {m.group(0)!r}" for what, rx in _INTERNAL_RE.items() for m in rx.finditer(text)]


def _header_paragraphs(patch: Patch) -> list[str]:
    """The description below its summary line, split at ``.`` lines and at lines opening a new topic."""
    lines = patch.description.split("\n")[1:]
    paragraphs: list[list[str]] = [[]]
    for line in lines:
        stripped = line.strip()
        if stripped == ".":
            paragraphs.append([])
        elif stripped.startswith(_PARAGRAPH_LEADS) and paragraphs[-1]:
            paragraphs.append([stripped])
        else:
            paragraphs[-1].append(stripped)
    return [" ".join(p) for p in paragraphs if p]


def _sentences(paragraph: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+(?=[A-Z(`])", paragraph)


def _clean(paragraph: str, concern_titles: dict[str, str]) -> str:
    for rx, replacement in _SUBSTITUTIONS:
        paragraph = rx.sub(replacement, paragraph)
    for name in {c.name for c in CONCERNS}:
        if name in concern_titles:
            paragraph = paragraph.replace(f"({name})", f'("{concern_titles[name]}" in this stack)')
        else:  # not a commit of this stack (upstream already, kept out or proposed)
            paragraph = re.sub(rf"\s*\({re.escape(name)}\)", "", paragraph)
    kept = [s for s in _sentences(paragraph) if not internal_references(s)]
    return " ".join(kept).strip()


def _capitalized(paragraph: str) -> str:
    """First letter upper-cased, unless the paragraph opens with an identifier (``error_on_graph_break``)."""
    return paragraph[:1].upper() + paragraph[1:] if re.match(r"[a-z]+[ ,;:]", paragraph) else paragraph


def how_paragraphs(patch: Patch, concern_titles: dict[str, str]) -> list[str]:
    """How the patch fixes it, from its header: the paragraphs after the first (from a ``Fix:`` line on,
    when there is one), each cleaned; the last sentence of the description when nothing else is left."""
    paragraphs = _header_paragraphs(patch)
    fix_at = next((i for i, p in enumerate(paragraphs) if p.startswith("Fix:")), None)
    chosen = paragraphs[fix_at:] if fix_at is not None else paragraphs[1:]
    chosen = [p.removeprefix("Fix:").strip() for p in chosen if not p.startswith(_DROPPED_LEADS)]
    cleaned = [_capitalized(c) for c in (_clean(p, concern_titles) for p in chosen) if c]
    if not cleaned and paragraphs:
        cleaned = [c for c in [_clean(_sentences(paragraphs[-1])[-1], concern_titles)] if c]
    return cleaned


def how_of(concern: UpstreamConcern, patch: Patch, concern_titles: dict[str, str]) -> list[str]:
    """The commit's *how* paragraphs: the concern form's own, else those of the patch's header."""
    return list(concern.how) if concern.how else how_paragraphs(patch, concern_titles)


def stale_identifiers(concern: UpstreamConcern, known_text: str) -> list[str]:
    """Backticked names in ``concern``'s problem and BC text whose last dotted part is not in ``known_text``
    (the patch's header and diff, the commit's tests and changed files): text that no longer matches the
    patch. The ``related`` text speaks of other PRs and is not checked."""
    own = " ".join([concern.problem, *concern.bc])
    stale = []
    for quoted in re.findall(r"`([^`]+)`", own):
        name = quoted.split("(")[0].rstrip(".").split(".")[-1]
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and name not in known_text:
            stale.append(quoted)
    return sorted(set(stale))


def _wrap(paragraph: str, width: int = 72) -> str:
    return textwrap.fill(paragraph, width=width, break_long_words=False, break_on_hyphens=False)


def links(concern: UpstreamConcern, patch: Patch) -> list[str]:
    """``Fixes #N`` / ``Part of #N`` / ``See also #N`` lines: the concern's own, plus the patch's ``Bug:`` URLs."""
    from_header = [
        int(n) for n in re.findall(r"github\.com/pytorch/pytorch/(?:issues|pull)/(\d+)", patch.header.get("Bug", ""))
    ]
    lines = [f"Fixes #{n}" for n in concern.fixes]
    lines += [f"Part of #{n}" for n in concern.part_of if n not in concern.fixes]
    cited = set(concern.fixes) | set(concern.part_of)
    lines += [f"See also #{n}" for n in dict.fromkeys([*concern.see_also, *from_header]) if n not in cited]
    return lines


def commit_message(
    concern: UpstreamConcern, how: list[str], test_plan: list[str], link_lines: list[str], edits_why: list[str]
) -> str:
    parts = [f"[{concern.area}] {concern.title}", _wrap(concern.problem), *map(_wrap, how)]
    if edits_why:
        parts.append("\n".join(textwrap.fill(f"- {why}", 72, subsequent_indent="  ") for why in edits_why))
    parts.append("Test Plan:\n" + "\n".join(test_plan))
    parts.append("\n".join(link_lines))
    return "\n\n".join(parts) + "\n"


def run_table(rows: list[dict]) -> str:
    """Markdown table of one concern's test runs: test, without the commit, with it."""
    out = ["| test | without this commit | with it |", "|---|---|---|"]
    out += [f"| `{r['test']}` | {r['without']} | {r['with']} |" for r in rows]
    return "\n".join(out)


def patch_text_to_check(patch_text: str) -> str:
    """The part of a ``git format-patch`` file that the kit wrote: the message and the added lines (the
    context lines are the tree's own code)."""
    message, _, diff = patch_text.partition("\n---\n")
    added = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return message + "\n" + "\n".join(added)
