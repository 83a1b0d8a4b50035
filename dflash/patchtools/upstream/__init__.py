"""The upstream PR kit: the patch series as a PyTorch stack, one reviewed commit per concern.

``dflash patches upstream --pytorch-src DIR --out DIR`` (see ``docs/upstream-kit.md``), for a PyTorch
main checkout only:

- :mod:`.concerns`: per concern, the upstream title, problem, BC notes, links and test placement;
- :mod:`.placement`: the tests merged into PyTorch's own test files (``test/fx`` files imported from
  ``test/test_fx.py``), upstream tests the change affects updated;
- :mod:`.stack`: each concern's patch rebased exactly onto the checkout, committed on a private index,
  ``git format-patch``;
- :mod:`.runs`: each commit's tests run without and with it, in fresh processes;
- :mod:`.bench`: instruction counts per commit (callgrind, pr_time_benchmarks' method);
- :mod:`.lint`: the imports the series adds tidied, PyTorch's lint checked on every commit;
- :mod:`.text`, :mod:`.documents`: commit messages, PR descriptions, the cover note, the design note,
  the design proposals, and the check that none of it carries project-internal or release-bound text;
- :mod:`.tree`: the PyTorch checkout read without changing it (its version, its files, git plumbing);
- :mod:`.kit`: :func:`make_kit`, which does all of the above.
"""

from dflash.patchtools.upstream.kit import (
    FAILS_WITH,
    NOT_RUN,
    PASSES_WITHOUT,
    SHOWN,
    STACK_FAILS,
    STACK_PASSES,
    ConcernReport,
    make_kit,
)
from dflash.patchtools.upstream.stack import DOES_NOT_APPLY, KEPT_OUT, PRESENT, PROPOSED, REBASED
from dflash.patchtools.upstream.tree import UpstreamKitError, tree_release

__all__ = [
    "DOES_NOT_APPLY",
    "FAILS_WITH",
    "KEPT_OUT",
    "NOT_RUN",
    "PASSES_WITHOUT",
    "PRESENT",
    "PROPOSED",
    "REBASED",
    "SHOWN",
    "STACK_FAILS",
    "STACK_PASSES",
    "ConcernReport",
    "UpstreamKitError",
    "make_kit",
    "tree_release",
]
