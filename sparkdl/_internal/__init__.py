"""sparkdl's internals: nothing here is public, and any of it may change in any release.

The public API is :mod:`sparkdl` (its ``__all__``), :mod:`sparkdl.data`, :mod:`sparkdl.ml`,
:mod:`sparkdl.compat` and :mod:`sparkdl.compat.petastorm`, pinned by ``tests/unit/test_public_api.py``.
Here, by concern (lowest layer first; ``tests/unit/test_layout.py`` keeps imports running one way):

- ``common``: the leaves every layer shares: errors, ``RunConfig``, argument checks, process trees;
- ``spark``: the Spark adapter: classic and Connect sessions, the ``spark.sparkdl.*`` confs, shared-directory checks;
- ``fs``: storage on any fsspec URL, and per-user private directories;
- ``wire``: the contract between driver, tasks and ranks: the rank spec, messages, the channel;
- ``backends`` (torch.distributed, TensorFlow) and ``horovod`` (Gloo and MPI backends, mpirun, HorovodRunner);
- ``train`` (checkpoints, ``TrainState``), ``rank`` (the rank process), ``data`` (datasets and loaders);
- ``task`` (the Spark task that starts a host's ranks), ``driver`` (``sparkdl.run``: launch, monitor, rerun);
- ``compat`` and ``ml`` (the drop-ins and Spark ML), ``cli`` (the ``sparkdl`` command).
"""
