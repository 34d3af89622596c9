"""The notebooks in notebooks/: stored without outputs, and executed cell by cell on a kernel that
runs this venv's Python, as CI does. A failing cell fails the test with the cell's traceback.

The kernel is a real ipykernel process started by nbclient from a kernelspec written to a temp
JUPYTER_PATH; the notebooks start their own loopback Spark session inside it and stop it at the end.
connect.ipynb is a Spark Connect client: without SPARK_REMOTE it starts a Connect server of its own
(tools/connect_server.py) and stops it in its last cell; it runs on the modern stack (pyspark 4)
and is skipped, with the reason, on the classic one.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO
from connect_server import connect_available

NOTEBOOKS = REPO / "notebooks"
NAMES = ["quickstart", "pipeline", "images", "connect"]
# The last cell ends the Spark session the notebook started (and the Connect server it started).
LAST_CELL = {"connect": "spark.stop()\nif server is not None:  # the Connect server this notebook started\n    server.cleanup()"}
KERNEL = "sparkdl-test-venv"
CELL_TIMEOUT_S = 240


def test_the_notebooks_exist() -> None:
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_without_outputs(name: str) -> None:
    import nbformat

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}.ipynb cell {i} has stored outputs: clear them"
            assert cell.execution_count is None, f"{name}.ipynb cell {i} has an execution count: clear it"
    # The last cell ends the Spark session the notebook started.
    assert nb.cells[-1].source.strip() == LAST_CELL.get(name, "spark.stop()")


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def venv_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernelspec that runs this interpreter, visible to jupyter_client through JUPYTER_PATH."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "sparkdl venv (tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # Runtime files (connection files) go to the temp dir too, not to the user's home.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    return KERNEL


@pytest.mark.spark
@pytest.mark.timeout(600)
@pytest.mark.one_stack("modern", "the notebooks are programs of the public API, whose paths tests/integration walks "
                        "on both stacks; connect.ipynb needs pyspark 4")
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name: str, venv_kernel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    if name == "connect":
        if reason := connect_available():
            pytest.skip(reason)
        monkeypatch.delenv("SPARK_REMOTE", raising=False)  # the notebook starts its own server
    assert KernelSpecManager().get_kernel_spec(venv_kernel).argv[0] == sys.executable
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("SPARKDL_NOTEBOOK_DIR", str(work))
    before = _descendants()
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        nb,
        kernel_name=venv_kernel,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=60,
        allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails

    outputs = "\n".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )
    if name == "quickstart":
        assert "held-out accuracy" in outputs
        assert "reloaded model gives the same predictions: True" in outputs
        assert (work / "digits-model" / "metadata").is_dir() and (work / "digits-model.pt").is_file()
        # The live progress line reached the notebook (ipykernel: a display that updates in place).
        displays = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
                    if out.get("output_type") in ("display_data", "update_display_data")]
        assert any("sparkdl progress" in json.dumps(out.get("data", {})) for out in displays), "no progress display"
        # The plot cell drew a figure.
        assert any("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))
    elif name == "pipeline":
        assert "the loaded pipeline gives the same predictions: True" in outputs
        assert "held-out accuracy of the custom loop" in outputs
    elif name == "images":
        assert "held-out accuracy:" in outputs and "on 360 images" in outputs
        # The ranks' epochs came back to the kernel, and the fitted pipeline was saved.
        assert "[rank 0] epoch 5/5" in outputs
        assert (work / "digit-cnn" / "metadata").is_dir() and len(list((work / "digit-images").glob("*/*.png"))) == 1797
    else:
        assert "over Spark Connect (pyspark.sql.connect.session); the server's master: local[2]" in outputs
        assert "held-out accuracy over Spark Connect" in outputs
        # The ranks ran on the server's executors; their output came back to the kernel, tagged.
        assert "[rank 0] epoch 5: mean loss" in outputs and "[rank 1] epoch 5: mean loss" in outputs
        from sparkdl._internal.data.format.manifest import MANIFEST_NAME

        assert (work / "digits-train" / MANIFEST_NAME).is_file()  # written by the server's executors
        # The server the notebook started is stopped by its last cell: nothing listens there.
        port = int(re.search(r"Spark Connect server: sc://127\.0\.0\.1:(\d+)", outputs).group(1))  # type: ignore[union-attr]
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass

    # The kernel, its Spark JVM and every rank are gone once nbclient has shut the kernel down.
    deadline = time.monotonic() + 30
    while (left := _descendants() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left after the notebook: {[psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]}"
