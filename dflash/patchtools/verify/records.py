"""Write verification records (``dflash patches verify --record``); ``dflash.patching.records`` reads them."""

from __future__ import annotations

import datetime
import json
import platform

from packaging.version import Version

from dflash.patching.records import record_path
from dflash.patching.series import load_series
from dflash.patchtools.verify.checks import CheckResult

#: States in which a concern is fully settled with the series applied.
SETTLED = ("applied", "upstream", "not-applicable")


def applied_variants(results: dict[tuple[str, bool], CheckResult]) -> dict[str, str]:
    """Concern -> variant file that the patched runs applied.

    Raises:
        ValueError: a patched run had the import hook off, a concern was not settled (failed,
            pending), or two runs applied different variants.
    """
    states = {r.series and tuple(sorted(r.series.items())) for (_, patched), r in results.items() if patched}
    if len(states) != 1 or not next(iter(states)):
        raise ValueError(f"the patched runs did not all apply the same series: {sorted(map(str, states))}")
    series = dict(next(iter(states)))
    unsettled = {name: state for name, state in series.items() if state.split(" ", 1)[0] not in SETTLED}
    if unsettled:
        raise ValueError(f"the series was not fully applied in the patched runs: {unsettled}")
    return {name: state.split(" ", 1)[1] for name, state in series.items() if state.startswith("applied ")}


def make_record(torch_version: str, seconds: float, results: dict[tuple[str, bool], CheckResult], verdicts) -> dict:
    """The record of a passed run (see ``dflash.patching.records`` for the fields)."""
    by_file = {p.file_name: p for p in load_series()}
    patches = {
        name: {"file": f, "diff_sha256": by_file[f].diff_sha256} for name, f in applied_variants(results).items()
    }
    classes = sorted({c for c, _ in results})
    return {
        "release": Version(torch_version).base_version,
        "torch_version": torch_version,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": seconds,
        "patches": patches,
        "classes": {
            c: {
                "plain": [results[(c, False)].failures, results[(c, False)].calls],
                "patched": [results[(c, True)].failures, results[(c, True)].calls],
                "verdict": verdicts[c],
            }
            for c in classes
        },
    }


def write_record(record: dict):
    """Write ``record`` to ``patches/records/<release>.json``; returns the path."""
    path = record_path(record["release"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path
