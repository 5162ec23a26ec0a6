"""LoRA adapters into vLLM, trainer side: a pushed adapter becomes a verified peft directory.

vLLM 0.32 loads a LoRA adapter from a directory (`POST /v1/load_lora_adapter`, served with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` and `--enable-lora`), and reads it again whenever it needs
it: every scheduler step of a request whose adapter was loaded in place, and after every
weight-transfer `/finish_weight_update` (which drops its workers' adapters). A directory vLLM
may still read must therefore stay on disk; one that vanished stops vLLM's engine at the next
request of its adapter (measured). So every adapter version gets a directory of its own, and a
directory is removed only once no request can still name it (`AdapterDirectories`).

The bytes come from a file transport's session (`hf_dir`, `disk`: the sink wrote it before the
target is handed the order): `read_pushed_adapter` reads the tensors and the trainer's digests,
`AdapterDirectories.write` saves them under peft's names with an `adapter_config.json` made from
the `AdapterSpec`, then reads back the file vLLM will load and checks every tensor's digest and
the fingerprint against the trainer's. A directory is published (renamed into place) only once
verified; a mismatch removes it and names the tensor.
"""

import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import SafetensorError, safe_open

from weightbus.core.checkpoint import save_tensors
from weightbus.core.digest import fingerprint_of_digests, tensor_digest
from weightbus.core.meta import dtype_name
from weightbus.core.transport import open_source
from weightbus.core.wire.adapter import AdapterSpec, served_fingerprint
from weightbus.core.wire.order import UpdateOrder

# transports whose session is a directory of safetensors files the target can read
FILE_TRANSPORTS = ("hf_dir", "disk")
# The environment variable that gives vLLM its `/v1/load_lora_adapter` route.
LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# Every adapter refusal ends with this: vLLM serves what it served.
ADAPTER_UNTOUCHED = "nothing was changed: vLLM serves what it served"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# what the directory holds, for whoever finds it listed as vLLM's adapter (`read_identity`)
IDENTITY_FILE = "weightbus_adapter.json"
ROOT_PREFIX = "weightbus-vllm-adapters-"
SHM_DIR = Path("/dev/shm")  # noqa: S108 - shared memory: a directory vLLM on this host can read
# The directories kept once an adapter loaded: its own, and the one served before it, which
# requests vLLM accepted while the push paused it still name (vLLM resolves the directory
# when a request arrives); those finish before the next push's drain (or abort) returns.
KEPT_LOADED = 2


class AdapterIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one adapter directory holds: `version`'s adapter `spec`, whose tensors (as vLLM
    loads them) have fingerprint `adapter_fingerprint`."""

    version: str
    spec: AdapterSpec
    adapter_fingerprint: str

    @property
    def served_fingerprint(self) -> str:
        """What an engine serving it reports: base and adapter together."""
        return served_fingerprint(self.spec, self.adapter_fingerprint)


@dataclass(frozen=True, slots=True)
class PushedAdapter:
    """An adapter push as its transport session holds it: the tensors (peft names), each one's
    digest and the fingerprint, both the trainer's."""

    tensors: dict[str, torch.Tensor]
    digests: dict[str, str]
    fingerprint: str


def peft_config(spec: AdapterSpec) -> dict[str, Any]:
    """The `adapter_config.json` of `spec`: plain LoRA (no bias, DoRA or per-module ranks)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.r,
        "lora_alpha": spec.lora_alpha,
        "target_modules": list(spec.target_modules),
        "use_rslora": spec.use_rslora,
        "bias": "none",
        "lora_dropout": 0.0,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def refuse_other_transports(transport: str) -> None:
    """Raises: ValueError: `transport` does not leave a directory the target can read."""
    if transport not in FILE_TRANSPORTS:
        raise ValueError(
            f"a LoRA adapter push into vLLM needs a file transport ('hf_dir' or 'disk': vLLM "
            f"loads adapters from a directory), not {transport!r}: push it with "
            "Publisher(..., transport='hf_dir') (or a route of that transport for this engine)"
        )


def read_pushed_adapter(order: UpdateOrder, timeout_s: float) -> PushedAdapter:
    """Read the adapter push `order` names from its file transport's session.

    Raises:
        ValueError: not a file transport, a session that cannot be read, or another plan
            than the order's.
    """
    refuse_other_transports(order.transport)
    source = open_source(order.transport, order.source)
    header = source.begin(timeout_s)
    if order.plan_hash is not None and header.plan_hash != order.plan_hash:
        raise ValueError(
            f"plan hash {header.plan_hash} of the session != order's {order.plan_hash}"
        )
    tensors: dict[str, torch.Tensor] = {}
    digests: dict[str, str] = {}
    for batch in source.batches(timeout_s):
        tensors.update(batch.tensors)
        digests.update(batch.digests)
    return PushedAdapter(tensors, digests, source.end(timeout_s).fingerprint)


def verified_fingerprint(path: Path, digests: dict[str, str], fingerprint: str) -> str:
    """The fingerprint of the adapter file `path` (what vLLM will load), once every tensor's
    digest equals the trainer's (`digests`) and the fingerprint `fingerprint`.

    Raises:
        ValueError: a tensor missing, unexpected or of other bytes (named), or the file
            unreadable.
    """
    records = []
    try:
        with safe_open(str(path), framework="pt") as reader:
            names = set(reader.keys())
            if names != set(digests):
                missing, extra = sorted(set(digests) - names), sorted(names - set(digests))
                raise ValueError(f"adapter file {path.name}: missing {missing}, unexpected {extra}")
            for name in sorted(names):
                tensor = reader.get_tensor(name)
                digest = tensor_digest(tensor)
                if digest != digests[name]:
                    raise ValueError(
                        f"digest mismatch for adapter tensor {name!r}: the bytes vLLM would load "
                        f"hash to {digest}, the trainer pushed {digests[name]}"
                    )
                records.append((name, dtype_name(tensor.dtype), tuple(tensor.shape), digest))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"cannot read adapter file {path}: {exc}") from None
    found = fingerprint_of_digests(records)
    if found != fingerprint:
        raise ValueError(f"adapter fingerprint {found} != pushed {fingerprint}")
    return found


def read_identity(directory: str | Path) -> AdapterIdentity | None:
    """The identity an adapter directory written here holds (None: none readable)."""
    try:
        return msgspec.json.decode(
            (Path(directory) / IDENTITY_FILE).read_bytes(), type=AdapterIdentity
        )
    except (OSError, msgspec.MsgspecError):
        return None


class AdapterDirectories:
    """One directory per adapter version under `root`, written, verified, then published.

    Directories vLLM loaded outlive this object (`close` leaves them): vLLM reads the one it
    serves again after every weight update, and stops if it is gone.

    Args:
        root: where the directories go: a directory vLLM's server can read (its host's
            filesystem, or one shared with it). Default: a new 0700 directory under /dev/shm
            (the temporary directory where there is none), for a vLLM server on this host
            running as this user.
    """

    def __init__(self, root: str | Path | None = None) -> None:
        self._owned_root = root is None
        if root is None:
            parent = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
            root = tempfile.mkdtemp(prefix=ROOT_PREFIX, dir=parent)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._count = 0
        self._instance = secrets.token_hex(4)
        self._loaded: list[Path] = []  # the directories vLLM loaded, oldest first

    def write(
        self, version: str, spec: AdapterSpec, pushed: PushedAdapter
    ) -> tuple[Path, AdapterIdentity]:
        """Save `pushed` as a peft adapter directory for `version`, verify the file vLLM will
        load against the trainer's digests and fingerprint, and publish the directory.

        Returns:
            The published directory and what it holds (also in its identity file).

        Raises:
            ValueError: the written bytes are not the trainer's (nothing is published).
        """
        self._count += 1
        name = f"{self._count:06d}-{self._instance}"  # unique beside other targets' and runs
        tmp = self.root / f".tmp-{name}"
        tmp.mkdir(mode=0o700)
        try:
            save_tensors(tmp / ADAPTER_WEIGHTS, sorted(pushed.tensors), pushed.tensors)
            (tmp / ADAPTER_CONFIG).write_bytes(msgspec.json.encode(peft_config(spec)))
            fingerprint = verified_fingerprint(
                tmp / ADAPTER_WEIGHTS, pushed.digests, pushed.fingerprint
            )
            identity = AdapterIdentity(version, spec, fingerprint)
            (tmp / IDENTITY_FILE).write_bytes(msgspec.json.encode(identity))
            final = self.root / name
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final, identity

    def discard(self, directory: Path) -> None:
        """Remove a directory vLLM never loaded (a refused or aborted push)."""
        if directory not in self._loaded:
            shutil.rmtree(directory, ignore_errors=True)

    def loaded(self, directory: Path) -> None:
        """vLLM loaded `directory`: keep it and the one before, remove the older ones."""
        self._loaded.append(directory)
        for old in self._loaded[:-KEPT_LOADED]:
            shutil.rmtree(old, ignore_errors=True)
        self._loaded = self._loaded[-KEPT_LOADED:]

    def close(self) -> None:
        """Remove the root this object made, unless vLLM loaded a directory from it."""
        if self._owned_root and not self._loaded:
            shutil.rmtree(self.root, ignore_errors=True)
