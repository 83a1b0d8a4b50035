"""Reading the small JSON files a run is configured by (a target's or a drafter's ``config.json``),
with errors that name the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path, *, error: type[Exception], name: str, fix: str) -> dict:
    """The JSON object in ``path``.

    Args:
        error: the exception class to raise.
        name (str): how messages name the file (e.g. ``target /models/x/config.json``).
        fix (str): what to do about it, appended to every message.

    Raises:
        error: the file cannot be read or decoded, or holds another JSON value than an object.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{name}: missing or unreadable ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise error(f"{name}: expected a JSON object, got {type(value).__name__}; {fix}")
    return value
