"""Spark ML: the implementation of :mod:`sparkdl.ml`. The modules below the two classes, the scoring
function included, import where pyspark is not installed (``tools/gpu-check`` scores on a GPU
machine without Spark). Its modules, each importing only those listed before it:

- ``fit_plan``: the task and loss names, and the frozen :class:`~sparkdl._internal.ml.fit_plan.FitPlan` ranks get;
- ``params``: the Spark ML params and their converters;
- ``persistence``: ``save``/``load`` through Spark ML's writer and reader;
- ``columns``: column type checks, feature and label expressions, the data check of ``fit``;
- ``training``: what each rank runs (model, loss, optimizer, the epoch loop);
- ``probe``: the model tried on a few rows on the driver before training;
- ``scoring``: the Arrow scoring UDF and the per-worker model cache;
- ``model``: :class:`TorchModel`; ``estimator``: :class:`TorchEstimator`.
"""
