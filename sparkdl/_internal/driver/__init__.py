"""The driver side of a run: the public verbs (:mod:`~sparkdl._internal.driver.run`), the cluster checks,
the monitor and the pure failure policy, the failure report, and the two launchers (Spark
barrier tasks, :mod:`~sparkdl._internal.driver.spark`; processes on the driver, :mod:`~sparkdl._internal.driver.local`)."""
