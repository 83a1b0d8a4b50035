"""The first torch.compile() and torch.export.export() calls import torch's cold-start modules first and
hold no lock of their own while user code runs (patch 0010).

Class K (``docs/bug-classes.md``): started together in threads of a fresh process, the first calls
import torch._dynamo, torch._inductor and torch._export along import cycles and fail on
half-imported modules; ``dflash patches verify K`` shows that on plain torch. 0010 makes both calls
import those modules in one order before anything else. An earlier 0010 held a process-wide lock
across the whole first export, the user's ``forward`` included: a ``forward`` that imports a module
whose import (in another thread) calls ``torch.compile()`` then hung both threads for good
(:data:`LAZY_IMPORT_IN_FORWARD`, made deterministic with events; it hung on that 0010 and passes on
plain torch and on this one).

Integration tier: fresh interpreters.
"""

from __future__ import annotations

import pytest
from tiny import script_result

pytest.importorskip("torch")

#: Thread ``importer`` imports module ``libm``, whose body (a library's module-level
#: ``@torch.compile``) calls ``torch.compile()``; thread ``exporter`` runs the process's first
#: ``torch.export.export``, whose ``forward`` imports ``libm`` while the importer holds libm's import
#: lock. The exporter waits for the importer's import to finish; the importer's ``torch.compile()``
#: must not wait for the exporter.
LAZY_IMPORT_IN_FORWARD = r"""
import json, os, sys, tempfile, threading, time
import torch

in_forward, libm_started = threading.Event(), threading.Event()
sys.modules["_cold_start_events"] = type(sys)("_cold_start_events")
sys.modules["_cold_start_events"].in_forward = in_forward
sys.modules["_cold_start_events"].libm_started = libm_started
lib_dir = tempfile.mkdtemp()
with open(os.path.join(lib_dir, "libm.py"), "w") as f:
    f.write(
        "import _cold_start_events as ev, torch\n"
        "ev.libm_started.set()\n"
        "assert ev.in_forward.wait(60)\n"
        "@torch.compile(backend='eager')\n"
        "def f(x):\n"
        "    return x + 1\n"
    )
sys.path.insert(0, lib_dir)


class M(torch.nn.Module):
    def forward(self, x):
        in_forward.set()
        assert libm_started.wait(60)
        import libm  # waits for the importer's import of libm to finish

        return x * 2


done = {}


def exporter():
    torch.export.export(M(), (torch.ones(2),), strict=False)
    done["export"] = True


def importer():
    import libm  # noqa: F401

    done["import"] = True


threads = [threading.Thread(target=exporter, daemon=True), threading.Thread(target=importer, daemon=True)]
for thread in threads:
    thread.start()
deadline = time.monotonic() + 120  # the first export takes about 15 s on 2 loaded cores
for thread in threads:
    thread.join(max(0.0, deadline - time.monotonic()))
print(json.dumps({"export returned": "export" in done, "import returned": "import" in done}))
sys.stdout.flush()
os._exit(0)  # a hung daemon thread must not keep the interpreter from exiting
"""


@pytest.mark.parametrize("patched", [False, True], ids=["plain", "patched"])
def test_a_forward_importing_a_module_that_compiles_does_not_hang(patched):
    result = script_result(LAZY_IMPORT_IN_FORWARD, patched=patched, timeout_s=600)
    assert result == {"export returned": True, "import returned": True}, result


FIRST_CALL_IMPORTS = r"""
import json, sys
import torch

modules = torch._utils._COLD_START_MODULES
out = {"none imported before": not any(name in sys.modules for name in modules)}
torch.compile(backend="eager")  # decorator mode: compiles nothing
out["a decorator-mode compile() imports them all"] = all(name in sys.modules for name in modules)
out["and marks them imported"] = torch._utils._cold_start_imported
out["no lock of the series"] = not hasattr(torch._utils, "_compile_lock")
out["dynamo's compile lock is its own"] = type(torch._dynamo.convert_frame.compile_lock).__module__ != "torch._utils"
out["the wrappers keep the originals"] = (
    torch.compile.__wrapped__.__name__ == "compile" and torch.export.export.__wrapped__.__name__ == "export"
)
print(json.dumps(out))
"""


def test_the_first_call_imports_the_cold_start_modules_and_takes_no_lock():
    result = script_result(FIRST_CALL_IMPORTS, patched=True, timeout_s=600)
    assert all(result.values()), result
