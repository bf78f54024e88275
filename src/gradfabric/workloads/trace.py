"""A training step from a PyTorch execution trace (what Chakra converts from).

``torch.profiler.ExecutionTraceObserver`` records every operator of a step
with its inputs' shapes, in the order they ran (node ids). What the simulator
needs from it:

* compute: the FLOPs of the matrix products and convolutions (``aten::mm``,
  ``addmm``, ``bmm``, ``baddbmm``: ``2 M K N`` per product; ``convolution``
  and its backward: ``2 Cin/groups kh kw`` per output element, once for each
  gradient the backward computes); not counted, unlike the catalog: fused
  attention kernels (``scaled_dot_product_attention``), recurrent layers
  and norms, so a trace of a model made of them counts less compute than
  its catalog profile;
* the gradients: each ``torch::autograd::AccumulateGrad`` is one parameter's
  gradient, ready once the operators before it have run;
* forward is everything before the first backward operator
  (``autograd::engine::evaluate_function``).

Times are FLOPs at the device's rate (``workloads.compute``); buckets are
DDP's (the first 1 MiB, then ``bucket_mb``). The trace's own batch is the
step's: a trace is one recorded step, not a model to scale.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gradfabric.core.errors import ConfigError
from gradfabric.workloads.compute import DeviceProfile, GradBucket, Timeline

MATMULS = {"aten::mm": 0, "aten::addmm": 1, "aten::bmm": 0, "aten::baddbmm": 1}


def is_trace(name: str) -> bool:
    return name.endswith(".json")


def _flops(node: dict[str, Any]) -> int:
    name, shapes = node["name"], node.get("inputs", {}).get("shapes", [])
    if name in MATMULS:
        a, b = shapes[MATMULS[name]], shapes[MATMULS[name] + 1]
        if len(a) < 2 or len(b) < 2:
            return 0
        batch = math.prod(a[:-2]) if len(a) > 2 else 1
        return int(2 * batch * a[-2] * a[-1] * b[-1])
    if name == "aten::convolution" and len(shapes) >= 2:
        w, out = shapes[1], node.get("outputs", {}).get("shapes", [[]])[0]
        return int(2 * w[1] * math.prod(w[2:]) * math.prod(out))  # w: [Cout, Cin/groups, kh, kw]
    if name == "aten::convolution_backward" and len(shapes) >= 3:
        grad_out, w = shapes[0], shapes[2]
        mask = node["inputs"]["values"][-1]  # output_mask: grad_input, grad_weight, grad_bias
        grads = sum(bool(m) for m in mask[:2]) if isinstance(mask, list) else 2
        return int(grads * 2 * w[1] * math.prod(w[2:]) * math.prod(grad_out))
    return 0


def trace_timeline(path: str, dev: DeviceProfile, bucket_mb: float = 25.0) -> Timeline:
    """The step ``path`` records, as the simulator's timeline (module doc)."""
    try:
        nodes = json.loads(Path(path).read_text())["nodes"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("model", f"{path}: not an execution trace ({e})") from None
    nodes = sorted(nodes, key=lambda n: n["id"])  # ids follow the order operators began
    flops, fwd_flops, in_backward = 0, 0, False
    grads: list[tuple[int, int]] = []  # (FLOPs done when ready, values)
    for n in nodes:
        name = n.get("name", "")
        if not in_backward and name.startswith("autograd::engine::evaluate_function"):
            in_backward, fwd_flops = True, flops
        flops += _flops(n)
        if name == "torch::autograd::AccumulateGrad":
            shape = n.get("inputs", {}).get("shapes", [[]])[0]
            grads.append((flops, math.prod(shape)))
    if not grads:
        raise ConfigError("model", f"{path}: no gradient in the trace (record a backward pass)")
    buckets: list[GradBucket] = []
    cap, pending = 2**20 // 4, 0
    for done, values in grads:
        pending += values
        if pending >= cap:
            buckets.append(GradBucket(dev.time_ns(done), pending))
            pending, cap = 0, int(bucket_mb * 2**20) // 4
    if pending:
        buckets.append(GradBucket(dev.time_ns(grads[-1][0]), pending))
    fwd = dev.time_ns(fwd_flops)
    return Timeline(fwd, max(dev.time_ns(flops), buckets[-1].ready_ns) - fwd, tuple(buckets))
