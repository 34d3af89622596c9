"""Horovod, in one place: its Gloo and MPI backends of the rank, the task's mpirun, and the ``HorovodRunner`` drop-in."""
