"""`shm`: engines on the publisher's host read pushes from shared memory.

`sink.py` (publisher), `source.py` (engine rank), `direct.py` (the publisher's copies straight
into ranks' parameters). Nothing is imported here: the registry loads the parts it needs.
"""
