"""The resumable training loop (:mod:`~sparkdl._internal.train.state`: ``TrainState``) and Keras's
callbacks (:mod:`~sparkdl._internal.train.keras`), built on the rank's context and its checkpoints
(:mod:`sparkdl._internal.ckpt`). A rank's code imports these."""
