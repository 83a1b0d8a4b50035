"""What each concern of the series becomes upstream: one commit, its title, text, tests and links.

The kit is made for a PyTorch main checkout only (release trees get the fix through the startup hook
and the rebuilt wheel). The diff of a commit comes from the series (``patches/*.patch``, the variant
the tree's version selects); its *how* paragraph comes from that patch's DEP-3 ``Description:`` (see
:mod:`.text`), so it follows the patch. What a PyTorch reviewer needs besides (the problem in
version-neutral words, backward compatibility, where the tests go, which issues and PRs it relates
to) is kept here, per concern. Identifiers quoted in backticks in this text must occur in the
concern's diff or tests (:func:`.text.stale_identifiers`), so a renamed function in a patch shows up
as an error, not as stale prose.

A concern becomes one of: a commit of the stack (the default), a part of a design proposal
(``proposal``: its change reverses semantics upstream chose, so it is sent as an RFC with a draft
implementation, not as a PR), or nothing (``kept_out``). To add a concern: add its patch to the
series, an :class:`UpstreamConcern` here in landing order, and its tests under
``dflash/patchtools/upstream_tests/``; the kit's tests check that every commit passes its own tests
with the commits below it only.

Upstream numbers cited, with their status as last checked (2026-12-02): #118260 (issue, open:
"Dynamo is not thread safe"), #105943 (issue, open: "PT2 is not thread safe"), #136833 (issue, open:
torch.compile from two threads crashes), #126024 (issue, open: the FX tracing flag error), #168999
(PR, merged: thread-local FX tracing flag), #187589 (PR, closed without merging: thread-local
``CURRENT_PATCHER`` for one trace at a time), #184614 (PR, merged: ``is_compiling`` set for the whole
compile session), #118387 (issue, open: process-wide config value plus a thread-local patch layer),
#173568 (PR, merged: config overrides as ContextVars), #186537 (issue, open: the regression that
caused), #179345 (PR, merged: config.patch reentrant across threads), #181651 (PR, merged: per-thread
config hash), #191777 (PR, open: ``AutogradContextVar``), #195355 (PR, closed: ExtraState lock, a
thread-local isolate-recompiles id; not in main), #196637 (PR: the four eval-frame region flags
thread-local in C; the search index's copy lists it open, main behaves as it describes: each flag
per thread, probed on the 2.15.0 wheel), #184917 (PR, open: thread-local FX traceback
state), #195099 (issue, open) and #195100 (PR, open: a ContextVar for export's current deserializer).
"""

from __future__ import annotations

import dataclasses

UMBRELLA = 118260


@dataclasses.dataclass(frozen=True)
class TestPlacement:
    """Where a concern's tests go in a PyTorch checkout.

    Attributes:
        source: file under ``dflash/patchtools/upstream_tests/`` holding the tests as a runnable module.
        target: path in the checkout; a new file (``new_file``) or an existing test file that the tests
            are merged into (imports added, definitions inserted before its ``if __name__`` block).
        new_file: ``target`` does not exist upstream and is created.
        imported_from: for a new file under ``test/fx/`` or ``test/autograd/`` (which
            ``test/run_test.py`` skips), the existing file that must import its test classes so CI runs
            them (``test/test_fx.py``, ``test/test_autograd.py``).
    """

    source: str
    target: str
    new_file: bool = False
    imported_from: str | None = None


@dataclasses.dataclass(frozen=True)
class MethodEdit:
    """Replace (or extend) a method of a class in an existing upstream test file.

    Attributes:
        target: the upstream test file.
        cls: the class holding the method.
        method: the method's name.
        source: file under ``upstream_tests/`` with the new method (``replace``) or the lines appended to
            its body (``append``), written at class-body indentation.
        mode: ``replace`` or ``append``.
        why: one line for the commit message.
    """

    target: str
    cls: str
    method: str
    source: str
    mode: str
    why: str


@dataclasses.dataclass(frozen=True)
class UpstreamConcern:
    """One concern as an upstream commit.

    Attributes:
        name: the series' ``Patch-Name``.
        area: title prefix (``fx``, ``dynamo``, ``config``).
        title: the commit subject after ``[area] ``, imperative, no trailing period.
        problem: what is wrong today, version-neutral.
        bc: backward-compatibility notes (empty: none).
        fixes, part_of, see_also: issue / PR numbers for the ``Fixes #``/``Part of #``/``See also #`` lines.
        related: how the commit relates to open or recent upstream work (sentences).
        tests: where the tests go.
        edits: changes to existing upstream tests that the fix makes necessary.
        kept_out: why this concern stays out of the upstream stack ("" = it goes in).
        proposal: the design proposal this concern belongs to (``upstream_texts/rfc-<proposal>.md``,
            written to ``rfc/<proposal>.md``): its change is drafted on top of the stack for
            discussion, not sent as a PR ("" = a commit of the stack).
        needs: this text describes the patches whose diff contains ``needs`` ("" = any patch). A concern
            whose fix differs between trees has one entry per form in ``CONCERNS``, most specific first;
            the kit takes the first whose ``needs`` the chosen patch has.
        how: the commit's *how* paragraphs, for a form the patch's ``Description:`` does not describe
            (empty: taken from the ``Description:``).
    """

    name: str
    area: str
    title: str
    problem: str
    tests: tuple[TestPlacement, ...] = ()
    bc: tuple[str, ...] = ()
    fixes: tuple[int, ...] = ()
    part_of: tuple[int, ...] = (UMBRELLA,)
    see_also: tuple[int, ...] = ()
    related: str = ""
    edits: tuple[MethodEdit, ...] = ()
    kept_out: str = ""
    proposal: str = ""
    needs: str = ""
    how: tuple[str, ...] = ()


def _fx_test(stem: str) -> TestPlacement:
    return TestPlacement(f"fx/{stem}.py", f"test/fx/{stem}.py", new_file=True, imported_from="test/test_fx.py")


# In stack order: a commit never depends on a later one.
CONCERNS: tuple[UpstreamConcern, ...] = (
    UpstreamConcern(
        name="autograd-launch-context",
        area="autograd",
        title="Read unset ContextVars through the launching thread's context on a traced backward's threads",
        problem=(
            "Non-strict export and `make_fx` traces of a backward call `torch.autograd.grad` under `make_fx`. "
            "The autograd engine runs the CUDA nodes of that backward on its per-device threads, which "
            "carry the launching thread's ATen thread-local state, where `_engine_run_backward` stashes "
            "its `contextvars.Context`, but do not run in that context. Per-thread state kept in "
            "ContextVars (config overrides today; the compile and FX state of the next commits) reads its "
            "defaults there, while the backward formulas work for the launching thread's trace."
        ),
        tests=(
            TestPlacement(
                "autograd/test_launch_context.py",
                "test/autograd/test_launch_context.py",
                new_file=True,
                imported_from="test/test_autograd.py",
            ),
        ),
        see_also=(173568, 191777),
        related=(
            "#173568 (merged) added the stash of the launching context that AOTAutograd's compiled backward runs "
            "under. #191777 (open) proposes `AutogradContextVar`, an opt-in ContextVar that reads that "
            "snapshot; this commit gives existing ContextVars' readers the same fallback as one function, "
            "counting traced backwards so that code outside them pays one global compare."
        ),
    ),
    UpstreamConcern(
        name="fx-tracing-flag-thread-local",
        area="fx",
        title="Make the FX tracing flag thread-local",
        problem=(
            "`torch.fx._symbolic_trace` keeps the FX tracing flag in one module global that `Tracer.trace` "
            "sets and restores. Dynamo's `compile_wrapper` checks `is_fx_symbolic_tracing()` on every call "
            "of a compiled function, so while one thread traces (`symbolic_trace`, `make_fx` inside every "
            'AOTAutograd compile, eager flex_attention), compiled calls in other threads raise "Detected '
            'that you are using FX to symbolically trace a dynamo-optimized function" or run eagerly, and '
            "overlapping traces restore the flag in the wrong order."
        ),
        tests=(_fx_test("test_fx_tracing_flag_threads"),),
        bc=(
            "`torch.fx._symbolic_trace._is_fx_tracing_flag` stays readable and writable, as a view of the "
            "calling thread's flag: code that set it process-wide now sets it for its own thread only.",
        ),
        fixes=(126024,),
        see_also=(168999,),
        related=(
            "#168999 (merged) makes the same flag thread-local with a `threading.local`; where it is in the "
            "tree this commit is not needed. Here the flag is a ContextVar, which the autograd engine's "
            "device threads running a backward this thread traces read through the previous commit."
        ),
    ),
    UpstreamConcern(
        name="fx-tracing-flag-legacy-attribute",
        area="fx",
        title="Restore _is_fx_tracing_flag as a per-thread view",
        problem="",
        kept_out=(
            "restores a private module attribute for third-party code that read it; not something to ask "
            "upstream to keep"
        ),
    ),
    UpstreamConcern(
        name="fx-patcher-thread-isolation",
        area="fx",
        title="Scope FX tracing's monkeypatches and lazy-graph-module flags to the tracing thread",
        problem=(
            "`Tracer.trace` (`torch.fx.symbolic_trace`, and `make_fx` inside every AOTAutograd compile) "
            "patches `torch.nn.Module.__call__`/`__getattr__`, `torch.fx.wrap` functions and autowrapped "
            "globals process-wide, and keeps its patcher in the module global `CURRENT_PATCHER`. Another "
            "thread's eager module calls then enter the tracer (\"NameError: module is not installed as a "
            'submodule"), and overlapping traces revert each other\'s patches ("AssertionError: '
            'CURRENT_PATCHER is None in finally block", wrong graphs, patches left installed). The '
            "lazy-graph-module flag `_use_lazy_graph_module_flag`, set around every dynamo and inductor "
            "compile, is shared the same way: a `symbolic_trace` in another thread returns a "
            "`_LazyGraphModule`, which `torch.jit.script` rejects."
        ),
        tests=(_fx_test("test_fx_patcher_threads"),),
        bc=(
            "While a thread traces, `torch.nn.Module.__call__` and `torch.nn.Module.__getattr__` are "
            "dispatchers that call the tracing thread's wrappers there and the originals elsewhere; the "
            "originals are put back when the last trace ends. Dynamo takes a dispatcher it reads for the "
            "original (`fx_unpatched`), so a compile during another thread's trace takes its fast paths "
            "and its guards hold once the original is back. The dispatchers of globals (`math.sqrt`, "
            "`torch.fx.wrap` functions), which dynamo inlines, read the original as a global of a dict of "
            "their own rather than from a closure, so such a compile's guards build even if the trace "
            "ends first; each has a code object of its own, as dynamo recognises an inlined function by "
            "its `__code__`.",
            'A builtin that `torch.fx.wrap("len")` shadows in a module\'s globals is left there, holding '
            "the builtin, once the last trace ends rather than deleted: a compile during the trace may "
            "have guarded on the global.",
            "`CURRENT_PATCHER`, `_use_lazy_graph_module_flag` and `_force_skip_lazy_graph_module_flag` are "
            "properties of their module's class: reading and assigning them act on the calling thread's "
            "value, which tracing uses. They are ContextVars, which the autograd engine's device threads "
            "running a backward this thread traces read through the launching thread's context.",
        ),
        see_also=(126024, 187589),
        related=(
            "#187589 (closed without merging) made `CURRENT_PATCHER` thread-local for one trace at a time "
            "and left concurrent symbolic traces unsupported; this commit makes concurrent traces correct. "
            "Left out: make_fx's current tracer, which higher-order ops re-enter, stays a module global "
            "(see DESIGN.md of this stack)."
        ),
    ),
    UpstreamConcern(
        name="compile-session-flags-thread-local",
        area="dynamo",
        title="Make torch.compiler's compile and export session flags thread-local",
        problem=(
            "`torch.compiler` keeps the compile and export session flags as module globals. A dynamo "
            "compile holds the compiling flag for the whole compile and `torch.export` holds both for an "
            "export, so `torch.compiler.is_compiling()`/`is_exporting()` answer True in every other thread "
            "meanwhile, and `compile_wrapper`, seeing `is_exporting()`, hands back the uncompiled function "
            "in a thread that merely calls a compiled function."
        ),
        tests=(TestPlacement("dynamo/test_compile_session_flags_threads.py", "test/dynamo/test_compile.py"),),
        bc=(
            "The private module attributes `torch.compiler._is_compiling_flag` and "
            "`torch.compiler._is_exporting_flag` stay as a process-wide override: code outside torch that "
            "saves, sets and restores one (to make `is_compiling()` answer True) still does so, in every "
            "thread, as before. torch itself no longer writes them (its sessions set the calling thread's "
            "flag through `torch.compiler._session_flags_context`), so reading one no longer tells whether "
            "a compile or export is in progress: call `is_compiling()`/`is_exporting()`. The readers look at "
            "the module attribute first (one global load); no module `__getattr__` is involved, which would "
            "slow every `torch.compiler.<name>` lookup on the compiled-call path.",
        ),
        see_also=(184614,),
        related=(
            "#184614 (merged) holds the compiling flag for the whole `torch.compile` session, so the time "
            "in which other threads read `is_compiling()` as True spans every compile."
        ),
    ),
    UpstreamConcern(
        name="internal-config-overrides-thread-local",
        area="dynamo",
        title="Use config.patch for torch's own temporary config overrides",
        problem=(
            "flex_attention's eager path (`_set_compilation_env`), dynamo's `disable_cache_limit` and "
            "export's custom-op decomposition switch save a config value, assign a new one and restore "
            "it. With plain assignments process-wide (the next commit), the override is seen by, and undone "
            "by, other threads."
        ),
        tests=(TestPlacement("dynamo/test_config_overrides_threads.py", "test/dynamo/test_config.py"),),
        proposal="config-assignments-process-wide",
        related="Prepares the next commit, which makes plain assignments process-wide; not needed without it.",
    ),
    UpstreamConcern(
        name="config-process-defaults",
        area="config",
        title="Keep plain config assignments process-wide; config.patch() stays thread-local",
        problem=(
            "Since config overrides became `ContextVar`s (#173568), a plain `torch._dynamo.config.X = v` "
            "made on the main thread is invisible to every other thread, including autograd's backward "
            "threads: a raised `recompile_limit` is ignored there and compiles fall back to eager or fail "
            "under `fullgraph=True` (#186537). Before that change, `config.patch()` was process-wide instead, "
            "so a patch in one thread (and `torch.compile(dynamic=...)`, applied as a patch around each "
            "compiled call) leaked into others (#118260)."
        ),
        tests=(TestPlacement("dynamo/test_config_threads.py", "test/dynamo/test_config.py"),),
        proposal="config-assignments-process-wide",
        edits=(
            MethodEdit(
                "test/test_utils_config_module.py",
                "TestConfigModule",
                "tearDown",
                "config/teardown_process_values.py",
                "append",
                "tearDown also clears the process-wide values that plain assignments now set "
                "(`reset_process_overrides()`).",
            ),
            MethodEdit(
                "test/test_utils_config_module.py",
                "TestConfigModule",
                "test_get_hash_per_thread_isolation",
                "config/test_get_hash_per_thread_isolation.py",
                "replace",
                "test_get_hash_per_thread_isolation checks per-thread isolation through config.patch(); a "
                "plain assignment in a thread is process-wide by design now.",
            ),
        ),
        bc=(
            "A plain assignment (`config.X = v`, `load_config`, `unittest.mock.patch`) sets the process-wide "
            "value again, as before #173568: an assignment made in a worker thread is seen by every thread. Code "
            "that relied on assignments staying in their thread must use `config.patch()`.",
            "`config.patch()`, its decorator form and `_make_closure_patcher()` stay thread-local, as now; an "
            "assignment to a key the calling thread has patched goes to that patch and is undone with it.",
            "Test harnesses that reset config between tests must also clear the process-wide values (the "
            "updated `tearDown` of `test/test_utils_config_module.py` shows how).",
        ),
        fixes=(186537,),
        see_also=(118387, 173568, 179345, 181651),
        related=(
            "Implements the design of #118387 (process-wide value plus a thread-local patch layer) on top "
            "of the `ContextVar` layer of #173568. #179345 (merged) made one patch object reentrant across "
            "threads; that behaviour is kept here."
        ),
    ),
    UpstreamConcern(
        name="compile-wrapper-guard",
        area="dynamo",
        title="Make error_on_graph_break thread-local and share eval-frame settings across threads",
        needs="_SharedEvalFrameSettings",
        problem=(
            "`compile_wrapper` sets and restores process-global state around every call of a compiled "
            "function: the `error_on_graph_break` flag (a module global of `torch/_dynamo/utils.py`) and "
            "eval-frame settings kept in C globals (`skip_guard_eval_unsafe`, the isolate-recompiles id). "
            "From several threads these saves and restores interleave: an `error_on_graph_break` region in "
            "one thread changes compiles in another, and a thread can restore a setting while another "
            "still runs under it, or leave a stale value set. `ErrorOnGraphBreakDecoratorContextManager` "
            "keeps the values it saves on entry in the instance, which a decorated function shares with "
            "every thread that calls it, so one thread's exit can restore another thread's value."
        ),
        tests=(
            TestPlacement("dynamo/test_compile_wrapper_threads.py", "test/dynamo/test_compile.py"),
            TestPlacement("dynamo/test_eval_frame_settings_threads.py", "test/dynamo/test_compile.py"),
        ),
        bc=(
            "`torch._dynamo.error_on_graph_break(...)` applies to the calling thread only; the private "
            "module attribute `torch._dynamo.utils._error_on_graph_break` reads and assigns the calling "
            "thread's value.",
            "A thread whose compiled call needs other eval-frame values than the ones in force (a stance "
            "change, `isolate_recompiles=True`) waits until no other thread is inside a compiled call, "
            "for at most `_GATE_TIMEOUT_S` (2 s); a thread inside a compiled call may be waiting for it, so "
            "after that it sets them for the length of its own call only, as before this commit, and warns "
            "(`RuntimeWarning`). Threads needing the same values never wait.",
        ),
        see_also=(196637,),
        related=(
            "The gate is needed while these settings are C globals shared by all threads. #196637 makes "
            "the eval-frame region flags thread-local in C with `Py_tss_t`; with that change the gate "
            "is wrong (its one process-wide record of the values in force would let a thread skip "
            "setting its own) and only the per-thread `error_on_graph_break` of this commit remains."
        ),
    ),
    UpstreamConcern(
        name="compile-wrapper-guard",
        area="dynamo",
        title="Make error_on_graph_break thread-local",
        problem=(
            "`torch._dynamo.error_on_graph_break(...)` and `compile_wrapper` set and restore the "
            "`error_on_graph_break` flag, a module global of `torch/_dynamo/utils.py`. A region entered in "
            "one thread makes graph breaks raise in other threads' compiles, and overlapping regions in two "
            "threads restore each other's value, also through one instance (a function decorated with "
            "`error_on_graph_break(...)` enters its one instance from every thread that calls it)."
        ),
        how=(
            "The flag moves to a ContextVar; `_get_error_on_graph_break()` and "
            "`_set_error_on_graph_break()` keep their signatures and are its only readers and writers. "
            "`ErrorOnGraphBreakDecoratorContextManager` keeps the values it saves on entry per thread too "
            "(`prev_error_on_graph_break` becomes a view of the calling thread's stack); a copy or pickle "
            "of an instance starts with empty stacks.",
            "The eval-frame settings that `compile_wrapper` also saves and restores around each call "
            "(`skip_guard_eval_unsafe`, the isolate-recompiles id, the fullgraph counters) are per-thread "
            "in C (`Py_tss_t` slots in `torch/csrc/dynamo/eval_frame.c`: set in one thread, another thread "
            "reads its own), so that save and restore is right as it is and this commit leaves it alone.",
        ),
        tests=(TestPlacement("dynamo/test_compile_wrapper_threads.py", "test/dynamo/test_compile.py"),),
        bc=(
            "`torch._dynamo.error_on_graph_break(...)` applies to the calling thread only; the private "
            "module attribute `torch._dynamo.utils._error_on_graph_break` reads and assigns the calling "
            "thread's value.",
        ),
        see_also=(196637,),
        related=(
            "#196637 describes the eval-frame region flags as thread-local in C with `Py_tss_t`, which "
            "is what `torch/csrc/dynamo/eval_frame.c` does on main; the flag that `compile_wrapper` keeps "
            "in Python, `error_on_graph_break`, is the one left, and this commit makes it per-thread too."
        ),
    ),
    UpstreamConcern(
        name="fx-node-meta-thread-local",
        area="fx",
        title="Make torch.fx.traceback's node metadata thread-local",
        problem="",
        kept_out=(
            "#184917 (open) would make the same state thread-local on main and carry it to autograd's "
            "threads through C++ thread-local state; a second change to the same module would compete with it"
        ),
    ),
    UpstreamConcern(
        name="export-deserializer-thread-local",
        area="export",
        title="Make torch.export's current deserializer thread-local",
        problem="",
        kept_out=(
            "#195099 (issue, open) and #195100 (PR, open) would make `_CURRENT_DESERIALIZER` a ContextVar "
            "on main, for loading only; the race of two saves on the FakeTensor reducer in "
            "`copyreg.dispatch_table` has no upstream issue yet and needs one of its own, with this "
            "patch's saving half as the proposed fix"
        ),
    ),
    UpstreamConcern(
        name="make-fx-tracer-thread-local",
        area="fx",
        title="Make make_fx's current tracer thread-local",
        problem="",
        kept_out=(
            "written 2026-12-04: its upstream commit needs a test in test/fx that PyTorch's CI "
            "runs and a description with a repro; until those are written it stays out of the stack"
        ),
    ),
    UpstreamConcern(
        name="pre-dispatch-mode-stack-thread-local",
        area="export",
        title="Make the pre-dispatch mode stack thread-local",
        problem="",
        kept_out=(
            "written 2026-12-04: its upstream commit needs a test in test/export that PyTorch's CI "
            "runs and a description with a repro; until those are written it stays out of the stack"
        ),
    ),
    UpstreamConcern(
        name="compile-without-anomaly-mode",
        area="functorch",
        title="Trace AOTAutograd's joint graph without turning anomaly mode on",
        problem="",
        kept_out=(
            "written 2026-12-04: upstream the root is in C++ (AccumulateGrad built under the "
            "leaf's mutex, anomaly mode one flag for the process), which an issue should raise first; the "
            "Python change needs a test in test/functorch and a description with a repro"
        ),
    ),
    UpstreamConcern(
        name="dynamo-metrics-context-thread-local",
        area="dynamo",
        title="Keep dynamo's compilation metrics context per thread",
        problem="",
        kept_out="main already keeps it per thread (`get_metrics_context()` holds its context in a `threading.local`)",
    ),
    UpstreamConcern(
        name="cold-start-import-order",
        area="dynamo",
        title="Import the modules of the first compile and export in one order",
        problem="",
        kept_out=(
            "an import-order workaround for releases whose first compile and first export, started "
            "together, fail on import cycles among torch._dynamo, torch._inductor and torch.export; "
            "the newest releases did not show that failure in 42 fresh processes, and main was not probed"
        ),
    ),
)


def forms_of(concerns: tuple[UpstreamConcern, ...] = CONCERNS) -> dict[str, list[UpstreamConcern]]:
    """Each concern's forms (most specific first), concerns in stack order."""
    out: dict[str, list[UpstreamConcern]] = {}
    for concern in concerns:
        out.setdefault(concern.name, []).append(concern)
    return out


def form_for(forms: list[UpstreamConcern], diff_text: str) -> UpstreamConcern:
    """The first of a concern's ``forms`` whose ``needs`` occurs in ``diff_text``.

    Raises:
        ValueError: none does (the last form of a concern should need nothing).
    """
    for form in forms:
        if form.needs in diff_text:
            return form
    raise ValueError(f"no upstream text of {forms[0].name} describes this patch (needs: {[f.needs for f in forms]})")
