"""`nixl`: one-sided NIXL WRITEs of each rank's slices straight into its parameters, and of the
tensors that are not parameters (a delta push's payload) whole into the rank's inbox, across
hosts, with no collective group (see `sink.py`)."""
