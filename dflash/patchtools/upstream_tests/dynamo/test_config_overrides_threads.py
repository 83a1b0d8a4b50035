# Owner(s): ["module: dynamo"]
"""torch's own temporary config overrides stay in the thread that makes them (#118260).

``disable_cache_limit``, flex_attention's ``_set_compilation_env``, inductor's
``DebugDirManager`` and dynamo's ``replay`` override dynamo config for a region.
Done with assignments, the override would be seen by (and undone by) other
threads; done with ``config.patch`` it stays per-thread. Each test holds the
region open in one thread with events and reads the config from another, outside
any patch of its own.
"""

import os
import sys
import tempfile
import threading
import types
from unittest import mock

import torch
from torch._dynamo import convert_frame
import torch._dynamo.test_case
from torch._dynamo.test_case import run_tests
from torch._dynamo.utils import disable_cache_limit
from torch._higher_order_ops.utils import _set_compilation_env
from torch._inductor.utils import DebugDirManager

TIMEOUT_S = 60


class ConfigOverrideThreadTests(torch._dynamo.test_case.TestCase):
    def read_while_held(self, run, read):
        """(``read()`` in a worker thread where ``run(held)`` calls ``held()``,
        ``read()`` here meanwhile). ``run`` runs in the worker and must call
        ``held()`` once, inside the region."""
        entered, release = threading.Event(), threading.Event()
        inside, errors = [], []

        def held():
            inside.append(read())
            entered.set()
            release.wait(TIMEOUT_S)

        def work():
            try:
                run(held)
            except Exception as e:  # reported by the test, not lost in the thread
                errors.append(e)
                entered.set()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        try:
            self.assertTrue(
                entered.wait(TIMEOUT_S), "the worker never entered the region"
            )
            here = read()
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        self.assertFalse(thread.is_alive(), "the worker did not leave the region")
        self.assertEqual(errors, [])
        return inside[0], here

    def in_region(self, region):
        def run(held):
            with region():
                held()

        return run

    def test_disable_cache_limit_stays_in_its_thread(self):
        config = torch._dynamo.config

        def read():
            return (config.recompile_limit, config.accumulated_recompile_limit)

        before = read()
        inside, here = self.read_while_held(self.in_region(disable_cache_limit), read)
        self.assertEqual(inside, (sys.maxsize, sys.maxsize))
        self.assertEqual(here, before)
        self.assertEqual(read(), before)

    def test_flex_compilation_env_stays_in_its_thread(self):
        config = torch._dynamo.config

        def read():
            return (config.allow_empty_graphs, config.capture_scalar_outputs)

        before = read()
        self.assertNotEqual(before, (True, True), "the override would not show")
        inside, here = self.read_while_held(self.in_region(_set_compilation_env), read)
        self.assertEqual(inside, (True, True))
        self.assertEqual(here, before)
        self.assertEqual(read(), before)

    def test_debug_dir_manager_stays_in_its_thread(self):
        config = torch._dynamo.config
        old = config.debug_dir_root
        with tempfile.TemporaryDirectory() as root:
            config.debug_dir_root = root
            try:

                def run(held):
                    if config.debug_dir_root != root:
                        raise AssertionError(
                            "the worker does not see this thread's plain assignment"
                        )
                    with DebugDirManager():
                        os.makedirs(
                            config.debug_dir_root
                        )  # the manager removes it on exit
                        held()

                inside, here = self.read_while_held(run, lambda: config.debug_dir_root)
                self.assertTrue(inside.startswith(f"{root}_tmp_"), inside)
                self.assertEqual(here, root)
                self.assertEqual(config.debug_dir_root, root)
            finally:
                config.debug_dir_root = old

    def test_replay_stays_in_its_thread(self):
        config = torch._dynamo.config
        old = config.replay_record_enabled
        record = types.SimpleNamespace(
            code=None, globals={}, locals={}, builtins={}, closure=()
        )
        config.replay_record_enabled = True
        try:
            with (
                tempfile.TemporaryDirectory() as tmp,
                mock.patch.object(
                    convert_frame.ExecutionRecord, "load", return_value=record
                ),
            ):
                path = os.path.join(tmp, "record")
                open(path, "wb").close()

                def run(held):
                    # replay() compiles the recorded frame with _compile; hold it there.
                    with mock.patch.object(
                        convert_frame, "_compile", lambda *args, **kwargs: held()
                    ):
                        convert_frame.replay(path)

                inside, here = self.read_while_held(
                    run, lambda: config.replay_record_enabled
                )
            self.assertFalse(inside)
            self.assertTrue(here)
            self.assertTrue(config.replay_record_enabled)
        finally:
            config.replay_record_enabled = old


if __name__ == "__main__":
    run_tests()
