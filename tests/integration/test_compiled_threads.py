"""Compiled drafter steps in threads (CPU, ``aot_eager``, which still traces with make_fx, the
race window): each thread compiles once per length, as one graph or regionally, and an eager
fallback is reported with dynamo's reason. Threads that compile: integration tier."""

import functools
import logging

import pytest
from tiny import make_target, train_config, write_chat_data

import dflash.train.trainer
from dflash.compile_watch import recompile_limit_name
from dflash.run.settle import settle
from dflash.train import threaded
from dflash.train.replica import build_replicas
from dflash.train.trainer import Trainer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    return {"target": make_target(root / "qwen3", num_layers=5), "data": write_chat_data(root / "train.jsonl")}


def _config(assets, out, scope="step", **values):
    return train_config(
        target=assets["target"],
        data=assets["data"],
        out=out,
        steps=3,
        warmup_steps=1,
        save_every=0,
        log_every=3,
        target_devices="cpu",
        drafter_devices="cpu:0-1",
        compile="on",
        compile_scope=scope,
        vary_seq_len=2,
        **values,
    )


@pytest.mark.parametrize(
    "scope, compiles",
    # The step once per length; regionally the (one) decoder layer once per length and the loss
    # chunk once (its shape is the anchors').
    [("step", 2), ("regional", 3)],
)
def test_each_thread_compiles_once_per_length_and_no_more(assets, tmp_path, monkeypatch, caplog, scope, compiles):
    monkeypatch.setattr(dflash.train.trainer, "build_replicas", functools.partial(build_replicas, backend="aot_eager"))
    healthy = Trainer(settle(_config(assets, tmp_path / "ok", scope)))
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        healthy.train()
    # Said before step 1, whose compiles keep the progress bar still.
    assert f"step 1 compiles the drafter step (--compile-scope {scope}): up to minutes on a cold" in caplog.text
    assert healthy.engine.compile_summary() == {
        f"drafter{i} (cpu:{i})": {
            "compiles": compiles,
            "unexpected_recompiles": 0,
            "eager_fallbacks": 0,
            "graph_breaks": 0,
        }
        for i in range(2)
    }


def test_a_thread_over_its_recompile_limit_reports_its_eager_fallback(assets, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dflash.train.trainer, "build_replicas", functools.partial(build_replicas, backend="aot_eager"))
    # A recompile limit of 1 in the threads: the second length must be reported as an eager fallback.
    import torch._dynamo.config as dynamo_config

    name = recompile_limit_name()
    original = getattr(dynamo_config, name)
    monkeypatch.setattr(threaded, "raise_recompile_limit", lambda limit: setattr(dynamo_config, name, 1))
    # The target's compiled regions raise the limit for their thread, process-wide with the
    # patches: starve the drafter threads alone.
    starved = Trainer(settle(_config(assets, tmp_path / "starved", compile_target=False)))
    try:
        with caplog.at_level(logging.WARNING, logger="dflash.compile_watch"):
            starved.train()
    finally:  # with the patches a thread's plain assignment is process-wide: restore it
        setattr(dynamo_config, name, original)
    assert all(counts["eager_fallbacks"] >= 1 for counts in starved.engine.compile_summary().values())
    assert "ran EAGERLY" in caplog.text and "recompile_limit" in caplog.text
