"""The preprocessing that travels with weights gives the inputs the reference libraries give:
timm's evaluation transform (resize to size / crop_pct keeping the aspect ratio, centre crop) for
weights with a crop_pct, transformers' ViTImageProcessor (the whole image resized) for weights
without, on real-size images of several shapes, the model's own size included; and the crops each
library states as it applies them (transformers' DeiT processors, timm's squash and border modes,
torchvision's weight enums), read from the library's files and written back by vitlab."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from vitlab.formats.base import CheckpointError
from vitlab.preprocessing import HALF, IMAGENET_MEAN, IMAGENET_STD, Preprocessing, crop_pct_for

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

# (H, W) of the test images: the model's own size, landscape, portrait, smaller than the model
SHAPES = [(224, 224), (300, 400), (500, 333), (97, 131)]
# a pixel level after normalisation is 1 / 255 / std >= 0.017: anything below 1e-5 is float
# rounding of identical pixels
SAME = 1e-5


def photo(shape: tuple[int, int], seed: int = 0) -> Image.Image:
    """A smooth image with noise (resamplers differ most on edges; this has both)."""
    h, w = shape
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx / w, yy / h, (xx + yy) / (h + w)], -1) * 200
    pixels = base + rng.normal(0, 25, (h, w, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def timm_eval(pre: Preprocessing):
    from timm.data import create_transform, resolve_data_config

    cfg = resolve_data_config(
        {
            "input_size": (pre.in_chans, *pre.img_size),
            "interpolation": pre.interpolation,
            "mean": pre.mean,
            "std": pre.std,
            "crop_pct": pre.crop_pct,
            "crop_mode": pre.crop_mode,
        }
    )
    return create_transform(**cfg)


CROPS = [
    ((224, 224), 0.9, "bicubic"),
    ((224, 224), 0.875, "bilinear"),
    ((160, 224), 0.9, "bicubic"),
    ((224, 224), 0.9, "nearest"),
]


@pytest.mark.parametrize("img_size,crop_pct,interpolation", CROPS)
@pytest.mark.parametrize("shape", SHAPES)
def test_crop_pct_matches_timms_eval_transform(
    shape: tuple[int, int], img_size: tuple[int, int], crop_pct: float, interpolation: str
) -> None:
    """Exact (same pixels): an image already at the model's size is still resized to
    size / crop_pct and centre-cropped, as timm does."""
    pre = Preprocessing(img_size, 3, IMAGENET_MEAN, IMAGENET_STD, interpolation, crop_pct)
    image = photo(shape)
    want = timm_eval(pre)(image)
    got = pre.pil(image)
    assert got.shape == want.shape == (3, *img_size)
    assert (got - want).abs().max().item() <= SAME


@pytest.mark.parametrize("interpolation", ["bicubic", "nearest"])
@pytest.mark.parametrize("shape", SHAPES)
def test_crop_pct_on_uint8_batches_follows_timm(shape: tuple[int, int], interpolation) -> None:
    """Batches (evaluation loaders) resize uint8 tensors with torchvision, whose resampler rounds
    differently from PIL's: the same geometry, within a grey level on average (nearest: the same
    pixels, but at exact ties of a pixel centre, which the two scales' float rounding break apart:
    1% of the pixels of 224 -> 248, where the legacy NEAREST's shifted grid gave 99%)."""
    pre = Preprocessing((224, 224), 3, IMAGENET_MEAN, IMAGENET_STD, interpolation, 0.9)
    image = photo(shape)
    want = timm_eval(pre)(image)
    got = pre.batch(TF.pil_to_tensor(image)[None])[0]
    levels = (got - want) * torch.tensor(pre.std)[:, None, None] * 255
    if interpolation == "nearest":
        assert (levels.abs() > 1e-3).float().mean().item() < 0.02
    else:
        assert levels.abs().mean().item() < 0.1


@pytest.mark.parametrize("crop_mode", ["squash", "border"])
@pytest.mark.parametrize("shape", SHAPES)
def test_squash_and_border_on_uint8_batches_follow_timm(shape, crop_mode: str) -> None:
    """The same for timm's other crop modes: squashing 500 x 333 to 248 x 248 rounds apart
    most (a quarter of a level on average), a pixel's shift would be tens of levels."""
    pre = Preprocessing((224, 224), 3, IMAGENET_MEAN, IMAGENET_STD, "bicubic", 0.9, crop_mode)
    image = photo(shape)
    want = timm_eval(pre)(image)
    got = pre.batch(TF.pil_to_tensor(image)[None])[0]
    levels = (got - want) * torch.tensor(pre.std)[:, None, None] * 255
    assert levels.abs().mean().item() < 0.5 and levels.abs().max().item() <= 3.01


@pytest.mark.parametrize(  # nearest: pixel centres, as PIL (vitlab's took torchvision's legacy
    "resample,interpolation", [(0, "nearest"), (2, "bilinear"), (3, "bicubic")]
)  # NEAREST: 99% of pixels off, by up to 215 levels)
@pytest.mark.parametrize("shape", [*SHAPES, (32, 32)])
def test_whole_image_resize_matches_transformers_vit_image_processor(
    shape: tuple[int, int], resample: int, interpolation: str
) -> None:
    """Exact (same pixels) against transformers' ViTImageProcessor, which resizes the whole
    image as a uint8 tensor with torchvision."""
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    processor = transformers.ViTImageProcessor(
        size={"height": 224, "width": 224}, resample=resample, image_mean=mean, image_std=std
    )
    pre = Preprocessing((224, 224), 3, mean, std, interpolation, crop_pct=None)
    image = photo(shape)
    want = processor(image, return_tensors="pt")["pixel_values"][0]
    got = pre.pil(image)
    assert got.shape == want.shape == (3, 224, 224)
    assert (got - want).abs().max().item() <= SAME


@pytest.mark.parametrize("workers", [0, 1])
def test_evaluation_loaders_crop_once_as_timm_does(tmp_path, workers: int) -> None:
    """`vitlab eval` of weights with a crop_pct: the loader's batches (in memory and from an
    image folder) are timm's eval transform of each image, cropped once (the loader once
    resized per image and then again per batch: an effective crop of 0.81)."""
    from vitlab.data.datasets import ArraySplit, load_split
    from vitlab.data.loader import make_loader

    pre = Preprocessing((224, 224), 3, IMAGENET_MEAN, IMAGENET_STD, "bicubic", 0.9)
    image = photo((300, 400))
    want = timm_eval(pre)(image)
    pixels = TF.pil_to_tensor(image)[None]
    if workers == 0:
        split = ArraySplit(pixels.repeat(2, 1, 1, 1), torch.tensor([0, 1]), ["a", "b"])
    else:
        for name in "ab":
            (tmp_path / name).mkdir()
            for i in range(4):
                image.save(tmp_path / name / f"{i}.png")
        split = load_split(f"imagefolder:{tmp_path}", "test")
    (x, _), *_ = list(make_loader(split, 2, pre, workers=workers))
    for got in x:
        levels = (got - want) * torch.tensor(pre.std)[:, None, None] * 255
        assert levels.abs().mean().item() < 0.1


# --- the crops each library states: transformers' DeiT processors, timm's squash and border,
# torchvision's weight enums, and vitlab's writers giving them back -------------------------------

# random uint8 images of odd sizes, both orientations, the model's own size: (300, 402) puts the
# long side at 343 after a shorter side of 256, an odd 119 pixels to crop, where transformers'
# offset (rounded down) and torchvision's (rounded to even) differ by one
ODD = [(224, 224), (300, 402), (402, 300), (97, 131), (333, 500)]


def noise(shape: tuple[int, int], seed: int = 1) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_folder(path, processor, image_size: int = 224):
    """A tiny ViTForImageClassification saved with `processor`: a hub folder."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=image_size, patch_size=16, hidden_size=48, num_hidden_layers=1,
        num_attention_heads=3, intermediate_size=96, num_labels=4,
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config).eval()
    model.save_pretrained(path)
    if isinstance(processor, dict):  # an older hub file, written by hand
        (path / "preprocessor_config.json").write_text(json.dumps(processor))
    else:
        processor.save_pretrained(path)
    return model


def same_pixels(pre: Preprocessing, image: Image.Image, want: torch.Tensor) -> None:
    got = pre.pil(image)
    assert got.shape == want.shape == (pre.in_chans, *pre.img_size)
    assert (got - want).abs().max().item() <= SAME


DEIT_LIKE = {  # transformers' DeiT processors: squash to 256 x 256 or shorter side to 256; crop 224
    "height_width": lambda: transformers.DeiTImageProcessor(
        size={"height": 256, "width": 256},
        crop_size={"height": 224, "width": 224},
        resample=3,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
    ),  # fmt: skip
    "shortest_edge": lambda: transformers.DeiTImageProcessor(
        size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, resample=2
    ),
    "legacy_int": lambda: {  # facebook/deit-*'s DeiTFeatureExtractor file: one-number sizes
        "feature_extractor_type": "DeiTFeatureExtractor",
        "size": 256,
        "crop_size": 224,
        "do_center_crop": True,
        "do_resize": True,
        "do_normalize": True,
        "resample": 3,
        "image_mean": list(IMAGENET_MEAN),
        "image_std": list(IMAGENET_STD),
    },  # fmt: skip
    "no_normalize": lambda: transformers.ViTImageProcessor(
        size={"height": 224, "width": 224}, do_normalize=False
    ),
    "rescale_half": lambda: transformers.ViTImageProcessor(
        size={"height": 224, "width": 224}, rescale_factor=0.5 / 255, image_mean=[0.2] * 3
    ),
}


@pytest.mark.parametrize("kind", DEIT_LIKE)
def test_hugging_face_processors_with_a_crop_give_transformers_pixels(tmp_path, kind) -> None:
    """A folder whose preprocessor_config.json resizes then centre-crops (DeiT), or scales
    otherwise, reads as preprocessing giving transformers' pixels exactly, from PIL images
    (predict) and uint8 batches (eval) alike."""
    from vitlab import load_checkpoint

    hf_folder(tmp_path, DEIT_LIKE[kind]())
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    _, meta = load_checkpoint(tmp_path)
    pre = meta.preprocessing
    for shape in ODD:
        image = noise(shape)
        want = processor(image, return_tensors="pt")["pixel_values"][0]
        same_pixels(pre, image, want)
        got = pre.batch(TF.pil_to_tensor(image)[None])[0]
        assert (got - want).abs().max().item() <= SAME


def test_predict_on_a_deit_style_folder_matches_transformers(tmp_path, capsys) -> None:
    from vitlab.cli.main import main

    ref = hf_folder(tmp_path / "m", DEIT_LIKE["shortest_edge"]())
    noise((300, 402)).save(tmp_path / "x.png")
    assert main(["predict", str(tmp_path / "m"), str(tmp_path / "x.png"), "--json"]) == 0
    ours = {t["class"]: t["probability"] for t in json.loads(capsys.readouterr().out)[0]["top"]}
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "m")
    pixels = processor(Image.open(tmp_path / "x.png"), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        probs = ref(pixel_values=pixels).logits.softmax(-1)[0]
    for i, p in enumerate(probs.tolist()):
        assert abs(ours[ref.config.id2label[i]] - p) <= 1e-5


TIMM_CROPS = [("squash", 0.95), ("squash", 1.0), ("border", 0.9), ("border", 1.0), ("center", 0.9)]


@pytest.mark.parametrize("crop_mode,crop_pct", TIMM_CROPS)
def test_timm_folders_crop_modes_give_timms_pixels(tmp_path, crop_mode: str, crop_pct) -> None:
    """timm's pretrained_cfg with crop_mode squash (vit_medium_patch16_gap_384.sw_in12k_ft_in1k,
    the *_clip_*_384 at 0.95, most CLIP-like weights at 1.0) or border: timm's eval transform."""
    from timm.data import create_transform, resolve_data_config
    from timm.models import save_for_hf

    from vitlab import load_checkpoint

    overlay = dict(crop_pct=crop_pct, crop_mode=crop_mode, interpolation="bicubic",
                   mean=(0.4, 0.5, 0.6), input_size=(3, 224, 224))  # fmt: skip
    ref = timm.create_model(
        "vit_tiny_patch16_224", depth=1, num_classes=3, pretrained_cfg_overlay=overlay
    )
    save_for_hf(ref, tmp_path, safe_serialization=True)
    transform = create_transform(**resolve_data_config(model=ref))
    _, meta = load_checkpoint(tmp_path)
    for shape in ODD:
        image = noise(shape)
        same_pixels(meta.preprocessing, image, transform(image))
    assert meta.preprocessing.crop_mode == crop_mode


@pytest.mark.parametrize("crop_mode,crop_pct", TIMM_CROPS)
@pytest.mark.parametrize("img_size", [(224, 224), (160, 224)])
def test_crop_modes_match_timm_eval_transform(img_size, crop_mode: str, crop_pct) -> None:
    pre = Preprocessing(img_size, 3, IMAGENET_MEAN, IMAGENET_STD, "bilinear", crop_pct, crop_mode,
                        reference="timm")  # fmt: skip
    for shape in ODD:
        image = noise(shape)
        same_pixels(pre, image, timm_eval(pre)(image))


def test_crop_pct_for_gives_back_the_stated_resize() -> None:
    """Libraries that state a resize and a crop (transformers' processors, torchvision's enums)
    are read as a crop_pct from which timm's floor(crop / crop_pct) is that resize again."""
    for crop in range(1, 600):
        for resize in range(crop, 2 * crop + 2):
            pct = crop_pct_for(crop, resize)
            assert math.floor(crop / pct) == resize and abs(pct - crop / resize) < 1e-12


def tv_weights():
    from torchvision.models import get_model_weights

    arches = ["vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14"]
    return [(a, w) for a in arches for w in get_model_weights(a)]


@pytest.mark.parametrize("arch,weights", tv_weights(), ids=lambda v: getattr(v, "name", v))
def test_torchvision_vit_state_dicts_get_their_weight_enums_transform(arch, weights) -> None:
    """Each of torchvision's ViT weights, told by its state dict's shapes (width, depth, patch,
    position table): its transforms()' pixels; B/16 and L/16 at 224 (V1 or SWAG_LINEAR) read as
    V1, with a note naming the other and how to set it."""
    import torchvision.models as tvm

    from vitlab.formats.torchvision import weights_preprocessing

    meta = weights.meta
    with torch.device("meta"):  # the shapes only
        ref = getattr(tvm, arch)(weights=None, image_size=meta["min_size"][0])
    state = {k.replace("encoder.layers.encoder_layer_", "blocks."): v  # the keys it counts
             for k, v in ref.state_dict().items()}  # fmt: skip
    state["patch_embed.proj.weight"] = state.pop("conv_proj.weight")
    state["pos_embed.weight"] = state.pop("encoder.pos_embedding")
    notes: list[str] = []
    pre = Preprocessing(meta["min_size"], 3, **weights_preprocessing(state, notes))
    rivals = [w for a, w in tv_weights() if a == arch and w.meta["min_size"] == meta["min_size"]]
    assert len(notes) == (len(rivals) > 1)  # said where the shapes leave a choice
    if weights.name != "IMAGENET1K_V1" and len(rivals) > 1:  # the note says how to get it
        assert weights.name in notes[0]
        pct, mode = re.search(rf"{weights.name}.*crop_pct=(\S+), interpolation='(\w+)'",
                              notes[0]).groups()  # fmt: skip
        pre = dataclasses.replace(pre, crop_pct=float(pct), interpolation=mode)
    transform = weights.transforms()
    for shape in [(300, 402), (402, 300)]:
        image = noise(shape)
        same_pixels(pre, image, transform(image))


def test_a_torchvision_vit_at_384_reads_as_swag_e2e(tmp_path) -> None:
    """A state dict at 384 with 16-pixel patches (any width): only ViT_B_16's SWAG_E2E_V1
    weights are at 384, so its transform (resize 384, crop 384, bicubic)."""
    from torchvision.models import ViT_B_16_Weights
    from torchvision.models.vision_transformer import VisionTransformer

    from vitlab import load_checkpoint

    ref = VisionTransformer(image_size=384, patch_size=16, num_layers=1, num_heads=2,
                            hidden_dim=32, mlp_dim=64, num_classes=5)  # fmt: skip
    torch.save(ref.state_dict(), tmp_path / "tv384.pth")
    _, meta = load_checkpoint(tmp_path / "tv384.pth", num_heads=2)
    transform = ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1.transforms()
    for shape in ODD:
        image = noise(shape)
        same_pixels(meta.preprocessing, image, transform(image))
    assert any("IMAGENET1K_SWAG_E2E_V1" in n for n in meta.info["notes"])


ROUND_TRIPS = [("squash", "transformers"), ("center", "transformers"), ("squash", "timm"),
               ("center", "timm"), ("border", "timm")]  # fmt: skip


@pytest.mark.parametrize("crop_mode,reference", ROUND_TRIPS)
@pytest.mark.parametrize("fmt", ["hf", "timm"])
def test_writers_keep_the_crop_for_the_library_and_for_vitlab(
    tmp_path, fmt: str, crop_mode: str, reference: str
) -> None:
    """vitlab's timm and Hugging Face writers state the crop: the library reads the same
    transform (exactly, where it is the library's own), and vitlab reads back the same pixels.
    transformers cannot pad (border): refused."""
    from timm.data import create_transform, resolve_data_config

    from vitlab import create_model, load_checkpoint, save_pretrained

    model = create_model("vit_micro_patch4_32", num_classes=3)
    pre = Preprocessing((32, 32), 3, (0.3, 0.4, 0.5), (0.2, 0.25, 0.3), "bicubic", 0.9, crop_mode,
                        reference)  # fmt: skip
    model.preprocessing = pre
    if fmt == "hf" and crop_mode == "border":
        with pytest.raises(CheckpointError, match="cannot pad"):
            save_pretrained(model, tmp_path / "out", fmt)
        return
    save_pretrained(model, tmp_path / "out", fmt)
    if fmt == "hf":
        library = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out")

        def reference_pixels(image):
            return library(image, return_tensors="pt")["pixel_values"][0]
    else:
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        reference_pixels = create_transform(
            **resolve_data_config(pretrained_cfg=config["pretrained_cfg"])
        )
    _, meta = load_checkpoint(tmp_path / "out")
    back = meta.preprocessing
    assert back.crop_mode == crop_mode and math.isclose(back.crop_pct, 0.9, rel_tol=0.05)
    own = reference == {"hf": "transformers", "timm": "timm"}[fmt]
    assert back == pre or not (own and fmt == "timm")  # timm's config holds crop_pct as it is
    for shape in [(32, 32), (45, 61), (61, 45), (97, 131)]:
        image = noise(shape)
        want = reference_pixels(image)
        same_pixels(back, image, want)  # what vitlab reads is what the library does
        if own:  # and what vitlab wrote, where the library can say it
            same_pixels(pre, image, want)


def test_preprocessing_dicts_round_trip_and_old_ones_still_load() -> None:
    pre = Preprocessing((32, 48), 3, HALF, HALF, "bicubic", 0.95, "squash", "transformers")
    assert Preprocessing.from_dict(json.loads(json.dumps(pre.to_dict()))) == pre
    old = {"img_size": [32, 48], "in_chans": 3, "mean": [0.5] * 3, "std": [0.5] * 3,
           "interpolation": "bicubic", "crop_pct": 0.9}  # fmt: skip
    loaded = Preprocessing.from_dict(old)
    assert (loaded.crop_mode, loaded.reference) == ("center", None)
    with pytest.raises(ValueError, match="crop_mode must be one of"):
        Preprocessing((32, 32), 3, HALF, HALF, crop_pct=0.9, crop_mode="letterbox")


def test_batch_takes_uint8_images_and_the_models_channels_as_eval_does() -> None:
    """A float batch in [0, 1] was divided by 255 again (every value about -1, no word); a grey
    batch for an RGB model failed in a broadcast; bad statistics were taken (a std of 0 gave
    NaN later): each is now refused or converted as `vitlab eval` converts a dataset."""
    pre = Preprocessing((8, 8), 3, HALF, HALF)
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    expected = (images.float() / 255 - 0.5) / 0.5  # by hand
    torch.testing.assert_close(pre.batch(images), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"expected uint8 images \(0..255\), got torch.float32"):
        pre.batch(images.float() / 255)
    with pytest.raises(ValueError, match=r"got \(3, 8, 8\) \(one image: images\[None\]\)"):
        pre.batch(images[0])
    with pytest.raises(ValueError, match="expected images of 3 channels .or grey., got 2"):
        pre.batch(images[:, :2])
    grey = images[:, :1]
    torch.testing.assert_close(pre.batch(grey), expected[:, :1].expand(-1, 3, -1, -1))
    luma = (images.double() * torch.tensor([0.2989, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1)
    one = Preprocessing(8, 1, (0.5,), (0.5,))  # a square's one number, as timm's sizes
    assert one.img_size == (8, 8)
    got = one.batch(images)[:, 0].double() * 0.5 + 0.5  # back in [0, 1]
    assert (got * 255 - luma).abs().max() <= 1.0  # ITU-R 601 luma, within a grey level
    for bad, said in [
        (dict(mean=(0.5, 0.5)), "a value per channel, 3 for in_chans=3; got 2 and 3"),
        (dict(std=(0.0, 1.0, 1.0)), "std positive"),
        (dict(std=(0.5, math.nan, 0.5)), "std positive"),
        (dict(in_chans=0, mean=(), std=()), "in_chans is a number of channels .1 or more., got 0"),
        (dict(img_size=(8, 0)), "img_size is .height, width. in pixels"),
        (dict(mean=0.5), "mean is a value per channel, got 0.5"),
    ]:
        with pytest.raises(ValueError, match=said):
            Preprocessing(**{"img_size": (8, 8), "in_chans": 3, "mean": HALF, "std": HALF, **bad})


def test_timms_data_pipeline_prepares_images_as_the_model_says() -> None:
    """timm's idiom, `create_transform(**resolve_data_config(model=m))`, gave a vitlab model
    ImageNet's 224-pixel bicubic 0.875 crop and statistics whatever its `.preprocessing` said
    (vitlab's models had no `pretrained_cfg`): the same pixels as `preprocessing.pil` now, to
    float rounding where the preprocessing follows timm's and within a grey level where it
    resizes the whole image as transformers does."""
    timm_data = pytest.importorskip("timm.data")
    import vitlab

    rng = np.random.default_rng(0)
    cases = [
        (Preprocessing((28, 28), 1, (0.3061,), (0.3954,)), 1 / 255 / 0.3954 + 1e-6),
        (Preprocessing((32, 32), 3, (0.49, 0.48, 0.45), (0.25, 0.24, 0.26), "bicubic", 0.875,
                       "center", "timm"), 1e-6),
        (Preprocessing((32, 24), 3, (0.5,) * 3, (0.5,) * 3, "bilinear", 0.9, "squash", "timm"),
         1e-6),
    ]  # fmt: skip
    for pre, tolerance in cases:
        model = vitlab.create_model(
            "vit_nano_patch4_28", in_chans=pre.in_chans, img_size=pre.img_size
        )
        model.preprocessing = pre
        config = timm_data.resolve_data_config(model=model)
        assert config["input_size"] == (pre.in_chans, *pre.img_size) and config["std"] == pre.std
        mode, shape = ("L", (45, 61)) if pre.in_chans == 1 else ("RGB", (45, 61, 3))
        image = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)
        got, want = timm_data.create_transform(**config)(image), pre.pil(image)
        assert (got - want.reshape(got.shape)).abs().max().item() <= tolerance
    built = vitlab.create_model("vit_nano_patch4_28")  # no preprocessing: its input size only
    assert (
        built.pretrained_cfg == built.default_cfg == {"input_size": (1, 28, 28), "num_classes": 10}
    )
