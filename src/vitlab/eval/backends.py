"""Inference backends for a loaded classifier: eager PyTorch (on the CPU in float32 with its large
linear layers' weights packed once for oneDNN: models/packed.py), PyTorch with int8 dynamic
quantisation of its linear layers (torch.ao), and ONNX Runtime (fp32, or int8 dynamic
quantisation of the exported model's weight matrices). Each is an nn.Module mapping images
(B, C, H, W) float32 to logits (B, num_classes), so evaluators take any of them."""

from __future__ import annotations

import logging
import math
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from vitlab.data.transforms import shift_images
from vitlab.formats.vitlab import CheckpointMeta
from vitlab.models.packed import pack_linear
from vitlab.runtime import thread_pool

BACKENDS = ("torch", "onnxruntime")
TTA_MODES = ("none", "flip", "flip-shift")  # test-time augmentation: ViewAverage
SHIFTS = ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1))  # flip-shift's (rows down, columns right)
INSTALL = "pip install 'vitlab[export]' (onnx, onnxscript, onnxruntime)"
log = logging.getLogger(__name__)


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
    batch_threads: int = 1,
) -> nn.Module:
    """`model` (eval mode) run by `backend`: images (B, C, H, W) float32 -> logits (B, classes).
    onnxruntime exports the model to a temporary file first (checked against PyTorch within
    1e-4), with `threads` intra-op threads (default: torch's). tta="flip" averages each image's
    prediction with its mirror image's, "flip-shift" also with both shifted a pixel each way
    (ViewAverage). batch_threads > 1 (torch on the CPU) cuts each batch into that many parts,
    each run on its own thread (BatchParts). torch without int8 runs a copy of the model whose
    large float32 CPU linear layers have their weights packed for oneDNN (pack_linear: the same
    outputs to float rounding; B/16 1.08-1.14x faster)."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if tta not in TTA_MODES:
        raise BackendError(
            f"unknown test-time augmentation {tta!r}: choose from {', '.join(TTA_MODES)}"
        )
    model = model.eval()
    if int8:
        _check_int8(model, meta)
    if batch_threads > 1 and (backend != "torch" or _device_of(model).type != "cpu"):
        raise BackendError(
            f"--batch-threads {batch_threads} splits a batch among PyTorch's CPU threads: for "
            f"--backend torch on the CPU (onnxruntime runs its own threads); got "
            f"{describe(backend, int8)} on {_device_of(model)}"
        )
    if backend == "torch":
        runner = quantize_linear(model) if int8 else pack_linear(model)
        if int8:
            log.debug("--int8: the nn.Linear layers quantised (torch.ao dynamic, int8 weights)")
        runner = BatchParts(runner, batch_threads).eval() if batch_threads > 1 else runner
    else:
        runner = OnnxRuntimeModel(model, meta, int8, threads or torch.get_num_threads())
    if tta == "none":
        return runner
    pre = meta.preprocessing  # shifted in: black, normalised as the images are
    black = [-m / s for m, s in zip(pre.mean, pre.std, strict=True)]
    return ViewAverage(runner, SHIFTS if tta == "flip-shift" else SHIFTS[:1], black)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class BatchParts(nn.Module):
    """`model` on a batch cut into n parts, each part on its own thread with 1/n of PyTorch's
    threads (runtime.thread_pool), the outputs concatenated in order (train.batch_threads'
    inference; with vitlab's CPU kernels mostly slower than one call: BENCHMARKS.md, issue 16).
    Each thread takes the caller's grad, inference and CPU autocast modes (thread-local)."""

    def __init__(self, model: nn.Module, n: int) -> None:
        super().__init__()
        self.model, self.n = model, n

    def forward(self, x: Tensor) -> Tensor:
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        dtype, bf16 = torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu")

        def run(part: Tensor) -> Tensor:
            autocast = torch.autocast("cpu", dtype, enabled=bf16)
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), autocast:
                return self.model(part)

        parts = [part for part in torch.tensor_split(x, self.n) if len(part)]
        if len(parts) < 2:  # one image, or none: the model's own call, (0, classes) for none
            return run(x)
        return torch.cat(list(thread_pool(self.n).map(run, parts)))


class ViewAverage(nn.Module):
    """Test-time augmentation: a classifier's class probabilities averaged over views of each
    image: for each shift in `shifts` ((rows down, columns right); (0, 0): the image itself, the
    pixels moved in set to `fill`, black as normalised), the shifted image and its left-right
    mirror image, the two in one call of `model` (a batch twice as large). Returns
    log-probabilities, log(mean over views of softmax(f(view))), which top-k, argmax, softmax and
    cross-entropy read as they read logits. For data whose classes a flip and a small shift keep
    (runs trained with data.hflip and data.crop_padding)."""

    def __init__(
        self, model: nn.Module, shifts: tuple[tuple[int, int], ...], fill: list[float]
    ) -> None:
        super().__init__()
        self.model, self.shifts = model, shifts
        self.register_buffer("fill", torch.tensor(fill), persistent=False)  # (C,)

    def forward(self, x: Tensor) -> Tensor:
        views = []
        for down, right in self.shifts:
            v = shift_images(x, down, right, self.fill) if down or right else x
            logits = self.model(torch.cat([v, v.flip(-1)])).float()  # (2B, classes)
            views.append(logits.log_softmax(dim=-1).unflatten(0, (2, len(x))))  # (2, B, classes)
        logp = torch.cat(views)  # (views, B, classes)
        return logp.logsumexp(dim=0) - math.log(len(logp))  # no log(0) where one underflows


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
        from vitlab.models.export import ExportError, UnsupportedExport, export_onnx

        self._dir = tempfile.TemporaryDirectory(prefix="vitlab-onnx-")
        path = Path(self._dir.name) / "model.onnx"
        name = type(model).__name__
        try:
            checked = export_onnx(model, meta, path, dynamic_batch=True)
            log.debug("--backend onnxruntime: the %s exported to ONNX; onnxruntime matches "
                      "PyTorch within %.2e at batch %s", name, checked["max_abs_diff"],
                      ", ".join(map(str, checked["batches_checked"])))  # fmt: skip
            large = "data" in checked
        except UnsupportedExport as e:  # an op or a control flow the exporter lacks
            raise BackendError(f"--backend onnxruntime: {e}; use --backend torch") from None
        except ExportError as e:
            if "pip install" in str(e):
                raise BackendError(f"--backend onnxruntime: {e}") from None
            raise BackendError(f"--backend onnxruntime: the {name} exported wrongly: {e}") from None
        if int8:
            path = _quantize_onnx(path, large)
            log.debug("--int8: the ONNX model's MatMul / Gemm weights quantised to int8")
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


def _quantize_onnx(path: Path, large: bool = False) -> Path:
    """int8 weights for the file's MatMul and Gemm nodes with a constant weight; 7-bit weights
    (reduce_range) on an x86 CPU without VNNI, as onnxruntime advises there: its AVX2 kernels
    add pairs of uint8 x int8 products in int16, which full-range weights overflow (on an
    AVX2-only EPYC a tiny model's logits moved by up to 1.9 and 5.6% of its top-1 classes
    changed; with 7 bits 0.25 and 1.1%)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = path.with_name("model.int8.onnx")
    quiet, stub = logging.getLogger(), logging.NullHandler()
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its advice to run shape pre-processing, at every call
    quiet.addHandler(stub)  # it calls logging.warning, whose basicConfig() would otherwise give
    try:  # the root logger a handler of its own (a notebook's later basicConfig then did nothing)
        quantize_dynamic(
            path,
            out,
            op_types_to_quantize=["MatMul", "Gemm"],
            weight_type=QuantType.QInt8,
            reduce_range=not _int8_dot_products(),
            extra_options={"MatMulConstBOnly": True},
            use_external_data_format=large,  # a model over protobuf's 2 GiB at int8 too
        )
    finally:
        quiet.setLevel(level)
        quiet.removeHandler(stub)
    return out


def _int8_dot_products(caps: Mapping[str, object] | None = None) -> bool:
    """Whether this CPU's int8 products cannot overflow onnxruntime's intermediates: VNNI on x86
    (AVX512-VNNI, AVX-VNNI), or not x86 (ARM's dot-product instructions add in int32). x86 is
    told by its SSE keys, which torch.cpu.get_capabilities() reports on x86 only."""
    caps = torch.cpu.get_capabilities() if caps is None else caps
    if "sse2" not in caps:
        return True
    return bool(caps.get("avx512_vnni") or caps.get("avx_vnni"))
