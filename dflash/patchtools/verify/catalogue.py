"""The thread-safety bug classes A-L of torch.compile / FX, and which torch releases have each.

The classes, their symptoms, causes and upstream links are described in ``docs/bug-classes.md``;
the version facts below were measured with :mod:`dflash.patchtools.verify` on plain torch.
"""

from __future__ import annotations

import re

#: Race seconds per check of ``dflash patches verify`` (the records of patches/records/ were made with it)
#: and of one check run alone (``python -m dflash.patchtools.verify.runner``).
CHECK_SECONDS = 1.5

BUG_CLASSES: dict[str, str] = {
    "A": "a warm compiled function called in one thread while another thread compiles new functions "
    "raises 'Detected that you are using FX to symbolically trace a dynamo-optimized function' "
    "or silently runs eagerly; with that fixed, threads sharing one compiled module (forward and backward, "
    "recompiling on new shapes) hung on the anomaly mode a compile turned on for the process",
    "B": "a warm compiled function called in one thread while another thread runs "
    "torch.fx.symbolic_trace fails the same way as A",
    "C": "process-global compile/export session flags: torch.compiler.is_compiling() is True in an "
    "eager thread while another compiles; torch.compile() hands back the uncompiled function and "
    "is_exporting() is True while another thread is inside torch.export",
    "D": "FX's process-wide nn.Module patching: another thread's eager module enters the tracer "
    "(NameError 'module is not installed as a submodule'); concurrent make_fx traces "
    "(AssertionError 'CURRENT_PATCHER is None in finally block'); symbolic_trace during another "
    "thread's compile returns a _LazyGraphModule",
    "E": "dynamo config.patch(...) in one thread is visible to, and undone by, another thread",
    "F": "a plain torch._dynamo.config assignment on one thread is invisible to worker threads "
    "(a raised recompile_limit is ignored there, which then fall back to eager)",
    "G": "torch._dynamo.error_on_graph_break(True) entered in one thread makes graph breaks "
    "in another thread's compiles raise; one error_on_graph_break(...) instance entered from two "
    "threads (a decorated function) leaves a thread with the other thread's value",
    "H": "eager flex_attention (its _set_compilation_env saves and restores the FX tracing flag) "
    "in one thread races with FX traces in another",
    "I": "torch.fx.traceback's node metadata is process-wide: a graph traced in one thread carries the stack "
    "traces and annotate() tags another thread recorded under preserve_node_meta()",
    "J": "torch.export.load in two threads: 'AssertionError: _CURRENT_DESERIALIZER is already set', or a "
    "deserializer that another thread's load cleared or replaced; torch.export.save's constants in two threads: "
    "'Refusing to stomp on existing FakeTensor reducer' (the reducer it puts in copyreg.dispatch_table)",
    "K": "the first torch.compile and torch.export.export calls of a process, started together in threads, "
    "import half-initialized modules ('cannot import name IndentedBuffer from partially initialized module "
    "torch._inductor.utils', _DeadlockError)",
    "L": "the pre-dispatch mode stack is process-wide: a torch.compile in one thread pops the proxy mode of a "
    "torch.export in another ('AssertionError: Trying to pop empty mode stack', 'ProxyTorchDispatchMode slot "
    "already occupied')",
}


def require_class(bug_class: str) -> None:
    """Raises ValueError for a letter that is not a bug class."""
    if bug_class not in BUG_CLASSES:
        raise ValueError(f"unknown bug class {bug_class!r}: choose one of {', '.join(BUG_CLASSES)}")


def _minor_version(torch_version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", str(torch_version))
    if match is None:
        raise ValueError(f"cannot read a torch version from {torch_version!r}; expected e.g. '2.13.0+cpu'")
    return int(match.group(1)), int(match.group(2))


def applies_to(bug_class: str, torch_version: str) -> bool | str:
    """Whether ``torch_version`` (e.g. ``torch.__version__``) shows ``bug_class`` on plain torch.

    Returns ``True`` when the bug is present and its check must fail on plain torch;
    otherwise a string saying why it is absent or not observable (never ``False``: test
    the result with ``is True``). Source: the version table of ``docs/bug-classes.md``
    (measured on 2.5.1-2.15.0).
    """
    require_class(bug_class)
    version = _minor_version(torch_version)
    fx_flag_thread_local = "FX tracing flag is thread-local since torch 2.14 (pytorch PR 168999)"
    if bug_class == "A":
        if version >= (2, 14):
            return fx_flag_thread_local
        if version == (2, 13):
            return (
                "masked by class C on torch 2.13: is_fx_symbolic_tracing() is 'flag and not is_compiling()' "
                "and a compile in flight holds the global is_compiling flag True"
            )
        return True
    if bug_class == "B":
        return True if version < (2, 14) else fx_flag_thread_local
    if bug_class == "E":
        return True if version <= (2, 11) else "dynamo config patches are per-thread since torch 2.12"
    if bug_class == "G" and version < (2, 9):
        return "torch._dynamo.error_on_graph_break does not exist before torch 2.9"
    if bug_class == "K" and not (2, 9) <= version <= (2, 13):
        return (
            "its import failures seen only on torch 2.9-2.13 (fresh processes racing first exports and "
            "compiles, 2026-12-02: 0 of 5 on 2.5.1 and on 2.8.0, 0 of 16 on 2.14.1, 0 of 26 on 2.15.0; "
            "2.6 and 2.7 not probed); the check's plain failures there are another race (A)"
        )
    if bug_class == "F":
        return True if version >= (2, 12) else "dynamo config is process-global before torch 2.12 (class E instead)"
    # C (export half on every version measured), D, G (from 2.9): present through 2.15.0. H too: 2.14
    # made its FX-flag half thread-local, but eager flex still runs its mask/score GraphModules
    # through FX's process-wide nn.Module patching (class D): 140 / 2,600 plain on 2.14.1. I and J:
    # the same module globals on every release.
    return True
