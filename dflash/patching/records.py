"""Verification records: which variant diffs passed the bug-class checks on which torch release.

``dflash patches verify --record`` writes ``patches/records/<release>.json`` after a run in which
no check failed with the series applied. The plan applies a variant by default only when the
record of the installed release names the sha256 of that variant's diff (the text below its
``---`` line: header edits, such as a rewritten Description, keep records valid; any change to
what is applied needs a new run). Read once per plan; the plan is cached (``cache``).

Record fields: ``release`` (``2.13.0``), ``torch_version`` (the build, ``2.13.0+cpu``),
``python``, ``date`` (ISO 8601, UTC), ``seconds`` (per check), ``patches`` (concern ->
``{"file", "diff_sha256"}``), ``classes`` (class letter -> ``{"plain": [failures, calls],
"patched": [failures, calls], "verdict"}``).
"""

from __future__ import annotations

import json

from dflash.patching.series_path import series_dir

RECORDS_DIR = "records"


def record_path(release):
    """Where the record of ``release`` (a ``Version`` or ``"2.13.0"``) lives."""
    return series_dir() / RECORDS_DIR / f"{release}.json"


def load_record(release) -> dict | None:
    """The record of ``release``, or None when there is none.

    Raises:
        ValueError: the file is not a JSON record (names the file).
    """
    path = record_path(release)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError as error:
        record = error
    if not isinstance(record, dict) or not isinstance(record.get("patches"), dict) or "date" not in record:
        raise ValueError(f"{path} is not a verification record; delete it and rerun `dflash patches verify --record`")
    return record


def verified_diff(record: dict | None, concern: str) -> str | None:
    """The diff sha256 ``record`` verified for ``concern``, if any."""
    if record is None:
        return None
    return record["patches"].get(concern, {}).get("diff_sha256")


def all_records() -> dict[str, dict]:
    """Release string -> record, for every record shipped."""
    folder = series_dir() / RECORDS_DIR
    return {p.stem: load_record(p.stem) for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}
