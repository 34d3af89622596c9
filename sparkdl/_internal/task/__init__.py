"""The Spark task side of a run: the barrier task (:mod:`~sparkdl._internal.task.entry`), starting a rank
(:mod:`~sparkdl._internal.task.rankproc`, :mod:`~sparkdl._internal.task.spawn`) and the executor's warm zygote
(:mod:`~sparkdl._internal.task.zygote`)."""
