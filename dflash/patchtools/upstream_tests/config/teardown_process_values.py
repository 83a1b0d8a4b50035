"""Lines appended to ``TestConfigModule.tearDown`` in ``test/test_utils_config_module.py``.

Plain assignments now set a process-wide value that the per-thread reset in the existing
tearDown does not clear; without this, a value set by one test is seen by the next.
"""

from torch.testing._internal import fake_config_module as config
from torch.utils._config_module import _UNSET_SENTINEL


def tearDown(self):
    """Only the statements below are added to the existing method."""
    for k in config._config:
        config._config[k].process_override = _UNSET_SENTINEL
