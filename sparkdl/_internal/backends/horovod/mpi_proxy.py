"""The two small programs Open MPI runs for sparkdl (see :mod:`sparkdl._internal.backends.horovod.mpi`).

``python -m sparkdl._internal.backends.horovod.mpi_proxy agent NODE COMMAND...``: mpirun's remote shell. It starts no
shell: it asks the task of ``NODE``'s rank, over the run's authenticated channel, to start Open
MPI's daemon with ``COMMAND``'s arguments, prints the daemon's output, and exits with its exit
code. Its settings (the nodes' addresses, the secret) are in the 0600 file that
``SPARKDL_MPI_AGENT`` names.

``python -m sparkdl._internal.backends.horovod.mpi_proxy rank``: the program mpirun runs as each rank. It hands its
environment to its task over the Unix socket ``SPARKDL_MPI_PROXY`` names, then waits for the
rank's exit code and ends with it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import sys


def agent(node: str, command: list[str]) -> int:
    from sparkdl._internal.wire.channel import ChannelError, connect

    path = os.environ.get("SPARKDL_MPI_AGENT")
    if not path:
        print("sparkdl's MPI agent is started by mpirun in a sparkdl run, not by hand", file=sys.stderr)
        return 2
    with open(path) as f:
        config = json.load(f)
    if node not in config["nodes"]:
        print(f"sparkdl: mpirun asked for node {node!r}, which is not one of the gang's", file=sys.stderr)
        return 2
    host, port = config["nodes"][node]
    # mpirun gives the command as a remote shell would get it: one string, values quoted.
    argv = shlex.split(" ".join(command))
    try:
        conn = connect((host, int(port)), bytes.fromhex(config["key"]), float(config["timeout_s"]))
        conn.send({"daemon": argv})
        while (message := conn.recv()) is not None:
            if isinstance(message.get("out"), str):
                print(message["out"], file=sys.stderr, flush=True)
            if "exit" in message:
                return int(message["exit"])
    except (ChannelError, OSError) as exc:
        print(f"sparkdl: cannot reach the task of {node} at {host}:{port}: {exc}", file=sys.stderr)
        return 1
    print(f"sparkdl: the task of {node} ended while its MPI daemon ran", file=sys.stderr)
    return 1


def rank() -> int:
    address = os.environ.get("SPARKDL_MPI_PROXY")
    if not address:
        print("sparkdl's MPI proxy is started by Open MPI in a sparkdl run, not by hand", file=sys.stderr)
        return 2
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + address)
        sock.sendall(json.dumps(dict(os.environ)).encode() + b"\n")
        with sock.makefile("rb") as f:
            told = f.readline()
    if not told:
        return 1  # the task ended without word: its rank went with it
    code = int(json.loads(told)["code"])
    if code < 0:
        # Ended as the rank did, so that mpirun reports the signal.
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code & 0xFF


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "agent":
        return agent(argv[1], argv[2:])
    if argv == ["rank"]:
        return rank()
    print("usage: python -m sparkdl._internal.backends.horovod.mpi_proxy agent NODE COMMAND... | rank", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
