"""The rank process (:mod:`sparkdl.rank.main`) and what user code asks of it
(:mod:`sparkdl.rank.context`). Nothing here imports torch or pyspark at import time."""
