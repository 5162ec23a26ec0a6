"""`dist`: pushes over a torch.distributed weights group that spans hosts.

`group.py` (the group's life and its bounded operations), `setup.py` (forming and leaving it),
`handshake.py` (a push starts only once every engine rank is ready), `sink.py` (the trainer
group's leader), `sender.py` (every trainer rank: join, digest, send a session), `session.py`
(one session's sends), `schedule.py` (who sends which part, parts mode), `trainer_ranks.py`
(the trainer ranks joining and failing), `source.py` (engine rank), `slices.py` and `parts.py`
(each engine rank's regions of a bucket, and receiving them in parts). Nothing is imported
here: the registry loads the parts it needs, so torch.distributed loads only for `dist`.
"""
