"""`disk`: safetensors shards and a manifest on a (shared) filesystem.

Layout of one session under the sink's root directory::

    <root>/<session_id>/manifest.json          header, shard list, digests, fingerprint
    <root>/<session_id>/shard-00000.safetensors

One shard per plan bucket (whole tensors: each in the shard of the bucket where it starts),
laid out by the leader, written by every trainer rank (`parts/files.py`).
The session directory is written as `<root>/.tmp-<session_id>` and renamed into place, so a
reader sees a complete session or none. Readers map shards (safetensors' mmap) and only the
pages their weight loaders touch are read: a TP rank reads little more than its slices.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import msgspec
from safetensors import SafetensorError, safe_open

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
from weightbus.core.wire import UpdateBegin, UpdateEnd

DISK_ROOT_PREFIX = "weightbus-disk-"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 256 * 1024 * 1024


class DiskDescription(SourceDescription, frozen=True):
    """A session directory written by `DiskSink` (on a filesystem the engines share)."""

    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class ShardRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    file: str
    names: list[str]


class DiskManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: int
    begin: UpdateBegin
    shards: list[ShardRecord]
    digests: dict[str, str]
    end: UpdateEnd


class DiskSink(SessionDirSink):
    """Writes each push as a session directory under `root` (`SessionDirSink`: by default a
    fresh private one under /dev/shm); keeps only the newest one."""

    name = "disk"

    def __init__(self, root: str | Path | None = None) -> None:
        super().__init__(root, DISK_ROOT_PREFIX)

    def prepare(
        self, session: PushSession, sending: Sending, progress: Progress = no_progress
    ) -> DiskDescription:
        tmp = self._start(session.session_id)
        metas = {meta.name: meta for meta in session.plan.metas}
        records, files = [], []
        for bucket in session.plan.buckets:
            # whole tensors: each in the shard of the bucket where it starts
            names = [entry.name for entry in bucket.entries if entry.tensor_offset == 0]
            if names:
                file = f"shard-{bucket.index:05d}.safetensors"
                files.append(create_file(tmp / file, [metas[name] for name in names]))
                records.append(ShardRecord(file, names))
        self._write_files(session, sending, files, progress)
        manifest = DiskManifest(
            format=MANIFEST_FORMAT,
            begin=session.begin_message(),
            shards=records,
            digests=dict(session.digests),
            end=session.end_message(),
        )
        (tmp / MANIFEST_NAME).write_bytes(msgspec.json.encode(manifest))
        (tmp / MANIFEST_NAME).chmod(0o600)
        return DiskDescription(path=str(self._publish(session.session_id)))


def read_manifest(directory: Path) -> DiskManifest:
    """Read and validate a session's manifest.

    Raises:
        ValueError: missing, oversized or invalid manifest (the message names the problem).
    """
    path = directory / MANIFEST_NAME
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest {path} is {size} bytes, over {MAX_MANIFEST_BYTES}")
        manifest = msgspec.json.decode(path.read_bytes(), type=DiskManifest)
    except FileNotFoundError:
        raise ValueError(f"no manifest at {path}") from None
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid manifest {path}: {exc}") from None
    if manifest.format != MANIFEST_FORMAT:
        raise ValueError(f"manifest {path}: format {manifest.format}, expected {MANIFEST_FORMAT}")
    return manifest


class DiskSource(BucketSource):
    """Reads a session directory written by `DiskSink`."""

    def __init__(self, description: DiskDescription, *, rank: int = 0, tp_size: int = 1) -> None:
        self.directory = Path(description.path)
        self._manifest: DiskManifest | None = None

    def begin(self, timeout_s: float) -> UpdateBegin:
        self._manifest = read_manifest(self.directory)
        return self._manifest.begin

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        assert self._manifest is not None, "begin() first"
        for shard in self._manifest.shards:
            path = self.directory / Path(shard.file).name  # never leave the session directory
            try:
                with safe_open(str(path), framework="pt") as reader:
                    stored = set(reader.keys())
                    missing = [name for name in shard.names if name not in stored]
                    if missing:
                        raise ValueError(f"shard {path.name} lacks tensors {missing}")
                    tensors = [(name, reader.get_tensor(name)) for name in shard.names]
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"cannot read shard {path.name}: {exc}") from None
            digests = {name: self._manifest.digests.get(name, "") for name in shard.names}
            nbytes = sum(tensor.nbytes for _, tensor in tensors)
            yield ReceivedBatch(tensors=tensors, digests=digests, nbytes=nbytes)

    def end(self, timeout_s: float) -> UpdateEnd:
        assert self._manifest is not None, "begin() first"
        return self._manifest.end
