"""Shared pytest setup for both tiers (``tests/unit``: fast, in one process; ``tests/integration``:
fresh interpreters, threads, subprocesses, torchrun): ``tiny.py`` importable from both, and the
``slow`` marker (deselect with ``-m "not slow"``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes minutes (e.g. rebuilds and installs a torch wheel)")
