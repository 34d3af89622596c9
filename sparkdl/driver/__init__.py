"""The driver side of a run: the public verbs (:mod:`~sparkdl.driver.run`), the cluster checks,
the monitor and the pure failure policy, the failure report, and the two launchers (Spark
barrier tasks, :mod:`~sparkdl.driver.spark`; processes on the driver, :mod:`~sparkdl.driver.local`)."""
