"""Shared pytest setup for both tiers (``tests/unit``: fast, in one process; ``tests/integration``:
fresh interpreters, threads, subprocesses, torchrun): ``tiny.py`` importable from both, and a fresh
empty working directory for every test (the ``slow`` marker is registered in pyproject.toml).

Tests never write to the user's store of regenerated replies, and never write to or depend on the
directory pytest was started from (the README's quick start
leaves ``runs/dflash`` there, and a default ``--out`` would collide with it): the session and each
test run in empty temp directories, so a relative path can neither reach nor read the checkout,
and hypothesis keeps its files in a temp directory too.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import HYBRID_ARCHS, make_target


def pytest_configure(config):
    # Hypothesis keeps its example database and constants cache in <cwd>/.hypothesis, a path it
    # fixes when pytest loads its plugin: point it at a temp directory before anything is collected.
    from hypothesis.configuration import set_hypothesis_home_dir

    home = tempfile.mkdtemp(prefix="dflash-tests-hypothesis-")
    config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))
    set_hypothesis_home_dir(home)
    # Module and session fixtures that regenerate replies file them here (each test: _reply_store).
    store = tempfile.mkdtemp(prefix="dflash-tests-replies-")
    config.add_cleanup(lambda: shutil.rmtree(store, ignore_errors=True))
    os.environ["DFLASH_REPLY_STORE"] = store
    # One intra-op thread in every process a test starts too (dflash train and eval take the cores
    # free of other jobs when --cpu-threads is empty: a guess, and 2 threads beside the other xdist
    # worker oversubscribe a 2-core box), as tiny.py sets it in this one.
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session", autouse=True)
def _session_cwd(tmp_path_factory):
    """Module and session fixtures also run away from the starting directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("session-cwd"))
        yield


@pytest.fixture(autouse=True)
def _test_cwd(tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def _reply_store(tmp_path_factory, monkeypatch):
    """Each test has a store of regenerated replies of its own (dflash.data.reply_store): none
    writes into the user's cache, or trains on replies another test regenerated."""
    monkeypatch.setenv("DFLASH_REPLY_STORE", str(tmp_path_factory.mktemp("reply-store")))


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def hybrid_dir(request, tmp_path_factory):
    """A random tiny Qwen3.6-layout target (tiny.make_target, 8 layers), text-only and multimodal;
    skipped where transformers has no qwen3_5 (the 4.57.1 floor)."""
    pytest.importorskip("transformers.models.qwen3_5", reason="qwen3_5 needs transformers >= 5.2")
    return make_target(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=8)
