"""The vocabulary every layer shares: the errors, ``RunConfig``, argument checks, how the drop-ins call the user's function."""
