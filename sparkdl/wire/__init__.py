"""What travels between the driver and the Spark tasks of a run: the authenticated channel
(:mod:`sparkdl.wire.channel`; the driver's listening side, :mod:`sparkdl.wire.server`) and the
typed messages it carries (:mod:`sparkdl.wire.messages`)."""
