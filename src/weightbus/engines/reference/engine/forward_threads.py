"""The forward pass's intra-op threads, and the core a staged receive takes while it runs.

A CPU rank runs its forward on all of its share of the cores (`torch.set_num_threads`). While
a push is received into staging, the receive thread verifies the bytes (and a co-located
trainer copies them): with every core also running a forward thread, the cores are
oversubscribed and each parallel section waits for its preempted thread, so the steps during
the receive took 3-6 times a decode step (`weightbus bench serving`, TP 1 on 2 cores). With
one thread fewer while the receive runs, the forward keeps its pace on the others and the
receive spreads over a few steps.
"""

import torch


class ForwardThreads:
    """Sets the forward's threads for the next step: `num_threads`, or one fewer (at least
    one) while a staged receive runs on this rank."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self.receiving_threads = max(1, num_threads - 1)

    def fit(self, *, receiving: bool) -> None:
        wanted = self.receiving_threads if receiving else self.num_threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
