"""Safetensors checkpoints: the files of a Hugging Face directory, reading and saving tensors.

Shared by the reference engine's loader, the `disk` and `hf_dir` transports and the CLI.
"""

from collections.abc import Iterator, Mapping
from pathlib import Path

import msgspec
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from weightbus.core.meta import TensorMeta

INDEX_FILE = "model.safetensors.index.json"
# safetensors' dtype names (headers) -> torch dtypes
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _Index(msgspec.Struct):
    """What weightbus reads of `model.safetensors.index.json` (other keys are ignored)."""

    weight_map: dict[str, str]


def _indexed_files(index: Path) -> list[str]:
    try:
        weight_map = msgspec.json.decode(index.read_bytes(), type=_Index).weight_map
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
        raise ValueError(f"{index} is not a safetensors index: {exc}") from None
    names = sorted(set(weight_map.values()))
    outside = [name for name in names if name != Path(name).name or name in ("", ".", "..")]
    if outside:
        raise ValueError(f"{index} names files outside its directory: {outside}")
    return names


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of a directory: those of the index when present, else all.

    Raises:
        FileNotFoundError: no safetensors file (or one the index names is missing).
        ValueError: the index is malformed or names files outside the directory.
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        files = [model_dir / name for name in _indexed_files(index)]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names missing files: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` of every tensor in a Hugging Face directory, one file open at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def save_tensors(path: Path, names: list[str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Save `tensors[name]` for each of `names` as one safetensors file, readable by its owner
    alone (0600); tensors sharing memory (tied embeddings) are saved as copies."""
    seen_storages: set[int] = set()
    shard = {}
    for name in names:
        tensor = tensors[name].detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory (tied embeddings): copy repeats.
        storage = tensor.untyped_storage().data_ptr()
        shard[name] = tensor.clone() if storage in seen_storages and tensor.numel() else tensor
        seen_storages.add(storage)
    save_file(shard, str(path))
    path.chmod(0o600)  # like the directory: the owner's alone


def safetensors_metas(files: list[Path]) -> dict[str, tuple[TensorMeta, Path]]:
    """Every tensor's meta (from the safetensors headers, no data read) and its file.

    Raises:
        ValueError: a file is not safetensors, or holds a dtype weightbus does not carry.
    """
    found: dict[str, tuple[TensorMeta, Path]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                    part = reader.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(part.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{path.name}: {name!r} has dtype {part.get_dtype()}")
                    found[name] = (TensorMeta(name, dtype, tuple(part.get_shape())), path)
        except SafetensorError as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
    return found
