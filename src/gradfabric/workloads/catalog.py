"""Per-layer parameters and FLOPs of real models, derived from their definitions.

Each model in ``models.BUILDERS`` is built on the meta device and run forward
once on a one-sample input; hooks on the leaf modules record, in execution
order, each layer's parameter count, forward FLOPs (multiply-add = 2 FLOPs)
and output activation size. Backward FLOPs are taken as 2x forward (the
gradients with respect to inputs and to weights each cost one forward's worth
of multiply-adds), the usual rule for dense layers.

FLOP rules: Conv2d ``2 * Cin/groups * kh * kw * Cout * Hout * Wout``; Linear
``2 * in * out`` per row; multi-head attention projections plus ``4 * L^2 * E``
for scores and weighted sum; LSTM ``8 * H * (I + H)`` per step and layer;
normalisation ``5`` per element; embeddings are lookups (0).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

from gradfabric.core.errors import ConfigError

MODEL_NAMES = (
    "resnet50",
    "resnet152",
    "vgg16",
    "vgg19",
    "bert-base",
    "bert-large",
    "gpt2",
    "gpt2-xl",
    "lstm",
    "ncf",
    "mlp",
)


# One training sample as stored in its dataset (what a worker reads and
# decodes before computing on it): an ImageNet JPEG averages ~110 KB; a
# tokenised sequence is its token ids (int32); a click record a few ids; an
# MNIST-like row 784 floats.
STORED_SAMPLE_BYTES: dict[str, int] = {
    "resnet50": 110_000,
    "resnet152": 110_000,
    "vgg16": 110_000,
    "vgg19": 110_000,
    "bert-base": 512 * 4,
    "bert-large": 512 * 4,
    "gpt2": 1024 * 4,
    "gpt2-xl": 1024 * 4,
    "lstm": 35 * 4,
    "ncf": 3 * 4,
    "mlp": 784 * 4,
}


def batch_load_ns(model: str, batch: int, load_gbps: float, sample_bytes: int = 0) -> int:
    """How long a host takes to read and decode ``batch`` stored samples of
    ``model`` at ``load_gbps`` (``sample_bytes``: one sample's, where the
    catalog has none): what an SA-ATP helper pays before it computes."""
    return round(batch * (sample_bytes or STORED_SAMPLE_BYTES.get(model, 0)) * 8 / load_gbps)


@dataclass(frozen=True)
class Layer:
    name: str
    params: int
    fwd_flops: int
    activation_bytes: int

    @property
    def bwd_flops(self) -> int:
        return 2 * self.fwd_flops


@dataclass(frozen=True)
class ModelSpec:
    """A model as the simulator and planner see it (per sample)."""

    name: str
    layers: tuple[Layer, ...]

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def fwd_flops(self) -> int:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def grad_bytes(self) -> int:
        return 4 * self.params

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "layers": [asdict(x) for x in self.layers]})


def _flops(mod: Any, inp: tuple[Any, ...], out: Any) -> int:
    from torch import nn

    x: Any = inp[0] if inp else None
    y: Any = out[0] if isinstance(out, tuple) else out
    if isinstance(mod, nn.Conv2d):
        kh, kw = mod.kernel_size
        per_out = 2 * (mod.in_channels // mod.groups) * kh * kw
        return int(per_out * y.numel() + (y.numel() if mod.bias is not None else 0))
    if isinstance(mod, nn.Linear):
        rows = x.numel() // mod.in_features
        return int(2 * mod.in_features * mod.out_features * rows)
    if isinstance(mod, nn.MultiheadAttention):
        seq, emb = x.shape[-2], x.shape[-1]
        proj = 2 * seq * emb * 4 * emb  # q, k, v and output projections
        return int(proj + 4 * seq * seq * emb)
    if isinstance(mod, nn.LSTM):
        steps = x.shape[1] if mod.batch_first else x.shape[0]
        h, i, total = mod.hidden_size, mod.input_size, 0
        for layer in range(mod.num_layers):
            total += 8 * h * ((i if layer == 0 else h) + h) * steps
        return int(total)
    if isinstance(mod, (nn.BatchNorm2d, nn.LayerNorm)):
        return int(5 * y.numel())
    return 0


def is_user_model(name: str) -> bool:
    """``package.module:callable``: a user's own model (``user_builder``)."""
    return ":" in name


def check_model(name: str, field: str = "model") -> None:
    if is_user_model(name):
        mod, _, fn = name.partition(":")
        if not mod or not fn.isidentifier():
            raise ConfigError(field, f"{name!r}: want package.module:callable")
        return
    if name not in MODEL_NAMES:
        raise ConfigError(
            field, f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}, "
            "or a module:callable of your own",
        )  # fmt: skip


def user_builder(name: str) -> Any:
    """The callable ``package.module:callable`` names, imported (the current
    directory first, as ``python -m`` would find it). It takes no argument
    and returns ``(model, inputs)``: an ``nn.Module`` and a tuple of example
    inputs for one sample, as ``workloads.models.BUILDERS`` do; the model is
    built under ``torch.device("meta")`` so a billion parameters cost nothing."""
    import importlib
    import sys

    mod, _, fn = name.partition(":")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError("model", f"{name!r}: {e}") from None


@cache
def model_spec(name: str) -> ModelSpec:
    """Per-layer spec of a catalog model or a user's ``module:callable``;
    raises ``ConfigError`` for unknown names."""
    check_model(name)
    import torch
    from torch import nn

    from gradfabric.workloads.models import BUILDERS

    build = user_builder(name) if is_user_model(name) else BUILDERS[name]
    try:
        with torch.device("meta"):
            built = build()
    except TypeError as e:  # not a builder that takes no argument
        raise ConfigError("model", f"{name}: {e}") from None
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
        raise ConfigError("model", f"{name}: return (nn.Module, example inputs for one sample)")
    model, inputs = built
    inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    leaf_types = (
        nn.Conv2d,
        nn.Linear,
        nn.BatchNorm2d,
        nn.LayerNorm,
        nn.Embedding,
        nn.MultiheadAttention,
        nn.LSTM,
    )
    records: list[Layer] = []
    seen: set[int] = set()
    hooks = []

    def hook(mname: str) -> Any:
        def fn(mod: nn.Module, inp: tuple[Any, ...], out: Any) -> None:
            # Count each parameter once, at its first use (tied weights, reused modules).
            fresh = [p for p in mod.parameters() if id(p) not in seen]
            seen.update(id(p) for p in fresh)
            params = sum(p.numel() for p in fresh)
            y = out[0] if isinstance(out, tuple) else out
            records.append(Layer(mname, int(params), _flops(mod, inp, out), 4 * int(y.numel())))

        return fn

    inside_mha: set[str] = {
        n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)
    }
    for mname, mod in model.named_modules():
        if isinstance(mod, leaf_types) and not any(mname.startswith(p + ".") for p in inside_mha):
            hooks.append(mod.register_forward_hook(hook(mname)))
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    counted = sum(r.params for r in records)
    total = sum(p.numel() for p in model.parameters())
    if counted != total:  # a parameter held outside any hooked leaf: keep the books honest
        records.append(Layer("other", int(total - counted), 0, 0))
    return ModelSpec(name, tuple(records))
