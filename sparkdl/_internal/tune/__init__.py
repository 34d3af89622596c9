"""``sparkdl.tune``: hyperparameter searches whose trials are ``sparkdl.run`` gangs (:mod:`.search`)."""
