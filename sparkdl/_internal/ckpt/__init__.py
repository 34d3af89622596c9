"""Checkpoints on shared storage: the store (:mod:`~sparkdl._internal.ckpt.store`: one file a
checkpoint, committed by its record, :mod:`~sparkdl._internal.ckpt.records`), the fence that keeps
stale attempts and second runs out (:mod:`~sparkdl._internal.ckpt.fence`), sharded checkpoints
(:mod:`~sparkdl._internal.ckpt.sharded`, their files: :mod:`~sparkdl._internal.ckpt.dcp_files`)
and the refusal of non-finite values (:mod:`~sparkdl._internal.ckpt.finite`). The rank's context
hands them out; the driver reads the store; the training loop (:mod:`sparkdl._internal.train`)
saves and restores through them."""
