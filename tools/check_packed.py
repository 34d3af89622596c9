"""Executors that have nothing installed, given the job's venv as an archive (tools/check-wheel
runs this as root, with the venv it installed the wheel into; elsewhere it says why it cannot).

    .venv/bin/python tools/check_packed.py VENV

VENV: a venv outside this checkout with the sparkdl wheel (not editable) and venv-pack. Each step
is checked, and the first that fails ends the check with status 1:

1. ``VENV/bin/sparkdl pack`` packs VENV, without pyspark and py4j.
2. A namespaced cluster (tools/netns_cluster.py: a master and two workers, each a host of its own)
   on which this checkout, this venv and VENV are hidden: the workers have Spark and the system
   Python (which has neither torch, pyarrow nor sparkdl), nothing else.
3. ``sparkdl doctor`` with the executors on the system Python fails, naming torch, pyarrow and
   sparkdl missing on both hosts and the archive as the fix; with the archive it finds them.
4. A driver on VENV's Python runs tests/resources/netns_driver.py's ``packed`` scenario with
   ``spark.archives=<archive>#env`` and ``spark.pyspark.python=./env/bin/python``: two ranks on
   two hosts whose Python, torch and sparkdl come from the unpacked archive; a run whose rank on
   host 2 is SIGKILLed at step 7 reruns from its checkpoint on the archive's Python and ends with
   every step done. (That the resumed weights are bitwise equal to an uninterrupted run's is
   tests/cluster/test_netns_hosts.py's, on the same hosts with the same training function.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from netns_cluster import NetnsCluster  # noqa: E402

DRIVER = ROOT / "tests" / "resources" / "netns_driver.py"
# The interpreter this venv was made from: the "system Python" every host has.
SYSTEM_PYTHON: str = sys._base_executable  # type: ignore[attr-defined]
NEEDED = ("torch", "pyarrow", "sparkdl")


class CheckFailed(Exception):
    pass


def say(text: str) -> None:
    print(f"[check-packed] {text}", flush=True)


def check(ok: object, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def run(argv: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd="/")


def doctor(venv: Path, cluster: NetnsCluster, env: dict[str, str], conf: dict[str, str]) -> tuple[int, str]:
    confs = [arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")]
    out = run([str(venv / "bin" / "sparkdl"), "doctor", "--master", cluster.master_url, "-n", "2",
               "--timeout", "120", *confs], env, 300)
    return out.returncode, out.stdout + out.stderr


def row(text: str, name: str) -> str:
    """The doctor table's row of ``name``."""
    return next((line for line in text.splitlines() if line.split()[:1] == [name]), "")


def main(venv: Path) -> None:
    work = Path(f"/var/tmp/sparkdl-packed-{time.strftime('%H%M%S')}")
    work.mkdir(mode=0o700)
    archive = work / "env.tar.gz"
    try:
        started = time.monotonic()
        out = run([str(venv / "bin" / "sparkdl"), "pack", "-o", str(archive), "--compress-level", "1"],
                  dict(os.environ), 300)
        check(out.returncode == 0, f"sparkdl pack failed:\n{out.stdout}{out.stderr}")
        with tarfile.open(archive) as tar:
            names = tar.getnames()
        site = next(n for n in names if n.endswith("/site-packages/sparkdl/__init__.py")).rsplit("/", 2)[0]
        inside = {n.split("/")[len(site.split("/"))] for n in names if n.startswith(site + "/")}
        check({"torch", "pyarrow", "sparkdl"} <= inside and not inside & {"pyspark", "py4j"},
              f"the archive's {site}: {sorted(inside)[:40]}")
        say(f"packed {venv}: {archive.stat().st_size / 2**20:,.0f} MiB in {time.monotonic() - started:.0f} s, "
            f"{len(names):,} files: torch, pyarrow, sparkdl in, pyspark and py4j out")
        hide = [ROOT, Path(sys.prefix), venv]
        with NetnsCluster(2, cores=1, memory="1g", python="./env/bin/python", hide=hide, tmp_size="4g") as cluster:
            scenario(venv, cluster, archive)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def scenario(venv: Path, cluster: NetnsCluster, archive: Path) -> None:
    bare = cluster.exec(0, [SYSTEM_PYTHON, "-c", "import importlib.util as u, sys; "
                            f"print([m for m in {list(NEEDED)} if u.find_spec(m)], sys.prefix)"])
    check(bare.returncode == 0 and bare.stdout.startswith("[]"),
          f"the workers' system Python finds some of {NEEDED}: {bare.stdout}{bare.stderr}")
    for path in (ROOT, venv, Path(sys.prefix)):
        seen = cluster.exec(0, ["ls", "-A", str(path)])
        check(seen.stdout.strip() == "", f"worker 0 sees {path}: {seen.stdout[:200]}")
    say(f"workers: {SYSTEM_PYTHON} without {', '.join(NEEDED)}; this checkout, its venv and {venv} hidden")
    python = str(venv / "bin" / "python")
    # sparkdl doctor, a Python program, takes the executors' Python from --conf spark.pyspark.python;
    # a driver started as `python job.py` from PYSPARK_PYTHON (pyspark reads no conf for it).
    env = {k: v for k, v in cluster.driver_env().items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    base = {**cluster.driver_conf(), "spark.executor.memory": "512m", "spark.pyspark.driver.python": python,
            "spark.sparkdl.runDir": f"{cluster.shared}/runs", "spark.sparkdl.cacheDir": f"{cluster.shared}/cache"}

    code, text = doctor(venv, cluster, env, {**base, "spark.pyspark.python": SYSTEM_PYTHON})
    hosts = [h.address for h in cluster.hosts]
    for name in NEEDED:
        check("missing on 2/2" in row(text, name), f"doctor on bare executors: no 'missing on 2/2' for {name}\n{text}")
    check(code == 1 and "sparkdl pack" in text and all(h in text for h in hosts),
          f"doctor on bare executors: exit {code}, or the fix or a host not named\n{text}")
    say("doctor, executors on the system Python: exit 1; torch, pyarrow, sparkdl missing on both hosts; fix: sparkdl pack")

    packed = {**base, "spark.archives": f"{archive}#env", "spark.pyspark.python": "./env/bin/python"}
    code, text = doctor(venv, cluster, env, packed)
    for name in NEEDED:
        check(row(text, name) and "missing" not in row(text, name), f"doctor with the archive: {name}\n{text}")
    check(code == 0, f"doctor with the archive: exit {code}\n{text}")
    say("doctor with the archive: exit 0; torch, pyarrow, sparkdl found on both hosts")

    params = {"shared": str(cluster.shared), "host2": cluster.hosts[1].address, "conf": packed,
              "start_timeout_s": 180}
    started = time.monotonic()
    out = run([python, str(DRIVER), "packed", json.dumps(params)], {**env, "PYSPARK_PYTHON": "./env/bin/python"}, 600)
    found = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    check(out.returncode == 0 and found, f"the packed scenario failed ({out.returncode}):\n{(out.stdout + out.stderr)[-6000:]}")
    result: dict[str, Any] = json.loads(found[-1].split(" ", 1)[1])
    origins = result["origins"]
    check(sorted(o["host"] for o in origins) == sorted(hosts), f"ranks not on both hosts: {origins}")
    for o in origins:
        for what in ("python", "torch", "sparkdl"):
            check(o[what].startswith("/tmp/spark-work/") and "/env/" in o[what],
                  f"rank {o['rank']}'s {what} is not the unpacked archive's: {o[what]}")
    kill = result["sigkill"]
    check(kill["attempt"] == 1 and kill["restored_from"] is not None and kill["steps"] == kill["expected_steps"],
          f"the SIGKILLed run did not rerun from a checkpoint to its last step: {kill}")
    say(f"2 ranks on {', '.join(hosts)} ran the archive's Python ({origins[0]['python']}); rank on host 2 "
        f"SIGKILLed at step 7: rerun from its checkpoint {kill['restored_from']} to step {kill['steps']} "
        f"({time.monotonic() - started:.0f} s for the two runs)")

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    if reason := NetnsCluster.available():
        say(f"not run: {reason}")
        sys.exit(0)
    try:
        main(Path(sys.argv[1]).resolve())
    except CheckFailed as exc:
        say(f"FAILED: {exc}")
        sys.exit(1)
    say("passed")
