"""Deployment exports of a model: ONNX (through torch.export, checked with onnxruntime against
PyTorch) and a torch.export program (.pt2). Both carry the preprocessing and class names."""

from __future__ import annotations

import copy
import glob
import json
import os
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from vitlab.formats.base import fsync
from vitlab.formats.vitlab import CheckpointMeta
from vitlab.models.vit import VisionTransformer
from vitlab.runtime import Terminated, folder_refusal

TOLERANCE = 1e-4  # of an image's largest |logit| when above 1: float32's rounding scales too
PROTOBUF_LIMIT = 1.8e9  # weights' bytes an ONNX file takes (protobuf: 2 GiB, the graph with them)


class ExportError(ValueError):
    """An export that cannot be made, or whose output does not match PyTorch's."""


class UnsupportedExport(ExportError):
    """The exporter lacks an operation or a control flow the model uses."""


def _exported(what: str, model: torch.nn.Module, export: Callable[[], object]) -> object:
    """export(), its own errors (tracebacks many lines long, coloured) as one UnsupportedExport."""
    try:
        return export()
    except ExportError:
        raise
    except Exception as e:
        cause: BaseException | None = e
        for _ in range(32):  # a Ctrl-C or SIGTERM the exporter wrapped in its own error:
            if isinstance(cause, KeyboardInterrupt | Terminated):  # interrupted, as raised
                raise cause.with_traceback(None) from None
            cause = cause and (cause.__cause__ or cause.__context__)
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise UnsupportedExport(
            f"this {type(model).__name__} cannot be exported {what} ({first})"
        ) from None


def check_out(out: Path, suffix: str | None = None, option: str = "") -> None:
    """An ExportError for an output path that is a folder or under a file, or (`suffix`) named
    for another format: asked of every output before any export runs."""
    if out.is_dir():
        raise ExportError(f"{out} is a folder: name the file to write")
    if refusal := folder_refusal(out.parent, out.name):
        raise ExportError(refusal)
    if suffix is not None and out.suffix.lower() != suffix:  # an ONNX model named .pt2 (a swap)
        raise ExportError(f"{option} writes OUT{suffix}, got {out}: name it {out.stem}{suffix} "
                          f"(.onnx: --onnx, .pt2: --torch-export)")  # fmt: skip


@contextmanager
def _checked_file(out: Path, suffix: str | None = None) -> Iterator[Path]:
    """A temporary name beside `out` (ending in `suffix`, else out's), renamed over it only when
    the block (writing and checking the export) succeeds: a file that failed its check, or a
    half-written one, is not left (nor the weights an ONNX exporter wrote beside it, + .data).
    The name is this call's own: two exports to one OUT at once write two files, the last rename
    wins, and neither reads or removes the other's half-written file."""
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    own = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = out.with_name(f".{out.stem}.{own}.tmp{out.suffix if suffix is None else suffix}")
    try:
        yield tmp
        fsync(tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        Path(f"{tmp}.data").unlink(missing_ok=True)
        raise
    fsync(out.parent)


def _inputs(model: VisionTransformer, batch: int, seed: int = 0) -> torch.Tensor:
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, cfg.in_chans, *cfg.img_hw, generator=g)


def _dynamic(dynamic_batch: bool) -> tuple | None:
    if not dynamic_batch:
        return None
    return ({0: torch.export.Dim("batch", min=1, max=65536)},)


def _meta(meta: CheckpointMeta) -> dict[str, str]:
    return {
        "vitlab_preprocessing": json.dumps(meta.preprocessing.to_dict()),
        "vitlab_classes": json.dumps(meta.classes),
    }


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    """The largest difference; an ExportError where an image's passes TOLERANCE x its largest
    |output| (at least 1)."""
    if not bool(want.isfinite().all()):
        raise ExportError(f"PyTorch's own output is not finite, so {what} cannot be checked")
    err = (got - want).abs().reshape(len(want), -1).amax(1)
    top = want.abs().reshape(len(want), -1).amax(1)
    if not bool((err <= TOLERANCE * top.clamp(min=1.0)).all()):
        i = int((err / top.clamp(min=1.0)).nan_to_num(float("inf")).argmax())
        raise ExportError(f"{what} differs from PyTorch by {err[i]:.2e} in an image whose largest "
                          f"|output| is {top[i]:.3g} (tolerance {TOLERANCE} x that, or x 1 "
                          f"below 1)")  # fmt: skip
    return err.max().item()


def _float_copy(model: VisionTransformer) -> VisionTransformer:
    """A float32 CPU copy of `model` in eval mode: exporting leaves the caller's model as it was
    (a bf16 or GPU model being trained)."""
    return copy.deepcopy(model).float().cpu().eval()


def export_onnx(
    model: VisionTransformer, meta: CheckpointMeta, out: Path, dynamic_batch: bool = False
) -> dict[str, Any]:
    """Write `out` (.onnx; input `images` (B, C, H, W) float32, output `logits`, or `features`
    for a model without a classifier: num_classes=0, the pooled features), then run it in
    onnxruntime and compare with PyTorch. Returns the batch sizes checked, the max diff and, for
    a model of PROTOBUF_LIMIT bytes or more, the file of its weights beside OUT (`data`)."""
    try:
        import onnx  # noqa: F401  (both used by _onnx_file)
        import onnxruntime  # noqa: F401
    except ImportError as e:
        raise ExportError(
            f"ONNX export needs onnx, onnxscript and onnxruntime ({e}): "
            "pip install 'vitlab[export]'"
        ) from None
    model = _float_copy(model)
    out = Path(out)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    weights = out.with_name(f"{out.name}.{secrets.token_hex(4)}.data")  # if large: its own name
    large = size >= PROTOBUF_LIMIT
    try:
        worst, batches = _onnx_file(model, meta, out, dynamic_batch, weights if large else None)
    except BaseException:  # failed between the weights' rename and OUT's: not OUT's weights yet
        if weights.exists() and not (out.is_file() and weights.name.encode() in out.read_bytes()):
            weights.unlink()
        raise
    for old in out.parent.glob(f"{glob.escape(out.name)}.*.data"):  # an earlier export's
        if old != weights and re.fullmatch(r"[0-9a-f]{8}", old.name[len(out.name) + 1 : -5]):
            with suppress(OSError):  # OUT is written: a file that stays is no failure
                old.unlink()
    return {"max_abs_diff": worst, "batches_checked": batches,
            **({"data": str(weights)} if large else {})}  # fmt: skip


def _onnx_file(
    model: torch.nn.Module, meta: CheckpointMeta, out: Path, dynamic_batch: bool,
    weights: Path | None,
) -> tuple[float, list[int]]:  # fmt: skip
    """Write and check OUT; `weights`: a large model's weights go there (renamed into place just
    before OUT, which names it: a crash between the two leaves the old pair whole)."""
    import onnx
    import onnxruntime as ort

    large = weights is not None
    with _checked_file(out) as tmp:
        onnx_export = lambda: torch.onnx.export(  # noqa: E731
            model,
            (_inputs(model, 2),),
            str(tmp),
            dynamo=True,
            input_names=["images"],
            output_names=["logits" if getattr(model.config, "num_classes", 1) else "features"],
            dynamic_shapes=_dynamic(dynamic_batch),
            external_data=large,
            verbose=False,
        )
        _exported("to ONNX", model, onnx_export)
        proto = onnx.load(str(tmp), load_external_data=False)  # the weights stay where they are
        for key, value in _meta(meta).items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(proto, str(tmp))
        session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
        worst, batches = 0.0, [2] + ([5] if dynamic_batch else [])
        for b in batches:
            xb = _inputs(model, b, seed=b)
            with torch.no_grad():
                want = model(xb)
            got = torch.from_numpy(session.run(None, {"images": xb.numpy()})[0])
            worst = max(worst, _check(got, want, f"onnxruntime output at batch {b}"))
        del session  # (Windows renames no file a session holds open)
        if large:  # the graph names its weights' file: the one beside OUT once renamed
            try:
                from onnx.external_data_helper import _get_all_tensors

                tensors = _get_all_tensors(proto)
            except ImportError:  # a private helper: the initializers are what is moved
                tensors = proto.graph.initializer
            for e in (e for t in tensors for e in t.external_data):
                e.value = weights.name if e.key == "location" else e.value
            onnx.save(proto, str(tmp))
            fsync(Path(f"{tmp}.data"))
            os.replace(f"{tmp}.data", weights)
    return worst, batches


def export_program(
    model: VisionTransformer, meta: CheckpointMeta, out: Path, dynamic_batch: bool = False
) -> dict[str, float | int]:
    """Write a torch.export program (`torch.export.load(out).module()(images)`), reload it and
    compare with the model."""
    check_out(Path(out))  # before the export, which takes a while
    model = _float_copy(model)
    shapes = _dynamic(dynamic_batch)
    program = _exported(
        "with torch.export", model,
        lambda: torch.export.export(model, (_inputs(model, 2),), dynamic_shapes=shapes),
    )  # fmt: skip
    extra = {"vitlab.json": json.dumps(_meta(meta))}
    with _checked_file(Path(out), ".pt2") as tmp:  # torch.export warns about any other suffix
        torch.export.save(program, str(tmp), extra_files=extra)
        loaded = torch.export.load(str(tmp)).module()
        worst, batches = 0.0, [2] + ([5] if dynamic_batch else [])
        for b in batches:
            xb = _inputs(model, b, seed=b)
            with torch.no_grad():
                got, want = loaded(xb), model(xb)
            worst = max(worst, _check(got, want, f"exported program at batch {b}"))
    return {"max_abs_diff": worst, "batches_checked": batches}
