"""Which patches apply to the installed torch, and what became of each: the plan.

A :class:`Plan` is plain data (JSON round-trips it), so the import hook can
cache it and skip reading the series on every ``import torch``. Building one
(:func:`make_plan`) needs the series parser and ``packaging``; those are
imported inside it, because this module is imported while ``torch`` itself is
being imported (the records and the series folder are cheap to import).

States of a concern:

- ``applied``: every module it edits was imported with its hunks applied;
- ``pending``: planned, but a module it edits has not been imported yet;
- ``upstream``: the installed torch already has the fix (``Applied-Upstream:``);
- ``built-in``: torch is a wheel rebuilt by ``dflash patches build-wheel``;
- ``not-applicable``: this torch release does not have the bug (``Affects-Versions:``);
- ``failed``: refused (no variant for a release that has the bug, unverified
  release, torch imported before the hook) or a hunk did not fit; the reason
  says which and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from pathlib import Path

from dflash.patching.records import load_record, verified_diff
from dflash.patching.series_path import series_dir

APPLIED, PENDING, UPSTREAM, BUILT_IN = "applied", "pending", "upstream", "built-in"
NOT_APPLICABLE, FAILED = "not-applicable", "failed"
ALLOW_UNVERIFIED_ENV = "DFLASH_PATCHES_ALLOW_UNVERIFIED"
# Written into torch/ by `dflash patches build-wheel`: the fix is in the files already.
WHEEL_MARKER = "_dflash_patches.json"


@dataclasses.dataclass
class Outcome:
    """One concern of the series in this interpreter.

    Attributes:
        name: the concern (``Patch-Name:``).
        state: one of the states above.
        reason: why, and what to do if it failed.
        patch_file: the variant chosen for this torch, if any.
        modules: dotted names of the torch modules that variant edits.
    """

    name: str
    state: str
    reason: str
    patch_file: str | None = None
    modules: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "state": self.state, "reason": self.reason}


class Plan:
    """The outcomes for one torch release, and the patch files each module needs (in series order)."""

    def __init__(self, release: str, outcomes: list[Outcome]) -> None:
        self.release = release
        self.outcomes = {o.name: o for o in outcomes}
        self.module_patches: dict[str, list[str]] = {}
        for outcome in outcomes:
            if outcome.state == PENDING:
                for module in outcome.modules:
                    self.module_patches.setdefault(module, []).append(outcome.patch_file)
        self._waiting = {o.name: set(o.modules) for o in outcomes if o.state == PENDING}
        self._lock = threading.Lock()
        #: Stat keys of the planned modules' files when their hunks were tried (the import hook's cache check).
        self.inputs: list = []

    def to_json(self) -> str:
        outcomes = [dataclasses.asdict(o) for o in self.outcomes.values()]
        return json.dumps({"release": self.release, "outcomes": outcomes, "inputs": self.inputs})

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        plan = cls(data["release"], [Outcome(**{**o, "modules": tuple(o["modules"])}) for o in data["outcomes"]])
        plan.inputs = data.get("inputs", [])
        return plan

    def module_done(self, module: str, *, failure: str | None = None) -> None:
        """Record that ``module`` was imported patched, or (``failure`` given) left unpatched."""
        with self._lock:
            for outcome in self.outcomes.values():
                if module not in self._waiting.get(outcome.name, ()) or outcome.state != PENDING:
                    continue
                if failure is not None:
                    outcome.state, outcome.reason = FAILED, failure
                    continue
                self._waiting[outcome.name].discard(module)
                if not self._waiting[outcome.name]:
                    outcome.state = APPLIED
                    outcome.reason = f"{', '.join(outcome.modules)} patched at import ({outcome.patch_file})"

    def refuse_all(self, reason: str) -> None:
        """Mark every planned concern failed (e.g. torch was imported before the hook); nothing gets patched."""
        with self._lock:
            for outcome in self.outcomes.values():
                if outcome.state == PENDING:
                    outcome.state, outcome.reason = FAILED, reason
            self.module_patches = {}
            self._waiting = {}


def torch_release(torch_dir: Path) -> str:
    """The torch release string (``2.13.0+cpu``) from ``torch/version.py``, without importing torch.

    Raises:
        ValueError: ``version.py`` has no ``__version__`` line.
    """
    text = (torch_dir / "version.py").read_text(encoding="utf-8")
    match = re.search(r"^__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    if match is None:
        raise ValueError(f"cannot read __version__ from {torch_dir / 'version.py'}")
    return match.group(1)


def choose_variant(name, variants, release, allow_unverified: bool, record: dict | None = None) -> Outcome:
    """The outcome of concern ``name`` (its ``variants``, in series order) on torch ``release`` (a ``Version``).

    ``record`` is the verification record of ``release`` (:mod:`dflash.patching.records`); the
    chosen variant counts as verified when the record names its diff's sha256.
    """
    upstream = next((p.applied_upstream for p in variants if p.applied_upstream), None)
    if upstream is not None and release >= upstream:
        return Outcome(name, UPSTREAM, f"torch {release} has this fix upstream (since {upstream})")
    fitting = [p for p in variants if p.torch_versions.contains(release, prereleases=True)]
    if len(fitting) > 1:
        raise ValueError(f"{name}: variants {[p.file_name for p in fitting]} all claim torch {release}")
    if not fitting:
        made_for = sorted({r for p in variants for r in p.generated_on})
        ranges = "variants exist for torch " + ", ".join(map(str, made_for)) if made_for else "no variants generated"
        affects = next((p.affects_versions for p in variants if p.affects_versions is not None), None)
        if affects is not None and not affects.contains(release, prereleases=True):
            return Outcome(name, NOT_APPLICABLE, f"torch {release} does not have this bug ({ranges})")
        return Outcome(
            name,
            FAILED,
            f"torch {release} has this bug but the series has no variant for it ({ranges})",
        )
    patch = fitting[0]
    if not allow_unverified and verified_diff(record, name) != patch.diff_sha256:
        when = (
            f"its record of {record['date']} names another diff"
            if record and name in record["patches"]
            else "no record"
        )
        return Outcome(
            name,
            FAILED,
            f"{patch.file_name} was not verified on torch {release} ({when}); refusing to patch. Install a "
            f"release `dflash patches coverage` lists as verified, or set {ALLOW_UNVERIFIED_ENV}=1 to apply it "
            "anyway (exact-context application, never fuzzy; then run `dflash patches verify --record`)",
            patch.file_name,
            patch.modules,
        )
    return Outcome(name, PENDING, "hook active; module not imported yet", patch.file_name, patch.modules)


def refuse_partial(plan: Plan) -> None:
    """All or none: when any concern failed, refuse the planned ones too (a partly patched torch is
    neither the tested plain torch nor the tested series)."""
    failed = [o for o in plan.outcomes.values() if o.state == FAILED]
    if failed:
        plan.refuse_all(
            f"not applied: the series applies all or none, and {failed[0].name} failed ({failed[0].reason})"
        )


def make_plan(torch_dir: Path, *, allow_unverified: bool) -> Plan:
    """Decide, for the torch installed at ``torch_dir``, what each concern of the series does.

    All or none (:func:`refuse_partial`). Raises:
        dflash.patching.series.SeriesError: the series itself is malformed.
    """
    from packaging.version import Version

    from dflash.patching.series import concerns

    version = torch_release(torch_dir)
    marker = torch_dir / WHEEL_MARKER
    if marker.exists():
        built_in = json.loads(marker.read_text(encoding="utf-8")).get("patches", [])
        return Plan(version, [Outcome(n, BUILT_IN, f"torch was rebuilt with this patch ({marker})") for n in built_in])
    release = Version(Version(version).base_version)
    record = load_record(release)
    plan = Plan(version, [choose_variant(n, v, release, allow_unverified, record) for n, v in concerns().items()])
    refuse_partial(plan)
    return plan


def series_stats() -> list[tuple]:
    """(path, mtime_ns, size) of every file under the series folder: the plan cache's key covers them
    all (variants, records). ``os.scandir`` because this runs on every ``import torch``."""
    out = []
    folders = [str(series_dir())]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir():
                    folders.append(entry.path)
                elif not entry.name.endswith(".pyc"):
                    st = entry.stat()
                    out.append((entry.path, st.st_mtime_ns, st.st_size))
    return sorted(out)
