"""One ``torch._dynamo.error_on_graph_break(...)`` instance entered from two threads (patch 0007).

Used as a decorator, one instance is entered by every thread that calls the function. With the
value per-thread, the values the instance saves on entry must be per-thread too, or a thread's exit
restores another thread's value (its later compiles then raise on graph breaks, or stop raising).
The scenario is the upstream kit's ``test_shared_error_on_graph_break_restores_each_threads_value``
(``dflash/patchtools/upstream_tests/dynamo/test_compile_wrapper_threads.py``; events fix the
interleaving so the exits cross), run here in fresh interpreters: plain torch must fail it, the
series must pass it.

Integration tier: two fresh interpreters (10-30 s on 2 cores); needs ``expecttest``, PyTorch's test
dependency.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")

SOURCE = (
    Path(importlib.util.find_spec("dflash.patchtools").submodule_search_locations[0])
    / "upstream_tests"
    / "dynamo"
    / "test_compile_wrapper_threads.py"
)
TEST = "CompileWrapperThreadTests.test_shared_error_on_graph_break_restores_each_threads_value"


def _run(patched: bool, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0", PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    # Under a set `CI`, PyTorch's `run_tests` writes XML reports through `xmlrunner`, not installed here.
    env.pop("CI", None)
    return subprocess.run(
        [sys.executable, str(SOURCE), TEST], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


requires_error_on_graph_break = pytest.mark.skipif(
    not hasattr(torch._dynamo, "error_on_graph_break"), reason="torch._dynamo.error_on_graph_break exists from 2.9"
)


@requires_error_on_graph_break
def test_a_shared_instance_restores_each_threads_own_value(tmp_path):
    plain = _run(False, tmp_path)
    # Plain torch keeps one process-wide value: A's exit puts back the False B saved over its True.
    assert plain.returncode != 0 and "AssertionError: {'a': True" in plain.stderr, (
        f"plain torch did not show the crossed exits:\n{plain.stderr[-3000:]}"
    )
    patched = _run(True, tmp_path)
    assert patched.returncode == 0, (
        f"with the series, a thread's exit restored another's value:\n{patched.stderr[-3000:]}"
    )


@requires_error_on_graph_break
def test_an_instance_still_copies_and_pickles():
    # The per-thread record (a threading.local) cannot be pickled: a copy starts outside every region.
    from torch._dynamo.utils import _get_error_on_graph_break

    region = torch._dynamo.error_on_graph_break(True)
    for copied in (copy.deepcopy(region), pickle.loads(pickle.dumps(region))):
        assert type(copied) is type(region) and copied.error_on_graph_break is True
        with copied:
            assert _get_error_on_graph_break() is True
        assert _get_error_on_graph_break() is False
