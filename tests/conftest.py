"""Shared pytest setup: the ``slow`` marker (deselect with ``-m "not slow"``)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes minutes (e.g. rebuilds and installs a torch wheel)")
