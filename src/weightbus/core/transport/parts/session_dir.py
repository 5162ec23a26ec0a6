"""Session directories of the file transports (`disk`, `hf_dir`): each push is written into
`<root>/.tmp-<session>` and renamed to `<root>/<session>`, so a reader sees a whole session or
none; only the newest session is kept, and a root this writer made is removed on `close`."""

import shutil
from pathlib import Path

from weightbus.core.trainer.digests import combine_shares
from weightbus.core.transport.base import BucketSink, Progress, PushSession, no_progress
from weightbus.core.transport.parts.files import FileLayout, FilesOrder
from weightbus.core.transport.parts.shared_memory import private_shm_dir
from weightbus.core.transport.sending import Sending


class SessionDirSink(BucketSink):
    """A sink whose `prepare` writes each push whole, as a session directory under `root`.

    Args:
        root: directory shared with the engines; by default a fresh private one under /dev/shm
            named `<prefix>...` (engines on this host), after the sweep of the directories
            that killed publishers left there, and removed on `close`.
    """

    def __init__(self, root: str | Path | None, prefix: str) -> None:
        self._owned_root = root is None
        self.root = private_shm_dir(prefix) if root is None else Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._sessions: list[Path] = []

    def _start(self, session_id: str) -> Path:
        """A new private directory to write session `session_id` into (not yet visible)."""
        tmp = self.root / f".tmp-{session_id}"
        tmp.mkdir(mode=0o700)
        return tmp

    def _write_files(
        self, session: PushSession, sending: Sending, files: list[FileLayout], progress: Progress
    ) -> None:
        """Every trainer rank writes its part of `files`; the session counts their digests.

        Raises:
            TrainerRankError: a rank failed, died or did not report (named).
            OSError: this rank could not write.
        """
        reports = self.everyone(sending, FilesOrder(files=files))
        sending.count_sent([report.sent_bytes for report in reports])
        shares = [report.digests for report in reports]
        session.digests.update(combine_shares(sending.layout, shares))
        session.count_sent(session.plan.total_bytes)
        progress(session.plan.total_bytes)

    def _publish(self, session_id: str) -> Path:
        """Make the written session visible at `<root>/<session_id>`, in one rename, and drop
        the sessions before it; returns its path."""
        # Readers only need to see whole sessions; durability across a host crash is not a
        # goal of a transport, so no fsync before the atomic rename.
        final = self.root / session_id
        (self.root / f".tmp-{session_id}").rename(final)
        self._drop_old_sessions(keep=final)
        return final

    def _drop_old_sessions(self, keep: Path | None) -> None:
        for path in self._sessions:
            shutil.rmtree(path, ignore_errors=True)
        self._sessions = [] if keep is None else [keep]

    def stream(
        self,
        session: PushSession,
        sending: Sending,
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        """Nothing to stream: `prepare` wrote the whole session."""

    def close(self) -> None:
        """Remove the kept session, and the root when this sink made it."""
        self._drop_old_sessions(keep=None)
        if self._owned_root:
            shutil.rmtree(self.root, ignore_errors=True)
