"""Hypothesis strategies for multi-threaded torch.compile / FX schedules.

A schedule holds at most one ``export`` step: two exports at once meet export's own
process-global state, which the series does not patch (``_EXPORT_FLAGS`` and
``_EXPORT_MODULE_HIERARCHY`` in torch/export/_trace.py; docs/bug-classes.md, "Out of scope");
one export against compiles and traces is classes C and L.

Every value drawn here is plain data (strings, ints, tuples in frozen dataclasses),
so the minimal failing schedule hypothesis prints can be pasted back as a regression
``@example(...)`` (see ``stress/README.md``); ``stress/runner.py`` turns it into
tensors, modules and threads.

Naming and layout follow hypothesis' ``guides/api-style.rst``: plural nouns, bounds as
``min_value``/``max_value`` and sizes as ``min_size``/``max_size``, element strategies
first and named ``elements``.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

#: What one thread can do in one step; ``stress/runner.py`` documents each.
ACTIONS = (
    "first_compile",  # compile and call a function no thread has compiled yet
    "recompile",  # call the schedule's shared compiled function on this step's shape
    "warm_call",  # call a function compiled (for this shape) before the threads started
    "symbolic_trace",  # torch.fx.symbolic_trace of a small module
    "make_fx",  # torch.fx.experimental.proxy_tensor.make_fx of a function
    "eager_module",  # call an eager nn.Module
    "poll_is_compiling",  # poll is_compiling()/is_exporting()/the FX flag in eager code
    "config_patch",  # torch._dynamo.config.patch(...) and read it back inside
    "graph_break_compile",  # compile a function with a graph break (must split, not raise)
    "error_on_graph_break",  # hold torch._dynamo.error_on_graph_break(True) around a compiled call
    "shared_module",  # forward and backward of the schedule's one compiled nn.Module (dynamic shapes, AOT backend)
    "export",  # torch.export.export of a small module and a call of the program (one per schedule)
    "flex_attention",  # compiled flex_attention with the schedule's mask_mod
    "eager_flex_attention",  # flex_attention without torch.compile
    "own_node_meta_trace",  # make_fx under this thread's own stack trace and annotate() tag
    "hold_node_meta",  # hold preserve_node_meta() with this thread's stack trace and tag, tracing nothing
    "export_load",  # torch.export.load of a saved program, and a call of it
    "cold_export",  # a fresh process's first torch.export.export (every step of a COLD_ACTIONS schedule is
    "cold_compile_eager",  # a first call, each thread's only step, in one fresh interpreter per schedule)
    "cold_compile_aot_eager",
)

#: The actions of ``threads`` scenario schedules; flex_attention, node metadata, export.load and
#: first calls have their own scenarios.
GENERIC_ACTIONS = ACTIONS[: ACTIONS.index("flex_attention")]
#: First calls of a fresh process: a schedule of these runs in one (``stress/runner.py``).
COLD_ACTIONS = ("cold_export", "cold_compile_eager", "cold_compile_aot_eager")
#: What threads of a schedule run in the process that runs the schedule.
IN_PROCESS_ACTIONS = tuple(action for action in ACTIONS if action not in COLD_ACTIONS)

MIN_THREADS, MAX_THREADS = 2, 8
MAX_STEPS_PER_THREAD = 3
#: Capped below dynamo's default recompile_limit (8) so that calling one dynamic=False
#: function on every length never legitimately falls back to eager.
MAX_DISTINCT_LENGTHS = 6
#: The trailing dimension of every tensor argument.
WIDTH = 4
DTYPES = ("float32", "float64", "bfloat16")
MASK_KINDS = ("causal", "sliding_window", "document", "dflash_block")


@dataclasses.dataclass(frozen=True)
class Step:
    """One action of one thread, on a tensor of shape ``(length, WIDTH)``."""

    action: str
    length: int


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """A flex_attention mask, as data.

    ``causal``: query q (at absolute position ``start_offset + q``) sees kv <= its position.
    ``sliding_window``: as causal, and only the last ``window`` positions.
    ``document``: packed documents of ``window`` positions each; causal within a document,
    nothing across documents.
    ``dflash_block``: ``dflash.masks.dflash_mask_mod`` (arXiv 2602.06036 Sec. 3): the query
    axis holds ``len(anchors)`` draft blocks of ``block_size`` slots; block b sees context
    keys kv < anchors[b] strictly and its own block bidirectionally, nothing else. The
    key axis is ``[context (context_len) | block_0 | ...]``.
    """

    kind: str
    block_size: int
    start_offset: int
    window: int
    context_len: int
    anchors: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What each thread does (``threads[i]`` is thread i's steps), released together by a barrier.

    ``recompile_limit``: when set, the main thread assigns ``torch._dynamo.config.recompile_limit``
    plainly before the threads start (class F: workers must see it).
    """

    threads: tuple[tuple[Step, ...], ...]
    dtype: str
    dynamic: bool | None
    mask: MaskSpec
    recompile_limit: int | None = None


def actions() -> st.SearchStrategy[str]:
    """Any of ``IN_PROCESS_ACTIONS``; shrinks towards ``first_compile``."""
    return st.sampled_from(IN_PROCESS_ACTIONS)


def lengths(*, min_value: int = 1, max_value: int = MAX_DISTINCT_LENGTHS) -> st.SearchStrategy[int]:
    """The leading dimension of a step's tensor (its shape is ``(length, WIDTH)``)."""
    if not 1 <= min_value <= max_value:
        raise InvalidArgument(f"need 1 <= min_value <= max_value, got {min_value}, {max_value}")
    return st.integers(min_value, max_value)


def dtypes() -> st.SearchStrategy[str]:
    """A floating dtype name of ``DTYPES`` (``getattr(torch, name)``)."""
    return st.sampled_from(DTYPES)


def dynamic_settings() -> st.SearchStrategy[bool | None]:
    """The ``dynamic=`` argument of torch.compile: None (automatic), False (static), True."""
    return st.sampled_from((None, False, True))


def block_sizes() -> st.SearchStrategy[int]:
    """DFlash draft block sizes (slots per block), small enough for CPU."""
    return st.sampled_from((2, 4, 8))


def start_offsets(*, max_value: int = 16) -> st.SearchStrategy[int]:
    """Where the queries start on the key axis (a decode step's position), >= 0."""
    if max_value < 0:
        raise InvalidArgument(f"max_value must be >= 0, got {max_value}")
    return st.integers(0, max_value)


@st.composite
def mask_specs(draw, *, kinds: st.SearchStrategy[str] | None = None) -> MaskSpec:
    """A ``MaskSpec`` of kind ``kinds`` (default: any of ``MASK_KINDS``).

    For ``dflash_block`` the anchors are 1 to 3 distinct sorted positions in
    ``[start_offset + 1, context_len)`` with ``context_len = 32 + start_offset``.
    """
    kind = draw(st.sampled_from(MASK_KINDS) if kinds is None else kinds)
    block_size = draw(block_sizes())
    start_offset = draw(start_offsets())
    window = draw(st.integers(1, 32))
    context_len = 32 + start_offset
    anchors = tuple(sorted(draw(st.sets(st.integers(start_offset + 1, context_len - 1), min_size=1, max_size=3))))
    return MaskSpec(kind, block_size, start_offset, window, context_len, anchors)


@st.composite
def steps(draw, elements: st.SearchStrategy[str] | None = None, *, max_length: int = MAX_DISTINCT_LENGTHS) -> Step:
    """A ``Step``: an action from ``elements`` (default ``actions()``) and a length."""
    return Step(draw(actions() if elements is None else elements), draw(lengths(max_value=max_length)))


@st.composite
def cold_schedules(draw, *, max_compiles: int = 3) -> Schedule:
    """A fresh process's first calls, started together: one ``cold_export`` thread and 1 to
    ``max_compiles`` first compiles (two exports at once would also meet export's own process-wide
    state, out of scope)."""
    compiles = draw(st.lists(st.sampled_from(COLD_ACTIONS[1:]), min_size=1, max_size=max_compiles))
    threads = tuple((Step(action, 1),) for action in ("cold_export", *compiles))
    return Schedule(threads=threads, dtype="float32", dynamic=None, mask=draw(mask_specs(kinds=st.just("causal"))))


@st.composite
def schedules(
    draw,
    elements: st.SearchStrategy[str] | None = None,
    *,
    min_threads: int = MIN_THREADS,
    max_threads: int = MAX_THREADS,
    max_steps: int = MAX_STEPS_PER_THREAD,
    max_length: int = MAX_DISTINCT_LENGTHS,
    dynamic: st.SearchStrategy[bool | None] | None = None,
    recompile_limits: st.SearchStrategy[int | None] | None = None,
) -> Schedule:
    """A ``Schedule`` of ``min_threads``..``max_threads`` threads, each with 1..``max_steps`` steps.

    ``elements`` draws each step's action (default ``actions()``); ``dynamic`` the compile
    setting (default ``dynamic_settings()``); ``recompile_limits`` the main-thread config
    assignment (default: none). Shrinks towards 2 threads of one ``first_compile`` step.
    """
    if not 1 <= min_threads <= max_threads:
        raise InvalidArgument(f"need 1 <= min_threads <= max_threads, got {min_threads}, {max_threads}")
    if max_steps < 1:
        raise InvalidArgument(f"max_steps must be >= 1, got {max_steps}")
    step = steps(elements, max_length=max_length)
    threads = draw(
        st.lists(st.lists(step, min_size=1, max_size=max_steps).map(tuple), min_size=min_threads, max_size=max_threads)
    )
    return Schedule(
        threads=_one_export(threads),
        dtype=draw(dtypes()),
        dynamic=draw(dynamic_settings() if dynamic is None else dynamic),
        mask=draw(mask_specs()),
        recompile_limit=draw(st.none() if recompile_limits is None else recompile_limits),
    )


def _one_export(threads: list[tuple[Step, ...]]) -> tuple[tuple[Step, ...], ...]:
    """``threads`` with every ``export`` step after the first made a ``make_fx`` step (a trace of
    its own, like export's): one export per schedule (module docstring)."""
    seen = False
    kept = []
    for thread in threads:
        steps_kept = []
        for step in thread:
            if step.action == "export":
                step = step if not seen else Step("make_fx", step.length)
                seen = True
            steps_kept.append(step)
        kept.append(tuple(steps_kept))
    return tuple(kept)
