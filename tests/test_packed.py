"""Linear layers packed once for CPU inference (models/packed.py): PyTorch's linear's outputs, a
copy that leaves the model alone, the plain product wherever the packed weight could be wrong or
cannot run, and `vitlab eval` / `predict` running the packed copy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitlab.config import ModelSection
from vitlab.eval.backends import prepare
from vitlab.eval.classification import evaluate
from vitlab.formats.vitlab import CheckpointMeta
from vitlab.models import cpu_kernels
from vitlab.models import packed as packing
from vitlab.models.packed import PackedLinear, pack_linear
from vitlab.models.registry import build_model, config_of
from vitlab.preprocessing import Preprocessing

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
)


@pytest.fixture
def pack_all(monkeypatch):
    """Every linear layer packed, however small (the tests' models are small)."""
    monkeypatch.setattr(packing, "PACK_BYTES", 0)


def randomized(name: str, **overrides) -> nn.Module:
    """A small model of `name` with every parameter drawn (heads start at zero, LayerNorms at 1)."""
    torch.manual_seed(0)
    model = build_model(config_of(ModelSection(name, overrides))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


def test_a_packed_layer_gives_pytorchs_linear() -> None:
    """Against F.linear on the original weights (a copy of them: the layer owns its own), for
    2-D, 3-D and strided inputs, with and without a bias, and on oneDNN's product (takes)."""
    torch.manual_seed(0)
    for bias in (True, False):
        layer = nn.Linear(48, 80, bias=bias)
        packed = PackedLinear(layer)
        assert packed.weight.data_ptr() != layer.weight.data_ptr()
        assert not packed.weight.requires_grad
        xs = [torch.randn(7, 48), torch.randn(3, 11, 48), torch.randn(3, 48, 11).transpose(1, 2),
              torch.randn(4, 20, 48)[:, ::3]]  # fmt: skip
        for x in xs:
            with torch.no_grad():
                assert packed.takes(x)
                got, want = packed(x), F.linear(x, layer.weight, layer.bias)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_where_the_packed_weight_cannot_serve_the_plain_product_runs() -> None:
    """Autograd (the input's gradient flows), bf16 autocast (bf16 out, as nn.Linear), the layer
    converted to float64 and back (.to() gives the weight new memory), and a weight changed in
    place after packing (its version moves): the weight as it is now is used."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    packed = PackedLinear(layer)
    x = torch.randn(5, 16, requires_grad=True)
    assert not packed.takes(x)
    packed(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(5, 16))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert not packed.takes(x) and packed(x).dtype == torch.bfloat16
    with torch.no_grad():
        packed.double()
        assert not packed.takes(x.double()) and packed(x.double()).dtype == torch.float64
        twin = copy.deepcopy(packed)  # a float64 copy (oneDNN packs float32 only): plain
        assert twin.packed is None and not twin.takes(x.double())
        torch.testing.assert_close(twin(x.double()), packed(x.double()))
        assert copy.deepcopy(PackedLinear(layer).to("meta")).packed is None
        packed.float()
        assert not packed.takes(x)
        torch.testing.assert_close(packed(x), layer(x))
        packed = PackedLinear(layer)
        assert packed.takes(x)
        packed.weight.mul_(2)  # in place: the packed copy is now stale
        assert not packed.takes(x)
        torch.testing.assert_close(packed(x), F.linear(x, 2 * layer.weight, layer.bias))


@pytest.mark.parametrize(
    ("name", "overrides", "shape"),
    [
        ("vit_nano_patch4_28", {"depth": 2}, (6, 1, 28, 28)),
        ("vit_nano_patch4_28", {"depth": 2, "distilled": True, "stem": "conv"}, (6, 1, 28, 28)),
        ("vit_nano_patch4_28", {"depth": 2, "class_token": False, "pool": "gap"},
         (6, 1, 28, 28)),
        ("swin_tiny_patch4_window7_224", {"depths": [1, 1], "num_heads": [2, 4], "embed_dim": 32,
                                          "img_size": 56, "num_classes": 5}, (2, 3, 56, 56)),
        ("resnet18_28", {"num_classes": 4}, (2, 1, 28, 28)),
    ],
)  # fmt: skip
def test_a_packed_copy_gives_the_models_outputs_and_leaves_it_alone(
    name, overrides, shape, pack_all, monkeypatch
) -> None:
    """The copy's logits are the model's to 1e-5 with every linear layer on oneDNN's product
    (counted), in eval mode throughout; the model keeps its layers and weights; an empty batch
    gives an empty output; a copy of the copy (deepcopy) packs its own and agrees."""
    model = randomized(name, **overrides)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    packed = pack_linear(model)
    assert packed is not model and not any(m.training for m in packed.modules())
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert linears and all(type(packed.get_submodule(n)) is PackedLinear for n in linears)
    assert all(type(model.get_submodule(n)) is nn.Linear for n in linears)  # the model: as it was
    took = []
    takes = PackedLinear.takes
    monkeypatch.setattr(
        PackedLinear, "takes", lambda self, x: took.append(takes(self, x)) or took[-1]
    )
    x = torch.randn(shape)
    with torch.no_grad():
        want, got = model(x), packed(x)
        assert packed(x[:0]).shape == (0, want.shape[1])
    assert took and all(took)  # every packed layer's call ran on the packed weight
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1  # real logits, not a zero head
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert packed.state_dict().keys() == model.state_dict().keys()  # the packed copies unsaved
    again = copy.deepcopy(packed)
    took.clear()
    with torch.no_grad():
        torch.testing.assert_close(again(x), want, rtol=1e-5, atol=1e-5)
    assert took and all(took)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no AVX2 CPU or no C compiler here")
def test_the_vit_keeps_its_shortcuts_on_packed_layers(pack_all) -> None:
    """The MLP's in-place GELU kernel and the last block's class-token rows (_first_rows) take a
    packed layer as they take nn.Linear (their outputs: the test above)."""
    packed = pack_linear(randomized("vit_nano_patch4_28", depth=2))
    x = torch.randn(4, 50, 64)
    with torch.no_grad():
        assert packed.blocks[0].mlp._on_kernel(x)
        assert packed.blocks[1].attn._splits(return_attention=False)


def test_packing_under_inference_mode_packs() -> None:
    """pack_linear called inside torch.inference_mode (as a caller of prepare may) still packs,
    and the packed layer runs there."""
    layers = nn.Sequential(nn.Linear(512, 512))
    with torch.inference_mode():
        packed = pack_linear(layers)
        x = torch.randn(3, 512)
        assert type(packed[0]) is PackedLinear and packed[0].takes(x)
        torch.testing.assert_close(packed(x), layers(x), rtol=1e-5, atol=1e-5)


def test_only_large_weights_are_packed() -> None:
    """Below PACK_BYTES (a megabyte of float32 weight) a layer stays PyTorch's linear: a small
    ViT comes back itself; a 512 x 512 layer is packed, a 511 x 512 one is not."""
    model = randomized("vit_nano_patch4_28", depth=1)
    assert pack_linear(model) is model
    layers = pack_linear(nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 511)))
    assert [type(m) for m in layers] == [PackedLinear, nn.Linear]


def test_what_cannot_be_packed_is_left_as_it_is(monkeypatch, pack_all) -> None:
    """A layer with a hook of its own stays an nn.Linear (its hook still runs); a model with no
    float32 CPU linear layer, or a PyTorch without oneDNN, comes back itself."""
    model = randomized("vit_nano_patch4_28", depth=1)
    seen = []
    model.blocks[0].mlp.fc2.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    packed = pack_linear(model)
    assert type(packed.blocks[0].mlp.fc2) is nn.Linear
    assert type(packed.blocks[0].mlp.fc1) is PackedLinear
    with torch.no_grad():
        packed(torch.randn(2, 1, 28, 28))
    assert seen == [(2, 50, 64)]
    assert pack_linear(model.double()) is model
    convs = nn.Sequential(nn.Conv2d(1, 2, 3))
    assert pack_linear(convs) is convs  # nothing to pack: itself
    with torch.backends.mkldnn.flags(enabled=False):  # switched off by the user
        assert pack_linear(model) is model
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    model = randomized("vit_nano_patch4_28", depth=1)
    assert pack_linear(model) is model


def test_eval_runs_the_packed_copy(pack_all) -> None:
    """prepare(backend torch) runs a packed copy on the CPU (not with --int8), and evaluate
    reports the model's own accuracy and loss from it."""
    model = randomized("vit_nano_patch4_28", depth=2)
    meta = CheckpointMeta(
        model.config, Preprocessing((28, 28), 1, (0.5,), (0.5,)), list("abcdefghij")
    )
    runner = prepare(model, meta, "torch")
    assert isinstance(runner.blocks[0].attn.qkv, PackedLinear)
    assert not any(isinstance(m, PackedLinear) for m in prepare(model, meta, int8=True).modules())
    x, y = torch.randn(32, 1, 28, 28), torch.arange(32) % 10
    got = evaluate(runner, [(x, y)], 10, torch.device("cpu"))
    want = evaluate(model, [(x, y)], 10, torch.device("cpu"))
    assert got["top1"] == want["top1"] and got["loss"] == pytest.approx(want["loss"], rel=1e-5)
