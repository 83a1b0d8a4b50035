"""What a finished pytest process leaves beside its report, so that a run in the same ``--out`` folder
reuses it instead of running it again (the full selection takes hours; a shared box seldom has them
free in one go).

Each process of a run is one *side* (an entry plain or patched, or a test run alone). When it ends on
its own (any exit, a crash, or killed at the file time limit) a record is written next to its JUnit
report: its exit, its duration, the report's sha256 and the key of what its outcomes depend on. A
process cut off with the run (the run killed, or stopped by SIGINT/SIGTERM) leaves no record, and its
old record and report are removed before it starts, so it runs again. A record is reused only when its
key is this run's: the tag's tree (sha256), the venv's torch, the pytest arguments, the file time limit,
the environment variables that change PyTorch tests' outcomes (:func:`outcome_environment`) and, on the
patched side, the series as this release applies it (plain torch runs none of it, so a change to the
series reruns only the patched sides).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

NOT_RUN = "not run yet"
CUT_OFF = "no record of its end (cut off mid-run, or run by a dflash without records)"
KEY_FIELDS = {
    "tree": "test tree (sha256)",
    "torch": "torch",
    "series": "patch series as applied",
    "args": "pytest arguments",
    "file_timeout_s": "file time limit (s)",
    "environment": "environment",
}


def outcome_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of a pytest process's environment ``env`` that change PyTorch tests' outcomes:
    ``CI`` (PyTorch's test helpers skip or change tests under it), ``OMP_NUM_THREADS`` and PyTorch's
    own ``PYTORCH_*`` switches (``PYTORCH_TEST_WITH_*``, ``PYTORCH_TEST_SKIP_FAST``, ...)."""
    return {k: v for k, v in sorted(env.items()) if k in ("CI", "OMP_NUM_THREADS") or k.startswith("PYTORCH_")}


def series_digest(release: str) -> str:
    """sha256 over the variant each concern of the series applies on torch ``release`` (by its diff's
    sha256, what the verification records name) or the state that applies none.

    Raises:
        dflash.patching.series.SeriesError: the series itself is malformed.
    """
    from packaging.version import Version

    from dflash.patching.plan import choose_variant
    from dflash.patching.series import concerns

    chosen = []
    for name, variants in concerns().items():
        outcome = choose_variant(name, variants, Version(release), allow_unverified=True)
        diff = next((p.diff_sha256 for p in variants if p.file_name == outcome.patch_file), None)
        chosen.append([name, outcome.state, diff])
    return hashlib.sha256(json.dumps(chosen).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every process of a run shares: the key's run-wide part, and the commit (reported, not compared)."""

    tree_sha256: str
    torch: str
    series: str  # :func:`series_digest`
    commit: str
    environment: dict  # :func:`outcome_environment` of the processes' environment

    def key(self, args: list[str], file_timeout_s: float, *, patched: bool) -> dict:
        key = {
            "tree": self.tree_sha256,
            "torch": self.torch,
            "args": args,
            "file_timeout_s": file_timeout_s,
            "environment": self.environment,
        }
        return {**key, "series": self.series} if patched else key


@dataclasses.dataclass(frozen=True)
class Side:
    """One pytest process's files in the run folder, the key it must have been run with, and its side."""

    xml: Path
    log: Path
    key: dict
    patched: bool

    @property
    def record(self) -> Path:
        return self.xml.with_suffix(".json")

    def finished(self) -> dict | str:
        """The record of this side's earlier end, when its key is this one's and its report is the one it
        names; otherwise why it runs (:data:`NOT_RUN`, :data:`CUT_OFF`, or what differs)."""
        try:
            record = json.loads(self.record.read_text())
            old, report = dict(record["key"]), record["report_sha256"]
        except FileNotFoundError:
            return CUT_OFF if self.log.exists() else NOT_RUN
        except (ValueError, KeyError, TypeError):
            return f"its record {self.record} is unreadable"
        changed = [
            f"{KEY_FIELDS[field]} {_short(old.get(field))} then, {_short(value)} now"
            for field, value in self.key.items()
            if old.get(field) != value
        ]
        if changed:
            return "recorded with other settings: " + "; ".join(changed)
        if _sha256(self.xml) != report:
            return f"its report {self.xml} is not the one its record names"
        return record

    def forget(self) -> None:
        """Remove the record and the report of an earlier run of this side (before it runs again)."""
        self.record.unlink(missing_ok=True)
        self.xml.unlink(missing_ok=True)

    def keep(self, returncode: int | None, seconds: float, commit: str) -> None:
        """Write the record of this side's end (via a temp file, so a cut-off write leaves none)."""
        record = {
            "key": self.key,
            "returncode": returncode,
            "seconds": seconds,
            "report_sha256": _sha256(self.xml),
            "commit": commit,
        }
        tmp = self.record.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(self.record)


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def _short(value) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "(none)"
    if isinstance(value, list):
        return " ".join(value)
    if isinstance(value, str) and len(value) == 64:  # a sha256
        return value[:12]
    return str(value)
