"""Shared pytest setup: a fresh empty working directory for every test (the ``slow`` marker is
registered in pyproject.toml).

Tests never write to or depend on the directory pytest was started from (the README's quick start
leaves ``runs/dflash`` there, and a default ``--out`` would collide with it): the session and each
test run in empty temp directories, so a relative path can neither reach nor read the checkout.
"""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_cwd(tmp_path_factory):
    """Module and session fixtures also run away from the starting directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("session-cwd"))
        yield


@pytest.fixture(autouse=True)
def _test_cwd(tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
