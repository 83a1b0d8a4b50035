"""The stress scenarios: which schedules each draws and which bug classes (A-L) it targets."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from .strategies import GENERIC_ACTIONS, IN_PROCESS_ACTIONS, Schedule, cold_schedules, schedules


@dataclasses.dataclass(frozen=True)
class Scenario:
    description: str
    bug_classes: tuple[str, ...]
    schedules: st.SearchStrategy[Schedule]


SCENARIOS: dict[str, Scenario] = {
    "threads": Scenario(
        "2-8 threads mixing first compiles, recompiles, warm calls, symbolic_trace, make_fx, "
        "eager modules, is_compiling polls, config patches, graph-break regions, one shared compiled module "
        "(forward and backward, recompiling on new shapes) and an export",
        ("A", "B", "C", "D", "E", "G", "L"),
        schedules(st.sampled_from(GENERIC_ACTIONS)),
    ),
    "shared_module": Scenario(
        "threads calling one compiled nn.Module (dynamic shapes, forward and backward) while others recompile it, "
        "compile new functions, run symbolic_trace or make_fx",
        ("A", "B"),
        schedules(st.sampled_from(("shared_module", "first_compile", "symbolic_trace", "make_fx"))),
    ),
    "soak": Scenario(
        "every in-process workload at once: compiled calls, recompiles, symbolic_trace, make_fx, AOT joint traces "
        "with backward, export and export.load, config patches, node metadata, flex_attention",
        ("A", "B", "C", "D", "E", "G", "H", "I", "J", "L"),
        schedules(st.sampled_from(IN_PROCESS_ACTIONS)),
    ),
    "flex_attention": Scenario(
        "compiled and eager flex_attention (causal, sliding window, DFlash block masks) "
        "against FX traces, make_fx and compiles",
        ("A", "B", "D", "H"),
        schedules(
            st.sampled_from(("flex_attention", "eager_flex_attention", "symbolic_trace", "make_fx", "first_compile"))
        ),
    ),
    "static_graphs": Scenario(
        "dynamic=False compiles on up to 12 lengths with recompile_limit raised to 64 by a plain "
        "main-thread assignment, mixed with per-thread config patches",
        ("E", "F"),
        schedules(
            st.sampled_from(("recompile", "first_compile", "config_patch")),
            dynamic=st.just(False),
            max_length=12,
            recompile_limits=st.just(64),
        ),
    ),
    "node_meta": Scenario(
        "make_fx traces under each thread's own node metadata (stack trace, annotate() tag) against "
        "threads holding theirs, AOT compiles (joint traces under preserve_node_meta) and plain traces",
        ("I",),
        schedules(
            st.sampled_from(("own_node_meta_trace", "hold_node_meta", "first_compile", "make_fx", "symbolic_trace"))
        ),
    ),
    "export_load": Scenario(
        "torch.export.load (and a call of the loaded program) in several threads, with compiles and make_fx traces",
        ("J",),
        schedules(st.sampled_from(("export_load", "first_compile", "make_fx", "warm_call"))),
    ),
    "cold_start": Scenario(
        "a fresh process's first torch.export.export and first torch.compile calls (eager, aot_eager) "
        "started together, one fresh interpreter per schedule",
        ("K",),
        cold_schedules(),
    ),
}
