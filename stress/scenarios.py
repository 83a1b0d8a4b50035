"""The stress scenarios: which schedules each draws and which bug classes (A-H) it targets."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from .strategies import GENERIC_ACTIONS, Schedule, schedules


@dataclasses.dataclass(frozen=True)
class Scenario:
    description: str
    bug_classes: tuple[str, ...]
    schedules: st.SearchStrategy[Schedule]


SCENARIOS: dict[str, Scenario] = {
    "threads": Scenario(
        "2-8 threads mixing first compiles, recompiles, warm calls, symbolic_trace, make_fx, "
        "eager modules, is_compiling polls, config patches and graph-break regions",
        ("A", "B", "C", "D", "E", "G"),
        schedules(st.sampled_from(GENERIC_ACTIONS)),
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
}
