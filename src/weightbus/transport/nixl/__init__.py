"""`nixl`: one-sided NIXL WRITEs of each rank's slices straight into its parameters, across
hosts, with no collective group (see `sink.py`)."""
