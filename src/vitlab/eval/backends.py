"""Inference backends for a loaded classifier: eager PyTorch, PyTorch with int8 dynamic
quantisation of its linear layers (torch.ao), and ONNX Runtime (fp32, or int8 dynamic
quantisation of the exported model's weight matrices). Each is an nn.Module mapping images
(B, C, H, W) float32 to logits (B, num_classes), so evaluators take any of them."""

from __future__ import annotations

import logging
import math
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from vitlab.formats.vitlab import CheckpointMeta

BACKENDS = ("torch", "onnxruntime")
TTA_MODES = ("none", "flip")  # test-time augmentation: FlipAverage
INSTALL = "pip install 'vitlab[export]' (onnx, onnxscript, onnxruntime)"


class BackendError(ValueError):
    """A backend that cannot run this model here."""


def describe(backend: str, int8: bool) -> str:
    """'torch', 'torch int8', 'onnxruntime', 'onnxruntime int8'."""
    return f"{backend}{' int8' if int8 else ''}"


def backend_device(device: torch.device, backend: str, int8: bool) -> torch.device:
    """The device a backend runs on: the CPU for onnxruntime and int8 (their kernels here are CPU
    kernels), else `device`. A GPU asked for explicitly is refused."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if backend == "torch" and not int8:
        return device
    if device.type != "cpu":
        raise BackendError(
            f"--backend {describe(backend, int8)} runs on the CPU; got --device {device} "
            f"(use --device cpu, or --backend torch without --int8 on a GPU)"
        )
    return device


def prepare(
    model: nn.Module,
    meta: CheckpointMeta,
    backend: str = "torch",
    int8: bool = False,
    threads: int | None = None,
    tta: str = "none",
) -> nn.Module:
    """`model` (eval mode) run by `backend`: images (B, C, H, W) float32 -> logits (B, classes).
    onnxruntime exports the model to a temporary file first (checked against PyTorch within
    1e-4), with `threads` intra-op threads (default: torch's). tta="flip" averages each image's
    prediction with its mirror image's (FlipAverage)."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if tta not in TTA_MODES:
        raise BackendError(
            f"unknown test-time augmentation {tta!r}: choose from {', '.join(TTA_MODES)}"
        )
    model = model.eval()
    if int8:
        _check_int8(model, meta)
    if backend == "torch":
        runner = quantize_linear(model) if int8 else model
    else:
        runner = OnnxRuntimeModel(model, meta, int8, threads or torch.get_num_threads())
    return FlipAverage(runner) if tta == "flip" else runner


class FlipAverage(nn.Module):
    """Test-time augmentation: a classifier's class probabilities averaged over each image and
    its left-right mirror image, both in one call of `model` (a batch twice as large). Returns
    log-probabilities, log((softmax(f(x)) + softmax(f(flip(x)))) / 2), which top-k, argmax,
    softmax and cross-entropy read as they read logits. For data whose classes a horizontal
    flip keeps (the runs trained with data.hflip)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        logits = self.model(torch.cat([x, x.flip(-1)])).float()  # (2B, classes)
        views = logits.log_softmax(dim=-1).unflatten(0, (2, len(x)))  # (2, B, classes)
        return views.logsumexp(dim=0) - math.log(2)  # no log(0) where a probability underflows


def _check_int8(model: nn.Module, meta: CheckpointMeta) -> None:
    """Dynamic int8 quantises nn.Linear layers: refuse a model with none but its classifier."""
    heads = {"head", "head_dist", "fc", "head.fc"}
    body = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in heads]
    if not body:
        kind = type(model).__name__
        raise BackendError(
            f"--int8 quantises a model's linear layers, and this {kind} has none outside its "
            f"classifier (its work is convolutions): run it without --int8"
        )


def quantize_linear(model: nn.Module) -> nn.Module:
    """A copy of `model` with every nn.Linear replaced by torch.ao's dynamically quantised one:
    int8 weights (per tensor), activations quantised per batch, float32 in and out."""
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated for torchao
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as e:
        raise BackendError(f"--backend onnxruntime needs onnxruntime ({e}): {INSTALL}") from None
    return onnxruntime


class OnnxRuntimeModel(nn.Module):
    """A model exported to ONNX (dynamic batch) and run by an onnxruntime CPU session; with
    int8, the exported file's MatMul/Gemm weights are quantised to int8 (onnxruntime's
    quantize_dynamic, weights only: the attention products between activations stay float)."""

    def __init__(self, model: nn.Module, meta: CheckpointMeta, int8: bool, threads: int) -> None:
        super().__init__()
        ort = _onnxruntime()
        from vitlab.models.export import ExportError, export_onnx

        self._dir = tempfile.TemporaryDirectory(prefix="vitlab-onnx-")
        path = Path(self._dir.name) / "model.onnx"
        name = type(model).__name__
        try:
            export_onnx(model, meta, path, dynamic_batch=True)
        except ExportError as e:
            if "pip install" in str(e):
                raise BackendError(f"--backend onnxruntime: {e}") from None
            raise BackendError(f"--backend onnxruntime: the {name} exported wrongly: {e}") from None
        except Exception as e:  # the exporter's own errors: an op or a control flow it lacks
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BackendError(
                f"--backend onnxruntime: this {name} cannot be exported to ONNX ({first}); "
                f"use --backend torch"
            ) from None
        if int8:
            path = _quantize_onnx(path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.path = path

    def forward(self, x: Tensor) -> Tensor:
        images = x.detach().float().cpu().contiguous().numpy()  # (B, C, H, W)
        return torch.from_numpy(self.session.run(None, {"images": images})[0])  # (B, classes)


def _quantize_onnx(path: Path) -> Path:
    """int8 weights for the file's MatMul and Gemm nodes with a constant weight."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = path.with_name("model.int8.onnx")
    quiet = logging.getLogger()
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its advice to run shape pre-processing, at every call
    try:
        quantize_dynamic(
            path,
            out,
            op_types_to_quantize=["MatMul", "Gemm"],
            weight_type=QuantType.QInt8,
            extra_options={"MatMulConstBOnly": True},
        )
    finally:
        quiet.setLevel(level)
    return out
