"""A model that records, per process, every time it is unpickled and every forward call's batch
size (-> and the Connect client of tests/e2e/test_connect_ml.py: "loaded once per
Python worker, called on whole batches"). Its users register it to be pickled by value, so the
executors need not import it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


class RecordingNet(torch.nn.Module):
    def __init__(self, log_dir: str, n_in: int, n_out: int) -> None:
        super().__init__()
        self.log_dir = log_dir
        torch.manual_seed(3)
        self.linear = torch.nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(os.path.join(self.log_dir, f"forward-{os.getpid()}"), "a") as f:
            f.write(f"{len(x)}\n")
        return self.linear(x)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        with open(os.path.join(self.log_dir, f"load-{os.getpid()}"), "a") as f:
            f.write("load\n")


def per_pid(log_dir: Path, kind: str, *, skip_pid: int | None = None) -> dict[int, list[str]]:
    """What each process recorded of ``kind`` ("load" or "forward"), by pid."""
    found = {}
    for path in log_dir.glob(f"{kind}-*"):
        pid = int(path.name.split("-")[1])
        if pid != skip_pid:
            found[pid] = path.read_text().split()
    return found
