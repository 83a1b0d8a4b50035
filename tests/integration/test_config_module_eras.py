"""Patch 0005 (config-process-defaults) on every release's own config module, from its sources.

``tests/unit/test_config_layers.py`` pins the two config layers on the installed torch only. Here each
release tree in ``DFLASH_TORCH_SOURCES`` (``scripts/fetch_torch_sources.py``; skipped without it)
gives its ``torch/utils/_config_module.py``, with the series' variant for that release applied (or
plain), loaded as a standalone module and installed on a toy config: a ``config.patch`` entered in
one thread must stay invisible to the others, a plain assignment in a worker thread must reach every
thread, ``unittest.mock.patch`` inside a patch must leave no process-wide value, ``get_hash`` must
follow this thread's view. The threads are sequenced with events, so the outcome is deterministic.
Before 2.12 config is process-global: the plain module fails the isolation check there (shown
below), the patched one must pass it. Fast (in-process, no torch import of another release).
"""

import importlib.util
import itertools
import os
import queue
import threading
from pathlib import Path
from unittest import mock

import pytest
from packaging.version import Version

from dflash.patching.importhook import _module_path, patched_source, plan_all_or_none
from dflash.patching.plan import FAILED, torch_release

SOURCES = os.environ.get("DFLASH_TORCH_SOURCES")
TREES = sorted(
    (p / "torch" for p in Path(SOURCES).iterdir() if (p / "torch" / "version.py").exists()) if SOURCES else (),
    key=lambda tree: Version(torch_release(tree)),
)
CONFIG_MODULE = "torch.utils._config_module"
_names = itertools.count()

if not TREES:
    pytest.skip("DFLASH_TORCH_SOURCES not set: run scripts/fetch_torch_sources.py", allow_module_level=True)


def load_config_module(tree: Path, *, patched: bool):
    """The release's config module (patched with the series' variant for it, or plain), as a fresh module."""
    path = _module_path(tree, CONFIG_MODULE)
    source = path.read_text(encoding="utf-8")
    if patched:
        plan = plan_all_or_none(tree, allow_unverified=True)
        failed = [f"{o.name}: {o.reason}" for o in plan.outcomes.values() if o.state == FAILED]
        assert not failed, failed
        assert CONFIG_MODULE in plan.module_patches, f"the series patches no config module on {tree.parent.name}"
        source = patched_source(CONFIG_MODULE, source, plan.module_patches[CONFIG_MODULE])
    module = type(importlib)(f"dflash_config_module_{next(_names)}")
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def toy_config(config_module, tmp_path):
    """A config module with ``limit = 8`` installed by ``config_module.install_config_module``."""
    name = f"dflash_toy_config_{next(_names)}"
    path = tmp_path / f"{name}.py"
    path.write_text("limit = 8\nname = 'a'\n")
    spec = importlib.util.spec_from_file_location(name, path)
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    config_module.install_config_module(toy)
    return toy


def read_while_other_thread_patches(config) -> tuple[int, int, int]:
    """(main's read while a worker holds ``patch(limit=100)``, the worker's read there, main's read after)."""
    entered, release = threading.Event(), threading.Event()
    seen = []

    def worker():
        with config.patch(limit=100):
            seen.append(config.limit)
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(10), "the worker thread never entered its patch"
    during = config.limit
    release.set()
    thread.join(10)
    return during, seen[0], config.limit


def in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(10)
    return out[0]


@pytest.mark.parametrize("tree", TREES, ids=lambda tree: tree.parent.name)
def test_patched_config_layers_on_each_release(tree, tmp_path):
    config = toy_config(load_config_module(tree, patched=True), tmp_path)
    assert read_while_other_thread_patches(config) == (8, 100, 8)

    in_thread(lambda: setattr(config, "limit", 9))
    assert config.limit == 9, "a plain assignment in a worker thread must be process-wide"

    outside = config.get_hash()
    with config.patch(limit=5):
        assert config.get_hash() != outside
        with mock.patch.object(config, "limit", 77):
            assert config.limit == 77
            assert in_thread(lambda: config.limit) == 9
        assert config.limit == 5
    assert config.limit == 9 and in_thread(lambda: config.limit) == 9
    assert config.get_hash() == outside


@pytest.mark.parametrize(
    "tree", [t for t in TREES if Version(torch_release(t)) < Version("2.12")], ids=lambda tree: tree.parent.name
)
def test_plain_config_module_leaks_a_patch_to_other_threads(tree, tmp_path):
    """The check above can fail: on plain torch before 2.12 another thread sees the worker's patch."""
    config = toy_config(load_config_module(tree, patched=False), tmp_path)
    during, inside, after = read_while_other_thread_patches(config)
    assert (inside, after) == (100, 8)
    assert during == 100


class ThreadWithCache:
    """One worker thread kept alive, whose get_hash() cache lives across calls."""

    def __init__(self, config) -> None:
        self.config = config
        self.jobs, self.results = queue.Queue(), queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            self.results.put(self.jobs.get()())

    def get_hash(self):
        self.jobs.put(self.config.get_hash)
        return self.results.get(timeout=10)


def _get_hash_as_pytorch_tests_it(config) -> None:
    """The steps of PyTorch's ``TestConfigModule.test_get_hash`` (test/test_utils_config_module.py, up to
    2.12, whose config modules cache the digest in ``_hash_digest``), on the toy config; first, that
    ``_is_dirty = True`` (what code that changes config in place sets) drops every thread's cache."""
    first = config.get_hash()
    worker = ThreadWithCache(config)
    assert worker.get_hash() == first
    entry = config._config["name"]  # changed in place: no write marks the cache stale
    if isinstance(entry, str):  # 2.5 keeps values, later releases entries
        config._config["name"] = "b"
    else:
        entry.default = "b"
    config._is_dirty = True
    changed = config.get_hash()
    assert worker.get_hash() == changed != first

    assert config.get_hash() == changed and config._hash_digest == changed
    config._hash_digest = "fake"
    assert config.get_hash() == "fake"
    config.limit = 9
    assert config.get_hash() != changed


@pytest.mark.parametrize(
    "tree",
    [tree for tree in TREES if Version(torch_release(tree)) < Version("2.13")],
    ids=lambda tree: tree.parent.name,
)
@pytest.mark.parametrize("patched", [False, True], ids=["plain", "patched"])
def test_assignments_to_the_hash_cache_work_as_on_plain_torch(tree, patched, tmp_path):
    _get_hash_as_pytorch_tests_it(toy_config(load_config_module(tree, patched=patched), tmp_path))
