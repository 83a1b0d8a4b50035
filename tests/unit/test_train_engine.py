"""dflash.train.engine on CPU "devices": the threaded engine equals the local engine on the same global
batch with every loss option, replicas stay bit-identical, exact resume, thread failures reach
the main thread with their names, the prefetch buffer orders and bounds."""

import threading

import pytest
import torch
from tiny import make_target, record_losses, train_config, write_chat_data

import dflash.train.loss
import dflash.train.step
from dflash.drafter.files import CheckpointError
from dflash.run.settle import settle
from dflash.train import threaded
from dflash.train.engine import StepStats, read_step_stats
from dflash.train.jobs import seq_len_schedule
from dflash.train.step import StatsLayout
from dflash.train.threaded import Control, Inbox, PipelineError
from dflash.train.trainer import Trainer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {
        "target": make_target(root / "qwen3", num_layers=5),
        "data": write_chat_data(root / "train.jsonl", repeat=4),
    }


def _config(assets, out, **overrides):
    threaded = dict(steps=4, save_every=2, target_devices="cpu", drafter_devices="cpu:0-1")
    return train_config(**{"target": assets["target"], "data": assets["data"], "out": out, **threaded, **overrides})


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def _gradients(trainer) -> torch.Tensor:
    """The last step's (normalised) gradients of replica 0, flattened."""
    return torch.cat([p.grad.flatten() for p in trainer.drafter.parameters()])


LOSS_FLAGS = dict(loss_chunk_blocks=1, soft_label_weight=0.3, dpace=True)


def test_threaded_engine_equals_the_local_engine_with_every_loss_flag(assets, tmp_path):
    # Same global batch: 2 drafter threads x 1 micro-batch == 1 device x grad_accum 2 (same
    # batches, same anchor stream). The two-term gradient sum g0 + g1 is the same float sum in
    # both, and AdamW sees identical inputs, so losses, gradients and weights match bit for bit.
    local = Trainer(
        settle(
            _config(assets, tmp_path / "local", grad_accum=2, target_devices=None, drafter_devices=None, **LOSS_FLAGS)
        )
    )
    threaded_ = Trainer(settle(_config(assets, tmp_path / "threaded", **LOSS_FLAGS)))
    assert local.engine.settings == threaded_.engine.settings  # one LossSettings, built once
    try:
        for step in range(1, 4):
            a = local.engine.run(step, lr=1e-2)
            b = threaded_.engine.run(step, lr=1e-2)
            assert (a.loss, a.acc, a.grad_norm, a.tokens, a.row_tokens, a.supervised) == (
                b.loss,
                b.acc,
                b.grad_norm,
                b.tokens,
                b.row_tokens,
                b.supervised,
            )
            assert torch.equal(_gradients(local), _gradients(threaded_))
        for replica in threaded_.engine.replicas:
            _assert_same_weights(replica.model, local.drafter)
    finally:
        threaded_.engine.close()


def test_every_engine_runs_the_lm_head_in_chunks_of_loss_chunk_blocks(assets, tmp_path, monkeypatch):
    # A micro-batch has 2 rows x 6 anchors = 12 draft blocks: 12 chunks of 1 block, or 3 of 4.
    sizes = []
    real = dflash.train.loss._FusedChunkLoss.forward

    def counting(ctx, hidden, *args):
        sizes.append(hidden.shape[0])
        return real(ctx, hidden, *args)

    monkeypatch.setattr(dflash.train.loss._FusedChunkLoss, "forward", staticmethod(counting))
    layouts = {"local": (dict(target_devices=None, drafter_devices=None), 1), "threaded": ({}, 2)}
    for name, (layout, micro_batches) in layouts.items():
        for chunk in (1, 4):
            sizes.clear()
            trainer = Trainer(settle(_config(assets, tmp_path / f"{name}{chunk}", loss_chunk_blocks=chunk, **layout)))
            trainer.engine.run(1, lr=1e-2)
            trainer.engine.close()
            assert sorted(sizes) == [chunk] * ((12 // chunk) * micro_batches), (name, chunk)


def _supervised_slots(input_ids, loss_mask, document_ids, anchors, valid, block_size) -> int:
    """Slots after a valid anchor inside the row, in the anchor's document, loss mask on: counted
    one by one."""
    count = 0
    for row in range(input_ids.shape[0]):
        for anchor in anchors[row][valid[row]].tolist():
            for position in range(anchor + 1, min(anchor + block_size, input_ids.shape[1])):
                same = document_ids[row, position] == document_ids[row, anchor]
                count += bool(same and loss_mask[row, position])
    return count


def test_every_engine_counts_the_supervised_draft_positions(assets, tmp_path, monkeypatch):
    counted = []
    real = dflash.train.step._drafter_step

    def counting(step_fn, drafter, heads, inputs, anchors, valid, *rest):
        input_ids, loss_mask, _, document_ids = inputs[:4]
        size = drafter.config.block_size
        counted.append(_supervised_slots(input_ids, loss_mask, document_ids, anchors, valid, size))
        return real(step_fn, drafter, heads, inputs, anchors, valid, *rest)

    monkeypatch.setattr(dflash.train.step, "_drafter_step", counting)
    for name, layout in {"local": dict(target_devices=None, drafter_devices=None), "threaded": {}}.items():
        counted.clear()
        trainer = Trainer(settle(_config(assets, tmp_path / name, **layout)))
        stats = trainer.engine.run(1, lr=1e-2)
        trainer.engine.close()
        assert stats.supervised == sum(counted) > 0, name
        assert stats.supervised < stats.draft_tokens, name  # slot 0, the anchor, is given


def test_replicas_stay_identical_and_resume_is_exact(assets, tmp_path, monkeypatch):
    monkeypatch.setattr("dflash.devices.usable_cores", lambda: 4)  # three drafter replicas on any host
    config = dict(
        drafter_devices="cpu:0-2", target_devices="cpu:0-1", grad_accum=2, steps=6, save_every=3, batch_size=1
    )
    reference = record_losses(Trainer(settle(_config(assets, tmp_path / "full", **config))))
    reference.train()
    first, second, third = (r.model for r in reference.engine.replicas)
    _assert_same_weights(first, second)
    _assert_same_weights(first, third)

    crashed = record_losses(Trainer(settle(_config(assets, tmp_path / "split", **config))), crash_after=3)
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    assert all(not w.is_alive() for w in crashed.engine.threads)  # the threads were stopped
    resumed = record_losses(Trainer(settle(_config(assets, tmp_path / "split", resume=True, **config))))
    assert resumed.step == 3
    resumed.train()
    assert crashed.losses + resumed.losses == reference.losses  # bitwise
    for replica in resumed.engine.replicas:
        _assert_same_weights(replica.model, first)


def test_resume_with_a_different_drafter_layout_is_refused(assets, tmp_path, monkeypatch):
    monkeypatch.setattr("dflash.devices.usable_cores", lambda: 4)
    Trainer(settle(_config(assets, tmp_path, steps=1))).train()
    with pytest.raises(CheckpointError, match="4 rows per process .* the resumed layout on 6 .* use 1 or 2 drafter"):
        Trainer(settle(_config(assets, tmp_path, steps=2, drafter_devices="cpu:0-2", resume=True)))
    # Target threads may change between runs: the math does not depend on them.
    resumed = Trainer(settle(_config(assets, tmp_path, steps=2, target_devices="cpu:0-1", resume=True)))
    assert resumed.step == 1


def test_a_failing_target_thread_stops_all_threads_and_is_reraised_with_its_name(assets, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = threaded.produce_target_states

    def flaky(target, batch, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("target exploded")
        return real(target, batch, **kwargs)

    monkeypatch.setattr(threaded, "produce_target_states", flaky)
    trainer = Trainer(settle(_config(assets, tmp_path)))
    with pytest.raises(PipelineError, match=r"thread 'target0 \(cpu\)' failed: RuntimeError: target exploded") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert all(not w.is_alive() for w in trainer.engine.threads)
    assert not [t for t in threading.enumerate() if t.name.startswith(("target", "drafter"))]


def test_a_failing_drafter_thread_is_named(assets, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("drafter exploded")

    monkeypatch.setattr(threaded, "drafter_step", broken)
    with pytest.raises(PipelineError, match=r"thread 'drafter\d \(cpu:\d\)' failed: ValueError: drafter exploded"):
        Trainer(settle(_config(assets, tmp_path))).train()


def test_inbox_orders_out_of_order_puts_and_bounds_the_prefetch():
    control = Control()
    inbox = Inbox(2, control)
    inbox.put(1, "b")
    inbox.put(0, "a")
    blocked = threading.Thread(target=inbox.put, args=(2, "c"))  # slot 2 >= next(0) + depth(2): waits
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive() and len(inbox) == 2
    assert inbox.get() == "a"  # frees room: slot 2 goes in
    blocked.join(2)
    assert not blocked.is_alive()
    assert [inbox.get(), inbox.get()] == ["b", "c"]
    control.fail("test", RuntimeError("boom"))
    with pytest.raises(PipelineError, match="'test' failed"):
        inbox.get()


def test_seq_len_schedule():
    assert seq_len_schedule(48, 1) == [48]
    assert seq_len_schedule(48, 3) == [48, 40, 32]
    assert seq_len_schedule(4096, 4) == [4096, 3416, 2736, 2056]
    with pytest.raises(ValueError, match="too short"):
        seq_len_schedule(32, 4)


@pytest.mark.parametrize("grad_clip", [0.0, 0.05, 1e6])
def test_optimizer_step_divides_by_the_weight_and_clips_in_the_fused_kernel(grad_clip):
    import copy
    import types

    from dflash.distributed import FlatGradients
    from dflash.train.replica import DrafterReplica, build_optimizer, optimizer_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    config = types.SimpleNamespace(lr=0.1, weight_decay=0.01)
    flat = FlatGradients(model, extra=StatsLayout(2).size)
    replica = DrafterReplica(
        "r", torch.device("cpu"), model, None, build_optimizer(model, config), flat, None, None, None
    )
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(3):
        x = torch.randn(4, 8)
        flat.zero_()
        model(x).pow(2).sum().backward()
        flat.stats[StatsLayout.WEIGHT] = 2.5 + step
        norm = optimizer_step([replica], lr=0.1, grad_clip=grad_clip)

        ref_optimizer.zero_grad()
        reference(x).pow(2).sum().backward()
        for p in reference.parameters():
            p.grad /= 2.5 + step
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), grad_clip or float("inf"))
        ref_optimizer.step()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _stats(acc) -> StepStats:
    return StepStats(
        loss=0.0, acc=acc, grad_norm=0.0, tokens=1, row_tokens=1, draft_tokens=1, supervised=1, step_s=1.0,
        drafter_s=1.0, target_s=0.0, target_row_tokens=0, data_wait_frac=0.0, flops=0.0, stop=False,
    )  # fmt: skip


def test_tau_hat_known_values():
    assert _stats([1.0, 1.0, 1.0]).tau_hat == 4.0
    assert _stats([0.5, 0.5]).tau_hat == pytest.approx(1.75)
    assert _stats([0.0, 1.0, 1.0]).tau_hat == 1.0
    assert _stats([0.9, 0.8, 0.5]).tau_hat == pytest.approx(1 + 0.9 + 0.72 + 0.36)


def test_step_accuracy_divides_the_counts_summed_over_micro_batches():
    layout = StatsLayout(3)
    # Two micro-batches: slot 1 has 1/1 then 0/3 correct -> 1/4 overall, not the mean 1/2.
    correct = torch.tensor([0, 1, 2]) + torch.tensor([0, 0, 1])
    total = torch.tensor([0, 1, 2]) + torch.tensor([0, 3, 2])
    stats = torch.zeros(layout.size)
    stats[layout.correct], stats[layout.total] = correct.float(), total.float()
    assert read_step_stats(stats, torch.tensor(0.0), layout)["acc"] == [0.25, 0.75]
    none = torch.zeros(StatsLayout(2).size)
    assert read_step_stats(none, torch.tensor(0.0), StatsLayout(2))["acc"] == [0.0]


def test_the_optimizers_moments_take_their_memory_before_the_first_step():
    """A run too big for its GPU should fail in step 1, not after a first step and its compile."""
    import types

    from dflash.train.replica import build_optimizer

    model = torch.nn.Linear(8, 3)
    optimizer = build_optimizer(model, types.SimpleNamespace(lr=0.1, weight_decay=0.0))
    for p in model.parameters():
        state = optimizer.state[p]
        assert state["exp_avg"].shape == p.shape and not state["exp_avg"].any() and float(state["step"]) == 0
