"""A real FTP server (pyftpdlib) on 127.0.0.1 for the tests of remote storage: a user with every
right on a directory; stopped, and fsspec's cached clients dropped, at the end."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def ftp_server(root: Path, perm: str = "elradfmw") -> Iterator[str]:
    """Serves ``root``; yields ``ftp://trainer:s3cret@127.0.0.1:<port>``. ``perm``: pyftpdlib's rights
    (the default reads and writes; "elr" only reads)."""
    from fsspec.implementations.ftp import FTPFileSystem

    with warnings.catch_warnings():  # pyftpdlib imports asyncore/asynchat, deprecated in 3.11
        warnings.simplefilter("ignore", DeprecationWarning)
        from pyftpdlib.authorizers import DummyAuthorizer
        from pyftpdlib.handlers import FTPHandler
        from pyftpdlib.servers import FTPServer

    logging.getLogger("pyftpdlib").setLevel(logging.WARNING)
    authorizer = DummyAuthorizer()
    authorizer.add_user("trainer", "s3cret", str(root), perm=perm)
    handler = type("Handler", (FTPHandler,), {"authorizer": authorizer, "timeout": 30})
    server = FTPServer(("127.0.0.1", 0), handler)
    port = server.socket.getsockname()[1]
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"timeout": 0.2, "handle_exit": False}, name="ftp", daemon=True
    )
    thread.start()
    try:
        yield f"ftp://trainer:s3cret@127.0.0.1:{port}"
    finally:
        FTPFileSystem.clear_instance_cache()  # fsspec keeps client connections per host
        server.close_all()
        thread.join(10)
        assert not thread.is_alive()
