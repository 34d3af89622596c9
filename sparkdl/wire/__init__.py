"""What travels between the driver and the Spark tasks of a run: the authenticated channel
(:mod:`sparkdl.wire.channel`) and the typed messages it carries (:mod:`sparkdl.wire.messages`)."""
