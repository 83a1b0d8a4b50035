"""``dflash train --profile-step``: the profiled step's trace and its time by kernel kind and stage
(:mod:`dflash.profiling`). The CPU run checks the plumbing; the kinds are CUDA kernel names."""

import gzip
import json
import logging
import threading

import pytest
import torch
from tiny import make_target, train_config, write_chat_data

from dflash import profiling
from dflash.config import TrainConfig
from dflash.run.settle import settle
from dflash.train.trainer import Trainer


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
        ("triton_tem_fused_flex_attention_0", "flex_attention"),
        ("triton_tem_fused_flex_attention_backward_1", "flex_attention"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "attention (SDPA)"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention (SDPA)"),  # SDPA's memory-efficient kernel
        ("triton_tem_fused_mm_0", "matmul"),  # an inductor GEMM template (max-autotune)
        ("triton_red_fused_chunk_cat_0", "compiled fused (inductor)"),
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "Gated DeltaNet (fla)"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "compiled fused (inductor)"),
        ("triton_poi_fused_mul_silu_1", "compiled fused (inductor)"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
    ],
)
def test_kernel_kinds(kernel, kind):
    assert profiling.kernel_kind(kernel).startswith(kind)


def test_a_profiled_step_writes_its_trace_and_logs_each_stage(tmp_path, caplog):
    config = train_config(
        target=make_target(tmp_path / "target", num_layers=5),
        data=write_chat_data(tmp_path / "train.jsonl", repeat=2),
        out=tmp_path / "run",
        steps=3,
        profile_step=2,
        save=False,
    )
    with caplog.at_level(logging.INFO, logger="dflash.profiling"):
        Trainer(settle(config)).train()
    with gzip.open(tmp_path / "run" / "profile_step2.json.gz") as trace:
        assert json.load(trace)["traceEvents"]
    assert not (tmp_path / "run" / "profile_step1.json.gz").exists()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "dflash.profiling"]
    assert line.startswith("step 2 profile (CPU time of ops (no GPU)):"), line
    tables = dict(part.split(": ", 1) for part in line.splitlines()[1:])
    assert set(tables) == {"  step", f"  {profiling.TARGET_RANGE}", f"  {profiling.DRAFTER_RANGE}"}, line
    assert all(" ms (" in table and "nothing recorded" not in table for table in tables.values()), line


def test_a_profile_step_past_the_run_is_refused():
    with pytest.raises(ValueError, match=r"profile_step: step 5 is past the run's --steps 4"):
        TrainConfig(steps=4, profile_step=5)
    with pytest.raises(ValueError, match="profile_step must be >= 0"):
        TrainConfig(profile_step=-1)


def test_a_backward_run_in_another_thread_counts_for_the_drafter_range_that_waits_on_it():
    """On CUDA the autograd engine runs the backward in a device thread of its own; a thread that
    runs it while the drafter range waits stands in for it on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    x, w = (torch.randn(64, 64, requires_grad=True) for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU], experimental_config=profiling._all_threads()) as prof:
        with profiling.marked(profiling.DRAFTER_RANGE):
            loss = (x @ w).relu().sum()
            engine = threading.Thread(target=loss.backward)
            engine.start()
            engine.join()
        (x @ w).sum().backward()  # a backward outside any marked range
    events = prof.events()
    ranges = [e for e in events if e.name == profiling.DRAFTER_RANGE]
    relu_grads = [e for e in events if e.name == "aten::threshold_backward"]  # only in the first backward
    assert relu_grads and all(e.thread != ranges[0].thread for e in relu_grads)
    assert {profiling._stage_of(e, ranges) for e in relu_grads} == {profiling.DRAFTER_RANGE}
    tables = profiling.step_tables(prof, cuda=False)
    assert tables[profiling.DRAFTER_RANGE]["matmul"] > 0 and tables[profiling.BACKWARD]["matmul"] > 0, tables


def test_each_stage_names_its_slowest_eager_ops_by_the_op_that_launched_them():
    """What ``--profile-step`` logs under each stage's kinds on CUDA, from the profiler's events
    (stand-ins here: the CPU has no kernels)."""
    from types import SimpleNamespace

    cpu = torch.autograd.DeviceType.CPU
    span = SimpleNamespace(start=0, end=100)

    def op(name, parent=None, kernels=()):
        kernels = [SimpleNamespace(name=k, duration=us) for k, us in kernels]
        return SimpleNamespace(name=name, device_type=cpu, cpu_parent=parent, kernels=kernels, time_range=span)

    drafter, target = op(profiling.DRAFTER_RANGE), op(profiling.TARGET_RANGE)
    events = [
        drafter,
        target,
        op("aten::mul", drafter, [("vectorized_elementwise_kernel<mul>", 3000), ("elementwise_kernel<mul>", 500)]),
        op("aten::mm", drafter, [("nvjet_tst_128x256", 9000)]),
        op("aten::_to_copy", drafter, [("unrolled_elementwise_kernel<copy>", 1000)]),
        op("aten::add", target, [("vectorized_elementwise_kernel<add>", 250)]),
        op("aten::mul", None, [("vectorized_elementwise_kernel<mul>", 7000)]),  # outside both stages
    ]
    ops = profiling.eager_ops(SimpleNamespace(events=lambda: events), cuda=True)
    assert ops == {
        profiling.DRAFTER_RANGE: [("aten::mul", 3.5), ("aten::_to_copy", 1.0)],
        profiling.TARGET_RANGE: [("aten::add", 0.25)],
    }
    assert (
        profiling.format_ops(ops).splitlines()[1]
        == f"  {profiling.DRAFTER_RANGE}, eager ops: aten::mul 3.5 ms, aten::_to_copy 1.0 ms"
    )
    assert profiling.eager_ops(SimpleNamespace(events=lambda: events), cuda=False) == {}


def test_a_resume_does_not_carry_the_saved_profile_step_over():
    from dflash.run.resume import resumed_values

    assert "profile_step" not in resumed_values({"steps": 50, "profile_step": 40}, {"steps": 30})
    assert resumed_values({"steps": 50, "profile_step": 40}, {"profile_step": 45})["profile_step"] == 45
