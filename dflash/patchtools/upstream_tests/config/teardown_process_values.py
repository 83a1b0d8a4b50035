"""Lines appended to ``TestConfigModule.tearDown`` (test/test_utils_config_module.py).

Plain assignments set a process-wide value that the per-thread reset in the existing
tearDown does not clear; without this, a value set by one test is seen by the next.
"""

from torch.testing._internal import fake_config_module as config


def tearDown(self):
    """Only the statements below are added to the existing method."""
    config.reset_process_overrides()
