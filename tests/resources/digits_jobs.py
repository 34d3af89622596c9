"""What the digits jobs (jobs/train.py, jobs/inference.py) leave behind when they ran right, checked
the same way wherever they were submitted (tests/cluster/test_netns_hosts.py, test_standalone.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def check_trained(model: Path, output: str) -> dict[str, Any]:
    """The train job's summary, metrics and progress line (``output``: its stdout and stderr);
    returns the summary."""
    summary: dict[str, Any] = json.loads((model / "summary.json").read_text())
    assert summary["accuracy"] >= 0.85 and summary["test_rows"] == 352
    assert summary["num_workers"] == 2 and summary["attempts"] == 1
    assert summary["epoch_loss"][-1] < summary["epoch_loss"][0] / 4
    metrics = [json.loads(line) for line in (model / "metrics.jsonl").read_text().splitlines()]
    assert {m["rank"] for m in metrics} == {0, 1}
    # spark-submit's PythonRunner merges the Python driver's stderr into its stdout.
    assert "sparkdl progress:" in output
    return summary


def check_scored(predictions: Path, summary: dict[str, Any]) -> None:
    """The inference job's predictions of the 352 test rows, as accurate as training said."""
    import pyarrow.parquet as pq

    table = pq.read_table(predictions)
    assert table.num_rows == 352 and {"id", "features", "label", "prediction"} <= set(table.column_names)
    labels, scores = table.column("label").to_pylist(), table.column("prediction").to_pylist()
    accuracy = sum(float(a) == b for a, b in zip(labels, scores, strict=True)) / len(labels)
    assert accuracy == pytest.approx(summary["accuracy"])
