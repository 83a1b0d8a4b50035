"""PyTorch's own tests of an exact release tag, plain vs patched (``dflash patches pytorch-tests``).

Upstream reviewers run PyTorch's tests over every patch; this runs them first, from the test tree of
the exact tag the installed series is checked on, not from copies of unknown age:

- :mod:`~dflash.patchtools.pytorch_tests.trees`: where an exact tag's ``test/`` comes from (Debian's
  source package of that release, pinned by sha256) and its download into the cache;
- :mod:`~dflash.patchtools.pytorch_tests.environment`: a venv in the cache with that torch release,
  the pytest PyTorch's CI pins, the tests' extra packages, ``libtorchbind_test.so`` compiled against
  the wheel, and this checkout installed so that the series applies;
- :mod:`~dflash.patchtools.pytorch_tests.selections`: which test files (or ``-k`` subsets) to run;
- :mod:`~dflash.patchtools.pytorch_tests.outcomes`: each test's outcome from pytest's JUnit XML;
- :mod:`~dflash.patchtools.pytorch_tests.runner`: every file in its own process, plain
  (``DFLASH_PATCHES=0``) and patched, outcome by outcome, each difference run again alone both
  ways, and the tables;
- :mod:`~dflash.patchtools.pytorch_tests.resume`: the record each finished process leaves, and its
  key, so that a run in the same ``--out`` reuses it (the full selection takes hours).
"""
