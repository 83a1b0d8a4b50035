# Owner(s): ["module: dynamo"]
"""Config semantics across threads (#118260).

A plain ``torch._dynamo.config.X = v`` sets the process-wide value that every
thread reads; ``config.patch(...)`` overrides it for the calling thread only,
and one patch object may be entered from several threads at once.
"""

import threading

import torch
from torch._dynamo import config
import torch._dynamo.test_case
from torch._dynamo.test_case import run_tests

TIMEOUT_S = 60


def read_in_thread(fn):
    """``fn()`` called in a new thread; its exception is raised here."""
    out, errors = [], []

    def run():
        try:
            out.append(fn())
        except Exception as e:  # raised below, not lost in the thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    if thread.is_alive():
        raise AssertionError("the thread did not finish")
    if errors:
        raise errors[0]
    return out[0]


class ConfigThreadTests(torch._dynamo.test_case.TestCase):
    def test_plain_assignment_is_seen_by_other_threads(self):
        old = config.recompile_limit
        try:
            config.recompile_limit = old + 7
            self.assertEqual(read_in_thread(lambda: config.recompile_limit), old + 7)
        finally:
            config.recompile_limit = old

    def test_patch_stays_in_its_thread(self):
        old = config.recompile_limit
        entered, release = threading.Event(), threading.Event()

        def hold():
            with config.patch(recompile_limit=old + 3):
                entered.set()
                release.wait(TIMEOUT_S)

        thread = threading.Thread(target=hold, daemon=True)
        thread.start()
        try:
            self.assertTrue(entered.wait(TIMEOUT_S))
            self.assertEqual(config.recompile_limit, old)
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        self.assertFalse(thread.is_alive(), "the patching thread did not finish")
        self.assertEqual(config.recompile_limit, old)

    def test_assignment_inside_a_patch_is_undone_by_the_patch(self):
        old = config.recompile_limit
        with config.patch(recompile_limit=old + 1):
            config.recompile_limit = old + 2
            self.assertEqual(config.recompile_limit, old + 2)
            self.assertEqual(read_in_thread(lambda: config.recompile_limit), old)
        self.assertEqual(config.recompile_limit, old)

    def test_delete_inside_a_patch_stays_in_its_thread(self):
        # unittest.mock.patch's undo (delete, then assign the original) inside a
        # config.patch().
        old = config.recompile_limit
        with config.patch(recompile_limit=old + 4):
            del config.recompile_limit
            self.assertEqual(read_in_thread(lambda: config.recompile_limit), old)
            config.recompile_limit = old + 4
            self.assertEqual(config.recompile_limit, old + 4)
        self.assertEqual(config.recompile_limit, old)

    def test_one_patch_object_entered_from_two_threads(self):
        old = config.recompile_limit
        patch = config.patch(recompile_limit=old + 5)
        both_in, errors = threading.Barrier(2), []

        def use():
            try:
                with patch:
                    both_in.wait(TIMEOUT_S)
                    self.assertEqual(config.recompile_limit, old + 5)
                    both_in.wait(TIMEOUT_S)
                self.assertEqual(config.recompile_limit, old)
            except Exception as e:  # reported by the test, not lost in the thread
                errors.append(e)

        threads = [threading.Thread(target=use, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
            self.assertFalse(thread.is_alive(), "a patching thread did not finish")
        self.assertEqual(errors, [])
        self.assertEqual(config.recompile_limit, old)


if __name__ == "__main__":
    run_tests()
