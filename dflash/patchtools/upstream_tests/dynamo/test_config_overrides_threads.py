# Owner(s): ["module: dynamo"]
"""torch's own temporary config overrides stay in the thread that makes them (#118260).

``disable_cache_limit`` and flex_attention's ``_set_compilation_env`` override
dynamo config for a region. Done with assignments, the override would be seen by
(and undone by) other threads; done with ``config.patch`` it stays per-thread.
Each test holds the region open in one thread with events and reads the config
from another.
"""

import sys
import threading

import torch
import torch._dynamo.test_case
from torch._dynamo.test_case import run_tests
from torch._dynamo.utils import disable_cache_limit
from torch._higher_order_ops.utils import _set_compilation_env

TIMEOUT_S = 60


class ConfigOverrideThreadTests(torch._dynamo.test_case.TestCase):
    def read_while_held(self, region, read):
        """(value of ``read()`` inside ``region`` in a worker thread, value of ``read()`` here meanwhile)."""
        entered, release = threading.Event(), threading.Event()
        inside = []

        def hold():
            with region():
                inside.append(read())
                entered.set()
                release.wait(TIMEOUT_S)

        thread = threading.Thread(target=hold)
        thread.start()
        try:
            self.assertTrue(entered.wait(TIMEOUT_S))
            here = read()
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        return inside[0], here

    def test_disable_cache_limit_stays_in_its_thread(self):
        config = torch._dynamo.config
        limits = (config.recompile_limit, config.accumulated_recompile_limit)
        inside, here = self.read_while_held(
            disable_cache_limit,
            lambda: (config.recompile_limit, config.accumulated_recompile_limit),
        )
        self.assertEqual(inside, (sys.maxsize, sys.maxsize))
        self.assertEqual(here, limits)
        self.assertEqual((config.recompile_limit, config.accumulated_recompile_limit), limits)

    def test_flex_compilation_env_stays_in_its_thread(self):
        config = torch._dynamo.config
        with config.patch(allow_empty_graphs=False, capture_scalar_outputs=False):
            inside, here = self.read_while_held(
                _set_compilation_env,
                lambda: (config.allow_empty_graphs, config.capture_scalar_outputs),
            )
        self.assertEqual(inside, (True, True))
        self.assertEqual(here, (False, False))


if __name__ == "__main__":
    run_tests()
