"""Patch 0005 (config-process-defaults): the two config layers as snapshot/restore code sees them.

With the series, a plain assignment (``config.x = v``), ``load_config`` and ``del config.x`` act on a
process-wide layer, ``config.patch()`` on the calling thread's layer. These tests pin what code that
snapshots, restores or resets config sees (pytorch's test/test_utils_config_module.py found the
regressions; its files are not vendored). Fast: in-process, on a toy config module; they need the
series applied (the import hook, as installed), and skip otherwise.
"""

import importlib.util
import inspect
import itertools
import sys
import threading
from unittest import mock

import pytest
import torch.utils._config_module as config_module
from tiny import in_thread

if not hasattr(config_module.ConfigModule, "_swap_patch_value"):
    pytest.skip("the dflash patch series is not applied to this torch", allow_module_level=True)
if "readonly_values" not in inspect.signature(config_module.ConfigModule._get_dict).parameters:
    # Before 2.12 (process-global config) _get_dict has no cached form and reads hidden keys
    # through getattr; the 2.10-2.11 variant gets the same del/reset/lock changes, checked by verify.
    pytest.skip("these tests use the config module API of torch >= 2.12", allow_module_level=True)

TOY = """
e_int = 1
e_bool = True
e_list = [1]
e_str = "a"

from torch.utils._config_module import install_config_module
import sys
install_config_module(sys.modules[__name__])
"""
_names = itertools.count()


@pytest.fixture
def config(tmp_path):
    name = f"dflash_toy_config_{next(_names)}"
    path = tmp_path / f"{name}.py"
    path.write_text(TOY)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield sys.modules[name]
    del sys.modules[name]


def test_del_then_get_dict_reports_the_default(config):
    config.e_int = 42
    del config.e_int
    assert config._get_dict()["e_int"] == 1
    assert config._get_dict(readonly_values=True)["e_int"] == 1
    assert pickle_loads(config.save_config())["e_int"] == 1
    with pytest.raises(AttributeError):
        config.e_int  # noqa: B018  (hidden until assigned again, as on plain torch)
    config.e_int = 3
    assert config.e_int == 3 and in_thread(lambda: config.e_int) == 3


def test_del_inside_a_patch_stays_in_the_patch(config):
    with config.patch(e_int=5):
        del config.e_int
        assert config._get_dict()["e_int"] == 1
        config.e_int = 7  # unittest.mock assigns right after its delete
        assert config.e_int == 7 and in_thread(lambda: config.e_int) == 1
    assert config.e_int == 1 and config._get_dict()["e_int"] == 1


def test_del_inside_a_patch_hides_nothing_from_other_threads(config):
    # unittest.mock.patch's undo inside a config.patch() of the same key, in this thread only.
    with config.patch(e_int=5):
        del config.e_int
        with pytest.raises(AttributeError):
            config.e_int  # noqa: B018  (this thread: hidden until assigned again, as on plain torch)
        assert in_thread(lambda: config.e_int) == 1  # another thread: untouched
        config.e_int = 5
        assert config.e_int == 5 and in_thread(lambda: config.e_int) == 1
    assert config.e_int == 1 and in_thread(lambda: config.e_int) == 1


def test_mock_patch_inside_a_config_patch_leaves_no_process_value(config):
    with config.patch(e_int=5):
        with mock.patch.object(config, "e_int", 9):
            assert config.e_int == 9
        assert config.e_int == 5
    assert config.e_int == 1 and in_thread(lambda: config.e_int) == 1


def test_reset_process_overrides_clears_assignments_of_every_thread(config):
    base_hash = config.get_hash()
    in_thread(lambda: setattr(config, "e_bool", False))
    config.e_str = "b"
    config.load_config({"e_int": 9})
    assert config.get_hash() != base_hash
    in_thread(config.get_hash)  # fills that thread's cache; the reset must invalidate caches everywhere
    config.reset_process_overrides()
    assert (config.e_int, config.e_bool, config.e_str) == (1, True, "a")
    assert in_thread(lambda: (config.e_int, config.e_bool, config.e_str)) == (1, True, "a")
    assert config.get_hash() == base_hash and in_thread(config.get_hash) == base_hash
    assert config.codegen_config() == ""


def test_reset_process_overrides_keeps_this_threads_patch(config):
    config.e_int = 2
    with config.patch(e_int=5):
        config.reset_process_overrides()
        assert config.e_int == 5 and in_thread(lambda: config.e_int) == 1
    assert config.e_int == 1


def test_save_config_is_never_a_mix_of_two_load_configs(config):
    """A snapshot taken while another thread restores one is either before or after it, never half."""
    first = {"e_int": 10, "e_bool": False, "e_str": "x", "e_list": [10]}
    second = {"e_int": 20, "e_bool": True, "e_str": "y", "e_list": [20]}
    stop = threading.Event()
    mixed = []

    def restore():
        while not stop.is_set():
            config.load_config(first)
            config.load_config(second)

    def snapshot():
        for _ in range(3000):
            seen = pickle_loads(config.save_config())
            picked = {k: seen[k] for k in first}
            if picked not in (first, second):
                mixed.append(picked)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so a torn read shows
    try:
        writer = threading.Thread(target=restore)
        writer.start()
        try:
            snapshot()
        finally:
            stop.set()
            writer.join()
    finally:
        sys.setswitchinterval(interval)
    assert not mixed, f"{len(mixed)} snapshots mixed two load_config calls, e.g. {mixed[0]}"


def test_an_assignment_in_a_thread_is_process_wide(config):
    """The documented behaviour change (pytorch's test_get_hash_per_thread_isolation expects the opposite)."""
    base_hash = config.get_hash()
    in_thread(lambda: setattr(config, "e_int", 999))
    assert config.e_int == 999 and config.get_hash() != base_hash


def pickle_loads(blob):
    import pickle

    return pickle.loads(blob)
