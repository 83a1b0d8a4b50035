"""Replaces ``TestConfigModule.test_get_hash_per_thread_isolation``.

In test/test_utils_config_module.py. A plain assignment is process-wide again, so
per-thread isolation is what ``config.patch()`` gives.
"""

import threading

from torch.testing._internal import fake_config_module as config


def test_get_hash_per_thread_isolation(self):
    """A patch in one thread changes only that thread's hash; a plain assignment
    changes every thread's."""
    base_hash = config.get_hash()
    thread_hash = []

    def patch_in_thread():
        with config.patch(e_int=999):
            thread_hash.append(config.get_hash())

    def assign_in_thread():
        config.e_int = 999

    for target in (patch_in_thread, assign_in_thread):
        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(60)
        self.assertFalse(t.is_alive(), "the thread did not finish")
        if target is patch_in_thread:
            # The main thread's hash is unchanged; the patched thread got its own.
            self.assertEqual(config.get_hash(), base_hash)
            self.assertNotEqual(thread_hash[0], base_hash)
    # The assignment made in the other thread is seen here.
    self.assertEqual(config.get_hash(), thread_hash[0])
