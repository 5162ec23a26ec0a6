"""Parts several transports share (no transport of its own): a rank's parameters in shared
memory (`arena.py`) and the check of their layout (`layout.py`), files under /dev/shm
(`shared_memory.py`), the file transports' files and directories (`files.py`, `session_dir.py`),
the direct transports' ZMQ channel and sessions (`direct_channel.py`, `rank_session.py`), a
background receiver of batches (`prefetch.py`) and push deadlines (`deadlines.py`)."""
