#!/usr/bin/env bash
# Builds deploy/container/Containerfile and runs sparkdl in the image, on a machine that reaches
# Debian's and PyPI's mirrors but no container registry (as root: this repository's CI machine).
# Not part of CI: it downloads about 1.5 GB and takes 5 to 10 minutes.
#
#   sudo deploy/container/try-here.sh
#
# 1. debootstrap makes Debian bookworm's minbase from the apt mirror; `podman import` makes it an image.
# 2. buildah builds Containerfile.debian-spark on it (a stand-in for Spark's image: Java 17, Python,
#    pip's Spark, user spark uid 185), then the Containerfile with sparkdl's wheel and the modern
#    stack's pins, torch's CPU wheel from this machine's wheel directory.
# 3. A container of the image (buildah run, as uid 185) runs `sparkdl --version`, `sparkdl doctor`
#    on local[2] and a 2-rank sparkdl.run.
#
# Builds use buildah's chroot isolation, and the container runs the same way: this sandbox refuses
# the rlimits that podman's runtime (crun) sets (`setrlimit RLIMIT_NOFILE: Operation not
# permitted`), so `podman run` does not work here. The machine's CA bundle is mounted into the
# builds: its package mirrors are reached through a proxy whose certificate only that bundle has.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORK="${SPARKDL_CONTAINER_WORK:-/var/tmp/sparkdl-container}"
BASE=localhost/debian-bookworm-minbase:debootstrap
CA=/etc/ssl/certs/ca-certificates.crt
log() { echo "[try-here] $*" >&2; }
[ "$(id -u)" = 0 ] || { log "run as root (debootstrap, buildah)"; exit 2; }
for tool in debootstrap podman buildah; do
  command -v "$tool" >/dev/null || { log "installing $tool"; DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$tool" >&2; }
done
mkdir -p "$WORK"
if ! podman image exists "$BASE"; then
  log "debootstrap: Debian bookworm minbase"
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$WORK/rootfs" http://deb.debian.org/debian >&2
  cp /etc/apt/sources.list.d/debian.sources "$WORK/rootfs/etc/apt/sources.list.d/" 2>/dev/null || true
  tar -C "$WORK/rootfs" -c . | podman import - "$BASE" >&2
  rm -rf "$WORK/rootfs"
fi
mounts=(-v "$CA:$CA:ro")
torch_from=()
if ls /opt/wheels/torch-*.whl >/dev/null 2>&1; then  # this machine's CPU wheel of torch
  mounts+=(-v /opt/wheels:/opt/wheels:ro)
  torch_from=(--build-arg "TORCH_FROM=--find-links /opt/wheels")
fi
log "building the Spark stand-in, then the sparkdl image"
buildah bud --isolation chroot --network host "${mounts[@]}" -f "$HERE/Containerfile.debian-spark" \
  -t localhost/spark-standin:4.3.0 "$HERE" >&2
rm -rf "$HERE/dist"
"$ROOT/.venv/bin/python" -m build --wheel --no-isolation --outdir "$HERE/dist" "$ROOT" >/dev/null
rm -rf "$ROOT/build"
cp "$ROOT/constraints/modern.txt" "$HERE/dist/constraints.txt"
buildah bud --isolation chroot --network host "${mounts[@]}" --build-arg BASE=localhost/spark-standin:4.3.0 \
  "${torch_from[@]}" -t localhost/sparkdl:latest "$HERE" >&2
rm -rf "$HERE/dist"
log "running sparkdl in a container of the image (uid 185)"
ctr="$(buildah from localhost/sparkdl:latest)"
trap 'buildah rm "$ctr" >/dev/null' EXIT
buildah run --isolation chroot --network host "$ctr" -- bash -c '
set -e
export SPARK_LOCAL_IP=127.0.0.1
cd /tmp
echo "uid $(id -u), $(sparkdl --version)"
timeout 300 sparkdl doctor --master "local[2]" -n 2 --timeout 120 | tail -1
timeout 300 python3 - <<PY
import sparkdl
from pyspark.sql import SparkSession
def fn(x):
    import torch, torch.distributed as dist
    t = torch.tensor([float(sparkdl.context().rank + x)])
    dist.all_reduce(t)
    return {"world": dist.get_world_size(), "sum": t.item(), "module": sparkdl.__file__}
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
out = sparkdl.run(fn, 10, num_workers=2, config=sparkdl.RunConfig(progress=False, echo_logs=False))
spark.stop()
assert out["world"] == 2 and out["sum"] == 21.0, out
print("a 2-rank run in the image:", out)
PY
'
log "ok: localhost/sparkdl:latest"
