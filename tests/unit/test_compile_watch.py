"""dflash.compile_watch through real torch.compile calls: per-thread compile and graph-run counts,
and the warnings a training step's watch logs (recompile for a known shape, eager fallback,
graph break)."""

import logging

import pytest
import torch

from dflash.compile_watch import (
    CompiledRegion,
    CountingBackend,
    DynamoWarnings,
    StepWatch,
    fresh_function,
    raise_recompile_limit,
    recompile_limit_name,
)

SCALE = 2.0


def scaled(x):
    return x * SCALE


def doubled(x):
    return x * 2


def scaled_with_break(x):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


@pytest.fixture
def limit():
    """Restore dynamo's recompile limit (a plain assignment is process-wide with the patches)."""
    import torch._dynamo.config as config

    name = recompile_limit_name()
    original = getattr(config, name)
    yield lambda value: setattr(config, name, value)
    setattr(config, name, original)


def _call(watch, fn, step, x):
    watch.before()
    out = fn(x)
    watch.after(step, tuple(x.shape))
    return out


def test_a_healthy_step_counts_one_compile_per_shape(caplog):
    fn = CompiledRegion("drafter step", scaled, 0, "eager")
    backend = fn.backend
    watch = StepWatch("drafter0 (cpu)", [fn])
    with caplog.at_level(logging.INFO, logger="dflash.compile_watch"):
        for step, n in enumerate((4, 4, 8, 8, 4), start=1):
            assert torch.equal(_call(watch, fn, step, torch.ones(n)), torch.full((n,), 2.0))
    assert watch.summary() == {"compiles": 2, "unexpected_recompiles": 0, "eager_fallbacks": 0, "graph_breaks": 0}
    assert backend.runs() == 5 and backend.dynamic_graphs == 0
    assert caplog.text.count("compiled the drafter step for shape") == 2 and "WARNING" not in caplog.text


def test_a_recompile_for_a_known_shape_and_an_eager_fallback_are_warned(caplog, limit):
    global SCALE
    fn = CompiledRegion("drafter step", scaled, 1, "eager")
    warnings = DynamoWarnings()
    watch = StepWatch("drafter0 (cpu)", [fn], warnings)
    limit(2)
    with warnings, caplog.at_level(logging.WARNING):
        _call(watch, fn, 1, torch.ones(4))
        SCALE = 3.0  # a guarded global changed: same shape, new graph
        try:
            _call(watch, fn, 2, torch.ones(4))
            assert watch.unexpected_recompiles == 1 and "RECOMPILED" in caplog.text
            SCALE = 4.0  # a third graph: over the limit of 2, dynamo runs it eagerly
            out = _call(watch, fn, 3, torch.ones(4))
        finally:
            SCALE = 2.0
    assert torch.equal(out, torch.full((4,), 4.0))
    assert watch.eager_fallbacks == 1 and not watch.healthy()
    assert "ran EAGERLY" in caplog.text and "recompile_limit" in caplog.text  # dynamo's own reason
    assert "drafter step 1 of 1" in caplog.text


def test_a_fallback_in_one_region_of_several_is_warned(caplog, limit):
    """A regional step: one region falling back while another runs compiled is still a fallback."""
    global SCALE
    first = CompiledRegion("decoder layer", scaled, 4, "eager")
    second = CompiledRegion("loss chunk", doubled, 5, "eager")
    watch = StepWatch("drafter0 (cpu)", [first, second], DynamoWarnings())
    limit(1)

    def step(n):
        watch.before()
        for _ in range(3):
            first(torch.ones(n))
        second(torch.ones(n))
        watch.after(1, n)

    step(4)
    assert watch.summary() == {"compiles": 2, "unexpected_recompiles": 0, "eager_fallbacks": 0, "graph_breaks": 0}
    SCALE = 3.0  # the layer region's guard fails and the limit of 1 is reached: it runs eagerly
    try:
        with caplog.at_level(logging.WARNING, logger="dflash.compile_watch"):
            watch.before()
            for _ in range(3):
                first(torch.ones(4))
            second(torch.ones(4))
            watch.after(2, 4)
    finally:
        SCALE = 2.0
    assert watch.eager_fallbacks == 1 and "decoder layer 3 of 3" in caplog.text and "loss chunk" not in caplog.text


def test_a_graph_break_is_warned(caplog):
    fn = CompiledRegion("drafter step", scaled_with_break, 2, "eager")
    watch = StepWatch("drafter0 (cpu)", [fn])
    with caplog.at_level(logging.WARNING, logger="dflash.compile_watch"):
        _call(watch, fn, 1, torch.ones(3))
    assert watch.graph_breaks >= 1 and "graph break" in caplog.text


def test_counts_are_per_thread():
    import threading

    backend = CountingBackend("eager")
    fn = torch.compile(fresh_function(scaled, 3), backend=backend, dynamic=False)
    fn(torch.ones(2))
    seen = []
    worker = threading.Thread(target=lambda: seen.append((backend.compiles(), backend.runs())))
    worker.start()
    worker.join()
    assert seen == [(0, 0)] and (backend.compiles(), backend.runs()) == (1, 1)


def test_raise_recompile_limit_only_raises(limit):
    import torch._dynamo.config as config

    limit(50)
    raise_recompile_limit(10)
    assert getattr(config, recompile_limit_name()) == 50
    raise_recompile_limit(64)
    assert getattr(config, recompile_limit_name()) == 64


def test_an_eager_step_watch_does_nothing():
    watch = StepWatch("drafter0 (cpu)", [])
    watch.before()
    watch.after(1, (4,))
    assert not watch.enabled and watch.summary()["compiles"] == 0
