"""Checkpoints on shared storage (:mod:`~sparkdl.train.store`) and the resumable loop built on
them (:mod:`~sparkdl.train.state`). A rank's code imports these; the driver reads the store."""
