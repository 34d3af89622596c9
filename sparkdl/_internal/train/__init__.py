"""Checkpoints on shared storage (:mod:`~sparkdl._internal.train.store`) and the resumable loop built on
them (:mod:`~sparkdl._internal.train.state`). A rank's code imports these; the driver reads the store."""
