"""``dflash train --profile-step``: the profiled step's trace and its time by kernel kind and stage
(:mod:`dflash.profiling`). The CPU run checks the plumbing; the kinds are CUDA kernel names."""

import gzip
import json
import logging
import random
import threading
from pathlib import Path

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
        ("causal_conv1d_fwd_kernel", "Gated DeltaNet (fla)"),  # fla's varlen conv of the GDN layers
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication (NCCL)"),
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
    stages = {f"  {profiling.TARGET_RANGE}", f"  {profiling.DRAFTER_RANGE}"}
    assert stages | {"  step"} <= set(tables) <= stages | {"  step", f"  {profiling.OUTSIDE}"}, line
    assert all(" ms (" in table and "nothing recorded" not in table for table in tables.values()), line


def test_a_profile_step_past_the_run_is_refused():
    with pytest.raises(ValueError, match=r"profile_step: step 5 is past the run's --steps 4"):
        TrainConfig(steps=4, profile_step=5)
    with pytest.raises(ValueError, match="profile_step must be >= 0"):
        TrainConfig(profile_step=-1)


def test_a_backward_run_in_another_thread_counts_for_the_drafter_range_that_waits_on_it(tmp_path):
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
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    (drafter,) = [e for e in events if e["name"] == profiling.DRAFTER_RANGE]
    relu_grads = [e for e in events if e["name"] == "aten::threshold_backward"]  # only in the first backward
    assert relu_grads and all(e["tid"] != drafter["tid"] for e in relu_grads)
    ops = profiling._ops_in_stages(events)
    assert {ops[e["args"]["External id"]].stage for e in relu_grads} == {profiling.DRAFTER_RANGE}
    tables, _ = profiling.trace_tables(events, cuda=False)
    assert tables[profiling.DRAFTER_RANGE]["matmul"] > 0 and tables[profiling.BACKWARD]["matmul"] > 0, tables


def _trace(*events):
    """Chrome-trace events as the profiler exports them: (cat, name, tid, ts, dur, External id)."""
    return [
        {"cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, **({"args": {"External id": ext}} if ext else {})}
        for cat, name, tid, ts, dur, ext in events
    ]


def test_each_kernel_counts_for_the_stage_of_the_op_that_launched_it():
    """The CUDA tables from the trace: a kernel names its launching op by External id; a backward
    node the autograd engine ran in its own thread counts for the drafter range open meanwhile;
    each thread's ranges hold only that thread's ops (the threaded layout's target thread)."""
    engine = profiling._ENGINE_ROOT + ": MmBackward0"
    events = _trace(
        ("user_annotation", profiling.TARGET_RANGE, 1, 0, 100, 1),
        ("cpu_op", "aten::linear", 1, 10, 20, 2),
        ("cpu_op", "aten::mm", 1, 12, 10, 3),  # inside aten::linear: the op that launched
        ("cpu_op", "aten::mul", 1, 40, 5, 4),
        ("user_annotation", profiling.DRAFTER_RANGE, 1, 200, 100, 5),
        ("cpu_op", "aten::add_", 1, 210, 5, 6),
        ("user_annotation", "a hook's range", 2, 245, 40, 12),  # the engine node need not be outermost
        ("cpu_op", engine, 2, 250, 30, 7),  # the autograd engine's thread, while the drafter range waits
        ("cpu_op", "aten::mm", 2, 255, 10, 8),
        ("cpu_op", engine, 2, 290, 30, 13),  # ends after the drafter range: no range waited on it
        ("cpu_op", "aten::mm", 2, 295, 10, 14),
        ("user_annotation", profiling.TARGET_RANGE, 3, 205, 50, 15),  # a target thread's forward meanwhile
        ("cpu_op", "aten::mm", 3, 210, 10, 16),
        ("cpu_op", "aten::mul", 3, 270, 5, 17),  # after its range: in no stage, though the drafter's is open
        ("cpu_op", "aten::mul", 1, 500, 5, 11),
        ("kernel", "nvjet_tst_128x256", 0, 30, 9000, 3),
        ("kernel", "vectorized_elementwise_kernel<mul>", 0, 50, 3000, 4),
        ("kernel", "vectorized_elementwise_kernel<add>", 0, 220, 250, 6),
        ("gpu_memset", "Memset (Device)", 0, 230, 100, 6),
        ("kernel", "nvjet_tst_64x64", 0, 260, 4000, 8),
        ("kernel", "nvjet_tst_64x64", 0, 300, 2000, 14),
        ("kernel", "nvjet_tst_64x64", 0, 215, 1000, 16),
        ("kernel", "vectorized_elementwise_kernel<mul>", 0, 275, 600, 17),
        ("kernel", "vectorized_elementwise_kernel<mul>", 0, 510, 7000, 11),
        ("kernel", "triton_poi_fused_0", 0, 600, 500, None),  # no launching op recorded
        ("overhead", "Command Buffer Full", 0, 60, 58000, None),  # a CUPTI stall, not GPU work
    )
    tables, ops = profiling.trace_tables(events, cuda=True)
    assert tables == {
        "step": {"matmul": 16.0, profiling.OTHER_KIND: 10.95, "compiled fused (inductor)": 0.5},
        profiling.TARGET_RANGE: {"matmul": 10.0, profiling.OTHER_KIND: 3.0},
        profiling.DRAFTER_RANGE: {profiling.OTHER_KIND: 0.35, "matmul": 4.0},
        profiling.BACKWARD: {"matmul": 2.0},
        profiling.OUTSIDE: {profiling.OTHER_KIND: 7.6, "compiled fused (inductor)": 0.5},
    }
    assert ops == {
        profiling.TARGET_RANGE: [("aten::mul", 3.0)],
        profiling.DRAFTER_RANGE: [("aten::add_", 0.35)],
    }
    assert profiling.format_ops(ops).splitlines()[1] == f"  {profiling.TARGET_RANGE}, eager ops: aten::mul 3.0 ms"
    assert profiling.trace_tables(random.Random(0).sample(events, len(events)), cuda=True) == (tables, ops)  # any order


def test_a_real_steps_stages_fit_inside_their_gpu_spans():
    """A step of the user's shape on an H200 (Qwen3.6-27B layout, 64 layers, bf16, batch 4 x 2,048;
    the trace trimmed to the marked ranges, the autograd engine's nodes and the ops that launched
    kernels). torch 2.11's FunctionEvent.kernels logged
    1,188 ms for the target's forward and 1,090 ms for the drafter step here, more than the GPU
    spent inside each range (797 and 835 ms) and 642 ms more than the step's 1,636 ms of kernels."""
    path = Path(__file__).parents[1] / "data" / "h200_qwen36_27b_bf16_profile_step7.json.gz"
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    tables, _ = profiling.trace_tables(events, cuda=True)
    total = {name: sum(table.values()) for name, table in tables.items()}
    spans = {e["name"]: e["dur"] / 1e3 for e in events if e["cat"] == "gpu_user_annotation"}
    for stage in (profiling.TARGET_RANGE, profiling.DRAFTER_RANGE):
        assert 0.95 * spans[stage] < total[stage] <= spans[stage], (stage, total[stage], spans[stage])
    assert abs(sum(ms for name, ms in total.items() if name != "step") - total["step"]) < 1e-6
    assert round(total["step"], 1) == 1636.2


def test_a_resume_does_not_carry_the_saved_profile_step_over():
    from dflash.run.resume import resumed_values

    assert "profile_step" not in resumed_values({"steps": 50, "profile_step": 40}, {"steps": 30})
    assert resumed_values({"steps": 50, "profile_step": 40}, {"profile_step": 45})["profile_step"] == 45
