"""Threads calling real compiled functions whose eval-frame values differ (the default and an
``isolate_recompiles=True`` region), some nested in others through a ``torch._dynamo.disable``d
call, each checking the C-global value from inside its call (``torch._C._dynamo.eval_frame``).

Run as a script in a fresh interpreter by ``test_eval_frame_gate.py``; prints one JSON line:
``calls``, ``nested`` (nested compiled calls), ``violations`` (checks that saw another call's
value), ``stuck`` (threads still alive after the run: a deadlock), ``first`` (examples).

    python eval_frame_probe.py SECONDS
"""

import json
import random
import sys
import threading
import time
import types

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_isolate_recompiles_id

violations, calls, nested_calls = [], [0], [0]
local = threading.local()


def probe(expected: int) -> None:
    calls[0] += 1
    time.sleep(local.rng.random() * 2e-4)  # hold the call open while other threads enter and leave
    seen = get_eval_frame_isolate_recompiles_id()
    if seen != expected:
        violations.append((expected, seen))


@torch._dynamo.disable
def maybe_nested(x, depth: int) -> None:
    if depth < 2 and local.rng.random() < 0.3:
        nested_calls[0] += 1
        f = local.rng.choice(FUNCTIONS)
        f(x, IDS[f], depth + 1)


def body(x, expected: int, depth: int):
    y = x + 1
    probe(expected)
    maybe_nested(x, depth)
    probe(expected)  # back in this call after a nested one: its own value again
    return y * 2


def compiled(index: int, **kwargs):
    code = body.__code__.replace(co_name=f"body_{index}")
    return torch.compile(types.FunctionType(code, body.__globals__, code.co_name), backend="eager", **kwargs)


FUNCTIONS = [compiled(0), compiled(1, isolate_recompiles=True)]
IDS = {f: getattr(f, "_isolate_recompiles_id", -1) for f in FUNCTIONS}


def main(seconds: float) -> dict:
    local.rng = random.Random(0)
    x = torch.ones(3)
    for f in FUNCTIONS:  # compile every (function, depth) first: the race is on warm calls
        for depth in range(3):
            f(x, IDS[f], depth)
    violations.clear()
    calls[0] = nested_calls[0] = 0
    deadline = time.monotonic() + seconds

    def run(seed: int) -> None:
        local.rng = random.Random(seed)
        while time.monotonic() < deadline:
            f = FUNCTIONS[0] if local.rng.random() < 0.8 else FUNCTIONS[1]  # mostly the common value
            f(x, IDS[f], 0)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 60)
    return {
        "calls": calls[0],
        "nested": nested_calls[0],
        "violations": len(violations),
        "stuck": sum(t.is_alive() for t in threads),
        "first": violations[:2],
    }


if __name__ == "__main__":
    print(json.dumps(main(float(sys.argv[1]))), flush=True)
    sys.stdout.flush()
    # Daemon threads stuck in a deadlock must not keep the interpreter alive.
    import os

    os._exit(0)
