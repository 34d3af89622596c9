"""What travels between the driver and the Spark tasks of a run: the authenticated channel
(:mod:`sparkdl._internal.wire.channel`; the driver's listening side, :mod:`sparkdl._internal.wire.server`) and the
typed messages it carries (:mod:`sparkdl._internal.wire.messages`)."""
