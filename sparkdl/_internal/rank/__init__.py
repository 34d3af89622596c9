"""The rank process (:mod:`sparkdl._internal.rank.main`) and what user code asks of it
(:mod:`sparkdl._internal.rank.context`). Nothing here imports torch or pyspark at import time."""
