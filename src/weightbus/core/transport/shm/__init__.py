"""`shm`: engines on the publisher's host read pushes from shared memory: `sink.py` (publisher),
`sender.py` and `direct.py` (every trainer rank's copies), `source.py` (engine rank). Nothing is
imported here: the registry loads the parts it needs."""
