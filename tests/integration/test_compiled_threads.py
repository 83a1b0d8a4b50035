"""Compiled drafter steps in threads (CPU, ``aot_eager``, which still traces with make_fx, the
race window): forced recompiles in every thread run compiled, and an eager fallback is
reported with dynamo's reason. Threads that compile: integration tier."""

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


def _config(assets, out):
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
        vary_seq_len=2,
    )


def test_forced_recompiles_in_threads_run_compiled_and_fallbacks_are_reported(assets, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dflash.train.trainer, "build_replicas", functools.partial(build_replicas, backend="aot_eager"))
    healthy = Trainer(settle(_config(assets, tmp_path / "ok")))
    healthy.train()
    # Regional: the one decoder layer once per length, the loss chunk (its shape is the anchors') once.
    assert healthy.engine.compile_summary() == {
        f"drafter{i} (cpu:{i})": {"compiles": 3, "unexpected_recompiles": 0, "eager_fallbacks": 0, "graph_breaks": 0}
        for i in range(2)
    }

    # A recompile limit of 1 in the threads: the second length must be reported as an eager fallback.
    import torch._dynamo.config as dynamo_config

    name = recompile_limit_name()
    original = getattr(dynamo_config, name)
    monkeypatch.setattr(threaded, "raise_recompile_limit", lambda limit: setattr(dynamo_config, name, 1))
    starved = Trainer(settle(_config(assets, tmp_path / "starved")))
    try:
        with caplog.at_level(logging.WARNING, logger="dflash.compile_watch"):
            starved.train()
    finally:  # with the patches a thread's plain assignment is process-wide: restore it
        setattr(dynamo_config, name, original)
    assert all(counts["eager_fallbacks"] >= 1 for counts in starved.engine.compile_summary().values())
    assert "ran EAGERLY" in caplog.text and "recompile_limit" in caplog.text
