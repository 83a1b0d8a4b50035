"""Where the patch series lives: the one folder that the plan, the records and the series parser read."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SERIES_PACKAGE = "dflash.patch_series"


def series_dir() -> Path:
    """The folder holding ``series`` and the patches.

    Installed (regular or editable): the ``dflash.patch_series`` package. From a
    source checkout on ``sys.path`` without installing: ``patches/`` beside ``dflash/``.
    """
    spec = importlib.util.find_spec(SERIES_PACKAGE)
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent
    return Path(__file__).resolve().parents[2] / "patches"
