"""Every ``spark.sparkdl.*`` conf the package reads is in :mod:`sparkdl._internal.spark.confs`, which the
documentation's settings page is generated from: a new conf cannot go undocumented."""

from __future__ import annotations

import re

from conftest import REPO

from sparkdl._internal.spark import confs


def test_every_spark_sparkdl_conf_named_in_the_package_is_registered() -> None:
    registered = {c.name for c in confs.ALL}
    named = set()
    for path in (REPO / "sparkdl").rglob("*.py"):
        named |= set(re.findall(r"spark\.sparkdl\.[A-Za-z][A-Za-z.]*[A-Za-z]", path.read_text()))
    assert named, "no spark.sparkdl.* name found: the scan is broken"
    assert named <= registered, f"not in sparkdl/_internal/spark/confs.py: {sorted(named - registered)}"
    assert all(c.default and c.what for c in confs.ALL)
