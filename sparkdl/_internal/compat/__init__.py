"""The drop-ins' implementations (``TorchDistributor``, ``MirroredStrategyRunner``, their GPU checks); :mod:`sparkdl.compat` exports them."""
