"""Module attributes that used to be globals stay live views of the per-thread state (patches 0003, 0007-0009, 0012).

``torch.fx._symbolic_trace.CURRENT_PATCHER``, ``torch.fx._lazy_graph_module._use_lazy_graph_module_flag``
and ``_force_skip_lazy_graph_module_flag``, ``torch._dynamo.utils._error_on_graph_break``,
``torch.fx.traceback.current_meta`` (updated in place by ``torch/utils/checkpoint.py`` and
AOTAutograd) and ``should_preserve_node_meta``, ``torch._export.serde.serialize._CURRENT_DESERIALIZER``
and ``torch._ops._mode_stack_state_for_pre_dispatch`` were module globals that code outside torch
reads and assigns. The series keeps their values per thread;
an assignment used to shadow the module ``__getattr__`` that served them for good: later reads
returned the assigned value, not the live one, and tracing ignored it. Now an assignment sets the
calling thread's value, which tracing uses, and reads follow the state as it changes. Plain torch
gets the same answers in the assigning thread; in another thread it sees the assignment (a global),
the series does not (per thread).

Integration tier: fresh interpreters, plain (``DFLASH_PATCHES=0``) and patched.
"""

from __future__ import annotations

import pytest
from tiny import script_result

pytest.importorskip("torch")

VIEWS = """
import json, threading
import torch, torch.fx
import torch.fx._lazy_graph_module as lazy
import torch.fx._symbolic_trace as symbolic_trace
from torch._dynamo import utils as dynamo_utils


def in_other_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(60)
    return out[0]


live, other_thread_sees_it = {}, {}
lazy._use_lazy_graph_module_flag = True
live["lazy flag: tracing here makes lazy graph modules"] = lazy._get_graph_module_cls() is lazy._LazyGraphModule
other_thread_sees_it["lazy flag"] = in_other_thread(lambda: lazy._get_graph_module_cls() is lazy._LazyGraphModule)
with lazy._use_lazy_graph_module(False):
    live["lazy flag: reads the value of an open block"] = lazy._use_lazy_graph_module_flag is False
live["lazy flag: reads the assigned value after it"] = lazy._use_lazy_graph_module_flag is True
lazy._use_lazy_graph_module_flag = False

lazy._force_skip_lazy_graph_module_flag = True
with lazy._use_lazy_graph_module(True):
    live["force-skip flag: wins over a block that asks for lazy"] = lazy._get_graph_module_cls() is torch.fx.GraphModule
other_thread_sees_it["force-skip flag"] = in_other_thread(lambda: lazy._force_skip_lazy_graph_module_flag)
lazy._force_skip_lazy_graph_module_flag = False

symbolic_trace.CURRENT_PATCHER = None
with symbolic_trace._new_patcher() as patcher:
    live["CURRENT_PATCHER: reads the open patcher after an assignment"] = symbolic_trace.CURRENT_PATCHER is patcher
    other_thread_sees_it["CURRENT_PATCHER"] = in_other_thread(lambda: symbolic_trace.CURRENT_PATCHER is patcher)
live["CURRENT_PATCHER: None once it closed"] = symbolic_trace.CURRENT_PATCHER is None

if hasattr(dynamo_utils, "_get_error_on_graph_break"):  # torch >= 2.9
    dynamo_utils._error_on_graph_break = True
    live["_error_on_graph_break: what this thread's compiles use"] = dynamo_utils._get_error_on_graph_break() is True
    other_thread_sees_it["_error_on_graph_break"] = in_other_thread(dynamo_utils._get_error_on_graph_break)
    dynamo_utils._error_on_graph_break = False
    live["_error_on_graph_break: reads False again"] = dynamo_utils._error_on_graph_break is False

import torch.fx.traceback as fx_traceback

fx_traceback.current_meta["custom"] = {"owner": "main"}
live["current_meta: an update in place is what get_current_meta() holds"] = (
    fx_traceback.get_current_meta().get("custom") == {"owner": "main"}
)
other_thread_sees_it["current_meta"] = in_other_thread(lambda: "custom" in fx_traceback.get_current_meta())
del fx_traceback.current_meta["custom"]
fx_traceback.should_preserve_node_meta = True
live["should_preserve_node_meta: what has_preserved_node_meta() answers"] = fx_traceback.has_preserved_node_meta()
other_thread_sees_it["should_preserve_node_meta"] = in_other_thread(fx_traceback.has_preserved_node_meta)
fx_traceback.should_preserve_node_meta = False
with fx_traceback.preserve_node_meta():
    live["should_preserve_node_meta: reads the value of an open block"] = fx_traceback.should_preserve_node_meta
live["should_preserve_node_meta: reads the assigned value after it"] = fx_traceback.should_preserve_node_meta is False

from torch._export.serde import serialize
from torch._subclasses.fake_tensor import FakeTensorMode


class Deserializer:
    def deserialize_tensor_meta(self, tensor_meta):
        return "rebuilt by the assigned deserializer"


with FakeTensorMode():
    _, reduced = serialize._reduce_fake_tensor(torch.empty(2))
serialize._CURRENT_DESERIALIZER = Deserializer()
live["_CURRENT_DESERIALIZER: what rebuilds this thread's fake tensors"] = (
    serialize._reconstruct_fake_tensor(*reduced) == "rebuilt by the assigned deserializer"
)
other_thread_sees_it["_CURRENT_DESERIALIZER"] = in_other_thread(lambda: serialize._CURRENT_DESERIALIZER is not None)
serialize._CURRENT_DESERIALIZER = None
live["_CURRENT_DESERIALIZER: reads None again"] = serialize._CURRENT_DESERIALIZER is None

import torch._ops as ops

original = ops._mode_stack_state_for_pre_dispatch
live["_mode_stack_state_for_pre_dispatch: reads this thread's stack"] = (
    original is ops.mode_stack_state_for_pre_dispatch()
)
assigned = ops._mode_stack_state_for_pre_dispatch = ops._ModeStackStateForPreDispatch()
live["_mode_stack_state_for_pre_dispatch: the assigned stack is what this thread's modes use"] = (
    ops.mode_stack_state_for_pre_dispatch() is assigned and ops._mode_stack_state_for_pre_dispatch is assigned
)
other_thread_sees_it["_mode_stack_state_for_pre_dispatch"] = in_other_thread(
    lambda: ops.mode_stack_state_for_pre_dispatch() is assigned
)
ops._mode_stack_state_for_pre_dispatch = original
print(json.dumps({"live": live, "other_thread_sees_it": other_thread_sees_it}))
"""


def test_assigned_module_attributes_set_the_calling_threads_live_value():
    plain = script_result(VIEWS, patched=False)
    assert all(plain["live"].values()), plain
    assert all(plain["other_thread_sees_it"].values()), f"plain torch's globals are process-wide: {plain}"
    patched = script_result(VIEWS, patched=True)
    assert all(patched["live"].values()), f"a module attribute is a stale view: {patched['live']}"
    assert not any(patched["other_thread_sees_it"].values()), f"per-thread state leaked: {patched}"
