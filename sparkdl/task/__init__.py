"""The Spark task side of a run: the barrier task (:mod:`~sparkdl.task.entry`), starting a rank
(:mod:`~sparkdl.task.rankproc`, :mod:`~sparkdl.task.spawn`) and the executor's warm zygote
(:mod:`~sparkdl.task.zygote`)."""
