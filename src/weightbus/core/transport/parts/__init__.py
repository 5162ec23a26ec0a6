"""Parts several transports share (no transport of its own): a rank's parameters in one shared
memory file (`arena.py`) and the check of its offered layout (`layout.py`), GIL-free copies
(`copy.py`), weightbus files under /dev/shm (`shared_memory.py`), the ZMQ channel of the direct
transports (`direct_channel.py`), a background receiver of batches (`prefetch.py`) and push
deadlines (`deadlines.py`)."""
