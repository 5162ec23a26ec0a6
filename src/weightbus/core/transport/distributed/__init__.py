"""`dist`: pushes over a torch.distributed weights group that spans hosts.

`group.py` (the group's life and its bounded operations), `sink.py` (publisher), `source.py`
(engine rank), `slices.py` (each rank's regions of a bucket, scatter mode). Nothing is imported
here: the registry loads the parts it needs, so torch.distributed loads only for `dist`.
"""
