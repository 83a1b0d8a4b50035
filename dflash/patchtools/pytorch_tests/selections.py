"""Which of PyTorch's test files to run: each file (or a ``-k`` subset of one) in its own process.

``full`` covers what the series changes: FX tracing and its passes, make_fx, config modules, dynamo,
AOTAutograd, export and its serialization, control flow and other higher-order ops, autograd, a
flex_attention subset, the threaded process group. ``ci`` is the part nearest the series that CI runs
in a few minutes. Paths are relative to the tree's ``test/``. PyTorch's own ``run_test.py`` skips
``test/fx/`` (``test_fx.py`` imports most of it); it is run here file by file as well.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """One pytest process: a test file, optionally narrowed by a ``-k`` expression."""

    path: str
    keyword: str | None = None

    @property
    def label(self) -> str:
        return self.path if self.keyword is None else f"{self.path} -k '{self.keyword}'"

    @property
    def slug(self) -> str:
        """A file name for this entry's outputs."""
        base = self.path.removesuffix(".py").replace("/", "__")
        if self.keyword is None:
            return base
        return f"{base}__k{hashlib.sha256(self.keyword.encode()).hexdigest()[:8]}"

    def pytest_args(self) -> list[str]:
        return [self.path, *(["-k", self.keyword] if self.keyword is not None else [])]


_FX = [
    "fx/test_common_passes.py",
    "fx/test_cse_pass.py",
    "fx/test_dce_pass.py",
    "fx/test_future.py",
    "fx/test_fx_const_fold.py",
    "fx/test_fx_node_hook.py",
    "fx/test_fx_param_shape_control_flow.py",
    "fx/test_fx_split.py",
    "fx/test_fx_traceback.py",
    "fx/test_fx_xform_observer.py",
    "fx/test_gradual_type.py",
    "fx/test_lazy_graph_module.py",
    "fx/test_matcher_utils.py",
    "fx/test_partitioner_order.py",
    "fx/test_pass_infra.py",
    "fx/test_shape_inference.py",
    "fx/test_source_matcher_utils.py",
    "fx/test_subgraph_rewriter.py",
    "fx/test_z3_gradual_types.py",
]
_DYNAMO = [
    "dynamo/test_activation_checkpointing.py",
    "dynamo/test_aot_autograd.py",
    "dynamo/test_autograd_function.py",
    "dynamo/test_backends.py",
    "dynamo/test_backward_higher_order_ops.py",
    "dynamo/test_compile.py",
    "dynamo/test_config.py",
    "dynamo/test_ctx_manager.py",
    "dynamo/test_decorators.py",
    "dynamo/test_exceptions.py",
    "dynamo/test_export.py",
    "dynamo/test_export_mutations.py",
    "dynamo/test_frame_init.py",
    "dynamo/test_global.py",
    "dynamo/test_guard_manager.py",
    "dynamo/test_higher_order_ops.py",
    "dynamo/test_hooks.py",
    "dynamo/test_interop.py",
    "dynamo/test_logging.py",
    "dynamo/test_metrics_context.py",
    "dynamo/test_misc.py",
    "dynamo/test_modes.py",
    "dynamo/test_modules.py",
    "dynamo/test_pre_dispatch.py",
    "dynamo/test_python_autograd.py",
    "dynamo/test_recompile_ux.py",
    "dynamo/test_recompiles.py",
    "dynamo/test_skip_guard_eval_unsafe.py",
    "dynamo/test_structured_trace.py",
    "dynamo/test_subgraphs.py",
    "dynamo/test_trace_rules.py",
    "dynamo/test_utils.py",
]
_EXPORT = [
    "export/test_db.py",
    "export/test_export.py",
    "export/test_export_nonstrict.py",
    "export/test_hop.py",
    "export/test_lift_unlift.py",
    "export/test_passes.py",
    "export/test_serdes.py",
    "export/test_serialize.py",
    "export/test_swap.py",
    "export/test_tools.py",
    "export/test_torchbind.py",
    "export/test_tree_utils.py",
    "export/test_unflatten.py",
    "export/test_verifier.py",
]

FULL = (
    Entry("test_fx.py"),
    Entry("test_fx_experimental.py"),
    Entry("test_fx_passes.py"),
    Entry("test_proxy_tensor.py"),
    Entry("test_utils_config_module.py"),
    *map(Entry, _FX),
    *map(Entry, _DYNAMO),
    Entry("dynamo/test_repros.py", "thread"),
    *map(Entry, _EXPORT),
    # OpInfo and ModuleInfo sweeps: thousands of op-by-op cases, the ops' business, not tracing state's
    Entry("functorch/test_aotdispatch.py", "not OpInfo and not ModuleInfo"),
    Entry("functorch/test_control_flow.py"),
    Entry("higher_order_ops/test_invoke_subgraph.py"),
    Entry("higher_order_ops/test_with_effects.py"),
    Entry("test_autograd.py"),
    Entry("inductor/test_flex_attention.py", "TestBlockMask or TestPagedAttention"),  # the rest needs a GPU
    Entry("distributed/test_multi_threaded_pg.py"),
)

CI = (
    Entry("test_utils_config_module.py"),
    # test_misc's 26 tests (MiscTests has 547) of anomaly mode, threads, config, compile flags, FX tracing, hooks,
    # export, patches and stacks, test_anomaly_aot_autograd among them (the whole file: half an hour on 2 cores)
    Entry("dynamo/test_misc.py", "anomaly or thread or config or compiling or fx or hook or export or patch or stack"),
    Entry("fx/test_fx_traceback.py"),
    # the deserializer's round trips, save/load and custom classes; its exportdb sweep and the serializer's
    # own tests (60% of the file's time) stay in the full selection
    Entry("export/test_serialize.py", "TestDeserialize and not exportdb or TestSaveLoad or TestSerializeCustomClass"),
    Entry("test_autograd.py", "thread"),  # TestMultithreadAutograd and other thread tests (-k ignores case)
)

SELECTIONS = {"full": FULL, "ci": CI}
