"""`dist`: pushes over a torch.distributed weights group that spans hosts (`sink.py` tells how).
Nothing is imported here: the registry loads the parts it needs, so torch.distributed loads
only for `dist`."""
