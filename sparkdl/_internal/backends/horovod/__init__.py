"""Horovod as a backend: its Gloo and MPI setup in the rank (``hvd.py``, ``horovod_gloo.py``,
``horovod_mpi.py``) and the MPI job the gang's tasks form (``mpi.py``; ``mpi_proxy.py``: mpirun's
agent and each rank's proxy). The ``HorovodRunner`` drop-in is with the other drop-ins, in
:mod:`sparkdl._internal.compat`."""
