"""A ``sys.meta_path`` finder that patches torch modules' source before they execute.

Shaped like wrapt's post-import hooks,
but it rewrites source instead of running callbacks afterwards. The first time
``torch`` is imported the finder settles the :class:`~dflash.patching.plan.Plan`
for the installed release (cached on disk, see ``cache``); each module the plan
targets then loads through :class:`PatchedSourceLoader`, which runs the patched
text compiled under the module's real file name and puts that text into
``linecache``, so tracebacks and ``inspect.getsource`` show the patched lines.

Cheap until torch is imported: at interpreter start only this module is loaded,
and the finder answers every other import with one comparison.

Python 3.11 and 3.12 print uncaught tracebacks (``sys.excepthook``,
``threading.excepthook``) in C, reading source lines from disk rather than
``linecache``; once a module is patched, the default hooks are replaced by the
``traceback`` module's printing (a hook the user set is left alone).

Known gap: ``linecache.clearcache()`` drops the patched text; tracebacks after
that show the file on disk (the code that runs is still the patched one).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import threading
import warnings

# Everything else (pathlib, the cache, the plan, the diff parser) is imported
# only once torch is: this module runs in every interpreter at start-up.

_lock = threading.Lock()
_finder: PatchFinder | None = None


class PatchWarning(RuntimeWarning):
    """The patches could not be applied as planned; the message says why and what to do."""


TORCH_FIRST_MESSAGE = (
    "torch was imported before the dflash thread-safety patch hook ran, so torch.compile/FX in this "
    "process is NOT thread-safe. Usually the interpreter skipped site-packages' .pth files "
    "(python -S, pip install --target + PYTHONPATH) or the hook was installed by hand after `import torch`. "
    "Fix: start Python normally after `pip install -e .` (check with `dflash patches status`), or install "
    "the rebuilt wheel from `dflash patches build-wheel`."
)


def patched_source(module: str, source: str, patch_files: list[str]) -> str:
    """``source`` with the hunks of ``patch_files`` for ``module`` applied, in order.

    Raises:
        dflash.patching.hunks.PatchDoesNotFit: a hunk's lines are not in ``source`` exactly.
    """
    from dflash.patching.hunks import apply_hunks
    from dflash.patching.series import load_series, module_name

    by_file = {p.file_name: p for p in load_series()}
    for file_name in patch_files:
        for patched_file in by_file[file_name].files:
            if module_name(patched_file.path) == module:
                source = apply_hunks(source, patched_file, label=file_name)
    return source


def uncovered_message(release: str, reason: str) -> str:
    return (
        f"the dflash thread-safety patch series is NOT applied to torch {release}, so torch.compile/FX in this "
        f"process is not thread-safe: {reason}. `dflash patches coverage` lists the releases it covers. "
        "To run plain torch without this warning, set DFLASH_PATCHES=0."
    )


def _module_path(torch_dir, module: str):
    path = torch_dir.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _module_stats(torch_dir, plan) -> list:
    from dflash.patching import cache

    return [list(cache.stat_key(_module_path(torch_dir, m))) for m in sorted(plan.module_patches)] if plan else []


def plan_all_or_none(torch_dir, *, allow_unverified: bool):
    """The plan for the torch at ``torch_dir``, with every planned module's hunks tried now.

    A module whose hunks do not fit refuses the whole series (``plan.refuse_partial``): modules
    load lazily, so finding out at its import could leave torch partly patched.
    """
    from dflash.patching.hunks import PatchDoesNotFit
    from dflash.patching.plan import FAILED, make_plan, refuse_partial

    plan = make_plan(torch_dir, allow_unverified=allow_unverified)
    for module, files in plan.module_patches.items():
        try:
            patched_source(module, _module_path(torch_dir, module).read_bytes().decode("utf-8"), files)
        except (OSError, PatchDoesNotFit) as error:
            for outcome in plan.outcomes.values():
                if module in outcome.modules and outcome.state != FAILED:
                    outcome.state, outcome.reason = FAILED, f"{error}; torch {plan.release} differs from its source"
            refuse_partial(plan)
            break
    plan.inputs = _module_stats(torch_dir, plan)
    return plan


class PatchedSourceLoader(importlib.machinery.SourceFileLoader):
    """Loads a torch module from its patched source; falls back to the file as-is if a patch does not fit."""

    def __init__(self, fullname: str, path: str, finder: PatchFinder) -> None:
        super().__init__(fullname, path)
        self._finder = finder
        self._failure: str | None = None
        self._loaded = None

    def _load_patched(self, fullname: str):
        """(patched source, code), or None if a patch does not fit; computed once per loader."""
        if self._loaded is None and self._failure is None:
            self._loaded = self._patch_or_fetch(fullname)
        return self._loaded

    def _patch_or_fetch(self, fullname: str):
        from pathlib import Path

        from dflash.patching import cache

        plan = self._finder.plan
        files = plan.module_patches[fullname]
        name = cache.key("module", fullname, self._finder.plan_key, files, cache.stat_key(Path(self.path)))
        hit = cache.read_module(name)
        if hit is not None:
            return hit
        from dflash.patching.hunks import PatchDoesNotFit

        original = super().get_source(fullname)
        try:
            source = patched_source(fullname, original, files)
        except PatchDoesNotFit as error:
            self._failure = (
                f"{error}; torch {plan.release} differs from the source this patch was written for. "
                f"Nothing was applied to {fullname} (patches to one module apply together)."
            )
            warnings.warn(self._failure, PatchWarning, stacklevel=2)
            return None
        code = compile(source, self.path, "exec", dont_inherit=True)
        cache.write_module(name, source, code)
        return source, code

    def get_code(self, fullname: str):
        loaded = self._load_patched(fullname)
        if loaded is None:
            return super().get_code(fullname)
        import linecache

        source, code = loaded
        # mtime None: linecache.checkcache() keeps entries it cannot compare with the disk.
        linecache.cache[self.path] = (len(source), None, source.splitlines(keepends=True), self.path)
        _print_uncaught_tracebacks_from_linecache()
        return code

    def get_source(self, fullname: str) -> str:
        loaded = self._load_patched(fullname)
        return super().get_source(fullname) if loaded is None else loaded[0]

    def exec_module(self, module) -> None:
        super().exec_module(module)
        self._finder.plan.module_done(module.__name__, failure=self._failure)


def _print_uncaught_tracebacks_from_linecache() -> None:
    if sys.version_info >= (3, 13):  # these print through the traceback module already
        return
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _excepthook
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _thread_excepthook


def _excepthook(exc_type, exc, tb) -> None:
    import traceback

    traceback.print_exception(exc_type, exc, tb)


def _thread_excepthook(args) -> None:
    # What threading's own Python fallback hook prints.
    import traceback

    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else threading.get_ident()
    print(f"Exception in thread {name}:", file=sys.stderr, flush=True)
    traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback, file=sys.stderr)
    sys.stderr.flush()


class PatchFinder:
    """Meta-path finder: routes the plan's target modules through :class:`PatchedSourceLoader`."""

    def __init__(self) -> None:
        self.plan = None
        self.plan_key: str | None = None
        self.error: str | None = None

    def _prepare(self) -> None:
        from pathlib import Path

        from dflash.patching import cache
        from dflash.patching.plan import ALLOW_UNVERIFIED_ENV, WHEEL_MARKER, Plan, series_stats

        spec = importlib.machinery.PathFinder.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return
        try:
            torch_dir = Path(next(iter(spec.submodule_search_locations)))
            allow_unverified = os.environ.get(ALLOW_UNVERIFIED_ENV, "0") == "1"
            self.plan_key = cache.key(
                "plan",
                cache.stat_key(torch_dir / "version.py"),
                cache.stat_key(torch_dir / WHEEL_MARKER),
                series_stats(),
                allow_unverified,
            )
            # An unreadable entry is a miss (cache.read_decoded): recomputed and rewritten below.
            plan = cache.read_decoded(self.plan_key, lambda payload: Plan.from_json(str(payload, "utf-8")))
            if plan is None or plan.inputs != _module_stats(torch_dir, plan):
                plan = plan_all_or_none(torch_dir, allow_unverified=allow_unverified)
                cache.write(self.plan_key, plan.to_json().encode())
            self.plan = plan
        except Exception as error:  # never break `import torch` over a problem of ours
            self.error = f"dflash patch hook disabled: {error!r}"
            warnings.warn(self.error, PatchWarning, stacklevel=2)
            return
        refused = next((o for o in plan.outcomes.values() if o.state == "failed"), None)
        if refused is not None:
            # Once per process: the plan is settled once, on the first `import torch`.
            warnings.warn(uncovered_message(plan.release, refused.reason), PatchWarning, stacklevel=2)

    def find_spec(self, fullname, path=None, target=None):
        if self.plan is None:
            if fullname != "torch" or self.error is not None:
                return None
            self._prepare()
            if self.plan is None:
                return None
        # torch itself too: its package __init__ is settled by the plan made just above.
        if fullname not in self.plan.module_patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = PatchedSourceLoader(fullname, spec.origin, self)
        return spec


def install() -> PatchFinder | None:
    """Put the finder first on ``sys.meta_path`` (once). Returns it, or None if torch came first.

    If torch is already imported nothing is patched, and a :class:`PatchWarning`
    says so and what to do.
    """
    global _finder
    with _lock:
        if _finder is not None:
            return _finder
        if "torch" in sys.modules:
            warnings.warn(TORCH_FIRST_MESSAGE, PatchWarning, stacklevel=2)
            return None
        _finder = PatchFinder()
        sys.meta_path.insert(0, _finder)
        return _finder


def active_finder() -> PatchFinder | None:
    """The installed finder, if the hook is active in this interpreter."""
    return _finder if _finder in sys.meta_path else None
