"""The catalog against published parameter counts; the compute model by hand."""

from __future__ import annotations

import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.workloads.catalog import Layer, ModelSpec, model_spec
from gradfabric.workloads.compute import DeviceProfile, timeline

# Published totals: torchvision / the original papers / Hugging Face model cards.
PUBLISHED = {
    "resnet50": 25_557_032,  # "25.6M"
    "resnet152": 60_192_808,  # "60.2M"
    "vgg16": 138_357_544,  # "138M"
    "vgg19": 143_667_240,  # "144M"
    "bert-base": 109_482_240,  # "110M"
    "bert-large": 335_141_888,  # "340M" (335M with the pooler)
    "gpt2": 124_439_808,  # "124M"
    "gpt2-xl": 1_557_611_200,  # "1.5B"
}


@pytest.mark.parametrize("name, params", sorted(PUBLISHED.items()))
def test_parameter_counts_match_published(name: str, params: int) -> None:
    assert model_spec(name).params == params


def test_flops_match_published_order() -> None:
    # ResNet-50: 4.1 GMACs per 224x224 image; VGG-16: 15.5 GMACs.
    assert model_spec("resnet50").fwd_flops == pytest.approx(2 * 4.1e9, rel=0.03)
    assert model_spec("vgg16").fwd_flops == pytest.approx(2 * 15.5e9, rel=0.02)


def test_embedding_heavy_models_are_embedding_heavy() -> None:
    # NCF is almost all embedding tables; the LSTM LM's input embedding is a third.
    for name, share in (("ncf", 0.99), ("lstm", 0.35)):
        spec = model_spec(name)
        emb = sum(x.params for x in spec.layers if x.fwd_flops == 0)
        assert emb / spec.params > share, name


def test_unknown_model_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match="resnet50"):
        model_spec("alexnet")


def test_timeline_by_hand() -> None:
    # 1 TFLOP/s effective; three layers, gradients bucketed 1 MiB first then 2 MiB.
    layers = (
        Layer("a", 300_000, 1_000_000, 0),
        Layer("b", 200_000, 2_000_000, 0),
        Layer("c", 100_000, 3_000_000, 0),
    )
    spec = ModelSpec("toy", layers)
    dev = DeviceProfile("toy", 1.0, 1.0)
    tl = timeline(spec, batch=2, dev=dev, bucket_mb=2.0, first_bucket_mb=1.0)
    assert tl.forward_ns == 2 * 6_000_000 // 1000  # 12 us
    # backward in reverse: c (12 us), b (8 us), a (4 us); 2 FLOPs/FLOP of forward
    assert tl.backward_ns == 24_000
    cap1 = 2**20 // 4  # 262144 values
    assert cap1 > 100_000 and cap1 < 300_000
    # c alone (100k) is under the 1 MiB cap; c+b = 300k reaches it at t = 12+12+8 us
    assert [(b.ready_ns, b.values) for b in tl.buckets] == [(32_000, 300_000), (36_000, 300_000)]
    flat = timeline(spec, 2, dev, 2.0, 1.0, overlap=False)
    assert {b.ready_ns for b in flat.buckets} == {36_000}
