"""Checkpoints by Hugging Face Hub name (`org/model`, `org/model@revision`): the snapshot folder in
the local Hugging Face cache, downloaded when online, the cached copy when offline."""

from __future__ import annotations

import re
from pathlib import Path

from vitlab.formats.base import CheckpointError

_NAME = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")


# what a local path (that does not exist) looks like: a weights file, or vitlab's runs folder
_LOCAL_SUFFIXES = (".safetensors", ".npz", ".bin", ".pth", ".pt", ".ckpt", ".onnx", ".pt2")


def is_hub_name(text: str) -> bool:
    """Whether `text` is read as a Hub repo (`org/model[@revision]`) rather than a local path:
    a mistyped `runs/my-run` or `dir/model.safetensors` is not looked up on the Hub."""
    local = text.startswith((".", "/", "runs/")) or text.lower().endswith(_LOCAL_SUFFIXES)
    return bool(_NAME.match(text)) and not local


def download(name: str) -> Path:
    """The snapshot folder of hub repo `name` with config.json, preprocessor_config.json and the
    weights (model.safetensors, else pytorch_model.bin; either sharded beside its index)."""
    # imported here, on first use: it brings an HTTP stack that nothing else needs
    from huggingface_hub import constants, snapshot_download

    repo, _, revision = name.partition("@")
    errors: list[str] = []
    for weights, shards in (("model.safetensors", "model-*-of-*.safetensors"),
                            ("pytorch_model.bin", "pytorch_model-*-of-*.bin")):  # fmt: skip
        index = f"{weights}.index.json"
        patterns = ["config.json", "preprocessor_config.json", weights, index, shards]
        for local_only in (False, True):
            try:
                folder = Path(
                    snapshot_download(
                        repo, revision=revision or None, allow_patterns=patterns,
                        local_files_only=local_only,
                    )
                )  # fmt: skip
            except Exception as e:  # offline, not cached, no such repo or revision
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            if (folder / weights).is_file() or (folder / index).is_file():
                return folder
            errors.append(f"no {weights} in {folder}")
            break
    raise CheckpointError(
        f"cannot get {repo} from the Hugging Face Hub (offline, or no such repo; nor is it a "
        f"local file or folder) and it is not in the local cache ({constants.HF_HUB_CACHE}). "
        f"Download it where there is internet (it lands in that cache), or pass a local file or "
        f"folder. Last error: {errors[-1]}"
    )
