"""`hf_dir`: reload a Hugging Face checkpoint directory (config-less safetensors files).

The "update from disk" path of SGLang's `update_weights_from_disk` and vLLM's reload: the
trainer saves its weights with safetensors, each engine rank opens the files and hands every
tensor to `load_weights`. No plan-shaped shards, no manifest: any directory of `*.safetensors`
(with or without `model.safetensors.index.json`) can be loaded. The source description is::

    {"path": DIR, "version": V}                 # an operator reloading a checkpoint
    {..., "names": [...], "digests": {...}, "fingerprint": F, "session_id": S,
     "bucket_bytes": B, "step": N}              # what HfDirSink adds for a Publisher

Without `digests` each rank hashes the tensors it reads, so the engine still reports the
fingerprint of what it loaded; with them (a Publisher's push) `verify="full"` checks every byte
against the trainer's digests.
"""

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated

import msgspec
import xxhash
from safetensors import safe_open

from weightbus.core.checkpoint import safetensors_files, safetensors_metas
from weightbus.core.digest import fingerprint_of_digests, tensor_digest
from weightbus.core.meta import TensorMeta
from weightbus.core.plan import DEFAULT_BUCKET_BYTES, plan_buckets
from weightbus.core.transport.base import (
    BucketSource,
    Progress,
    PushSession,
    ReceivedBatch,
    SourceDescription,
    no_progress,
)
from weightbus.core.transport.parts.files import create_file
from weightbus.core.transport.parts.session_dir import SessionDirSink
from weightbus.core.transport.sending import Sending
from weightbus.core.wire import UpdateBegin, UpdateEnd, WireMeta
from weightbus.core.wire.messages import Hex128, NonNegative, TensorName, Version

CHECKPOINT_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
HF_DIR_ROOT_PREFIX = "weightbus-hf-dir-"
SHARD_BYTES = 5 << 30  # Hugging Face's default `max_shard_size`


def _shards(metas: Sequence[TensorMeta], shard_bytes: int) -> dict[str, list[TensorMeta]]:
    """The checkpoint's files and their tensors, in order, each file at most `shard_bytes`
    (Hugging Face's names: `model.safetensors` alone, else `model-00001-of-00003...`)."""
    groups: list[list[TensorMeta]] = [[]]
    size = 0
    for meta in metas:
        if groups[-1] and size + meta.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(meta)
        size += meta.nbytes
    if len(groups) == 1:
        return {CHECKPOINT_NAME: groups[0]}
    return {
        f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors": group
        for index, group in enumerate(groups)
    }


class HfDirDescription(SourceDescription, frozen=True):
    """A checkpoint directory to load as `version` (module docstring: who fills what)."""

    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    version: Version
    step: NonNegative | None = None
    session_id: Hex128 | None = None
    bucket_bytes: Annotated[int, msgspec.Meta(gt=0)] = DEFAULT_BUCKET_BYTES
    names: list[TensorName] | None = None
    digests: dict[TensorName, Hex128] | None = None
    fingerprint: Hex128 | None = None


class HfDirSink(SessionDirSink):
    """Saves each push as a Hugging Face checkpoint directory `<root>/<session_id>`: one
    `model.safetensors`, or shards of at most `shard_bytes` with `model.safetensors.index.json`
    (every trainer rank writing its part of them: `parts/files.py`); keeps only the newest.

    Args:
        root: as `SessionDirSink`'s (by default a fresh private one under /dev/shm).
        shard_bytes: the largest shard (Hugging Face's `max_shard_size`; a larger tensor gets
            a shard of its own).
    """

    name = "hf_dir"

    def __init__(self, root: str | Path | None = None, shard_bytes: int = SHARD_BYTES) -> None:
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be > 0, got {shard_bytes}")
        super().__init__(root, HF_DIR_ROOT_PREFIX)
        self.shard_bytes = shard_bytes

    def prepare(
        self, session: PushSession, sending: Sending, progress: Progress = no_progress
    ) -> HfDirDescription:
        tmp = self._start(session.session_id)
        shards = _shards(session.plan.metas, self.shard_bytes)
        files = [create_file(tmp / file, metas) for file, metas in shards.items()]
        if len(shards) > 1:
            index = {meta.name: file for file, metas in shards.items() for meta in metas}
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": index}))
        self._write_files(session, sending, files, progress)
        return HfDirDescription(
            path=str(self._publish(session.session_id)),
            version=session.version,
            step=session.step,
            session_id=session.session_id,
            bucket_bytes=session.plan.bucket_bytes,
            names=[meta.name for meta in session.plan.metas],
            digests=dict(session.digests),
            fingerprint=session.fingerprint,
        )


class HfDirSource(BucketSource):
    """Reads a Hugging Face checkpoint directory on one rank (description: module docstring)."""

    def __init__(self, description: HfDirDescription, *, rank: int = 0, tp_size: int = 1) -> None:
        self.description = description
        self.directory = Path(description.path)
        self.session_id = description.session_id or xxhash.xxh3_128_hexdigest(
            f"{self.directory}\0{description.version}".encode()
        )
        self._files: dict[str, Path] = {}
        self._header: UpdateBegin | None = None
        self._num_buckets = 0
        self._digests: dict[str, str] = {}

    def begin(self, timeout_s: float) -> UpdateBegin:
        try:
            found = safetensors_metas(safetensors_files(self.directory))
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
        order = list(found) if self.description.names is None else self.description.names
        if sorted(order) != sorted(found):
            extra, missing = sorted(set(found) - set(order)), sorted(set(order) - set(found))
            raise ValueError(f"{self.directory}: unexpected tensors {extra}, missing {missing}")
        metas = [found[name][0] for name in order]
        self._files = {name: found[name][1] for name in order}
        plan = plan_buckets(metas, self.description.bucket_bytes)
        self._num_buckets = plan.num_buckets
        self._header = UpdateBegin(
            session_id=self.session_id,
            version=self.description.version,
            step=self.description.step,
            plan_hash=plan.plan_hash,
            bucket_bytes=self.description.bucket_bytes,
            tensors=[WireMeta.of(meta) for meta in metas],
        )
        return self._header

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        assert self._header is not None, "begin() first"
        by_file: dict[Path, list[str]] = {}
        for name, path in self._files.items():
            by_file.setdefault(path, []).append(name)
        given = self.description.digests  # None: hash what is read
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as reader:
                for name in names:
                    tensor = reader.get_tensor(name)
                    digest = tensor_digest(tensor) if given is None else given.get(name, "")
                    self._digests[name] = digest
                    yield ReceivedBatch(
                        tensors=[(name, tensor)], digests={name: digest}, nbytes=tensor.nbytes
                    )

    def end(self, timeout_s: float) -> UpdateEnd:
        header = self._header
        assert header is not None, "begin() first"
        fingerprint = self.description.fingerprint or fingerprint_of_digests(
            (m.name, m.dtype, m.shape, self._digests.get(m.name, "")) for m in header.tensors
        )
        return UpdateEnd(
            session_id=header.session_id,
            version=header.version,
            num_buckets=self._num_buckets,
            fingerprint=fingerprint,
        )
