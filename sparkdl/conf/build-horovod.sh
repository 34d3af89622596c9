#!/usr/bin/env bash
# Builds Horovod from its sdist against the torch of a venv, once, and installs it there.
#
#   tools/build-horovod.sh [VENV]          in a checkout (VENV defaults to $SPARKDL_VENV, else .venv)
#   bash "$(sparkdl conf build-horovod --path)" [VENV]   where sparkdl is installed (VENV defaults to
#                                                         the venv sparkdl is installed in)
#
# Horovod 0.28.1 ships as an sdist only, and as shipped it does not compile against torch >= 2.1:
# its CMake asks for C++14 and torch's headers need C++17. This script compiles it with C++17,
# the PyTorch extension and both controllers, Gloo and MPI (Open MPI from the system's packages:
# on Debian/Ubuntu it installs `openmpi-bin libopenmpi-dev`; elsewhere install an MPI whose
# compiler wrapper `mpicxx` is on the PATH, or build without MPI), and without TensorFlow or MXNet.
#
# The wheel is built once per (Horovod version, torch version, Python tag, platform, MPI) into a cache
# and reused: a second venv with the same torch and Python installs it in seconds. Rerunning
# against a venv that already has it does nothing (a stamp file in the venv).
#
# Settings (environment variables):
#   SPARKDL_STACK          which constraints/<stack>.txt pins Horovod and its dependencies (default: the
#                          stack tools/bootstrap.sh recorded in the venv, else modern); in a checkout only:
#                          installed from the wheel, Horovod $SPARKDL_HOROVOD_VERSION (default 0.28.1)
#                          is built with its build dependencies unpinned
#   SPARKDL_WHEEL_CACHE    where built wheels are kept (default: ~/.cache/sparkdl/wheels, shared by every
#                          checkout on the machine, so a fresh clone does not rebuild)
#   SPARKDL_BUILD_JOBS     parallel compile jobs (default: the number of CPUs)
#   HOROVOD_GPU_OPERATIONS passed to Horovod's build (e.g. NCCL, for a CUDA torch); part of the cache key
#   SPARKDL_HOROVOD_MPI    1 (default): build the MPI controller too; 0: Gloo only (no MPI needed). The
#                          MPI implementation and version are part of the cache key: the wheel links
#                          against that libmpi, which every executor then needs too
set -euo pipefail

# This file lives in sparkdl/conf/: in a checkout (tools/build-horovod.sh links to it) the
# repository is two levels up; installed, it sits in the site-packages of the venv to build for.
HERE="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
if [ -d "$ROOT/constraints" ]; then
  DEFAULT_VENV="$ROOT/.venv"
else
  ROOT=""
  DEFAULT_VENV="$(cd "$HERE/../../../../.." && pwd)"  # <venv>/lib/pythonX.Y/site-packages/sparkdl/conf
fi
VENV="$(realpath -m "${1:-${SPARKDL_VENV:-$DEFAULT_VENV}}")"
# tools/bootstrap.sh records the stack of each venv it makes.
VENV_STACK="$(cat "$VENV/.sparkdl-stack" 2>/dev/null || echo modern)"
STACK="${SPARKDL_STACK:-$VENV_STACK}"
CONSTRAINTS="${ROOT:+$ROOT/constraints/$STACK.txt}"
CACHE="${SPARKDL_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sparkdl/wheels}"
JOBS="${SPARKDL_BUILD_JOBS:-$(nproc)}"
GPU_OPS="${HOROVOD_GPU_OPERATIONS:-}"
WITH_MPI="${SPARKDL_HOROVOD_MPI:-1}"
# Bump when the build flags below change, so that wheels built the old way are not reused.
RECIPE=2
# A second build of the same key waits for the first one at most this long (a cold build took
# 4.4 minutes on 2 busy cores).
LOCK_WAIT_S="${SPARKDL_BUILD_LOCK_WAIT_S:-1800}"

log() { echo "[build-horovod] $*" >&2; }
die() { log "$*"; exit 1; }

PY="$VENV/bin/python"
[ -x "$PY" ] || die "no venv at $VENV: run tools/bootstrap.sh first (SPARKDL_STACK=$STACK)"
if [ -n "$CONSTRAINTS" ]; then
  [ -f "$CONSTRAINTS" ] || die "no constraints file $CONSTRAINTS (SPARKDL_STACK=$STACK)"
  [ "$STACK" = "$VENV_STACK" ] || die "$VENV holds the $VENV_STACK stack, but SPARKDL_STACK=$STACK"
  # The one place that says which Horovod each stack uses is its constraints file.
  HVD_VERSION="$(sed -n 's/^horovod==\([^[:space:]#]*\).*/\1/p' "$CONSTRAINTS" | head -n1)"
  [ -n "$HVD_VERSION" ] || die "$CONSTRAINTS pins no horovod==<version>"
else
  HVD_VERSION="${SPARKDL_HOROVOD_VERSION:-0.28.1}"
fi
# pip's constraints for what the build installs: the stack's pins without torch, or none.
constraints() {
  local cfile
  cfile="$(mktemp)"
  [ -z "$CONSTRAINTS" ] || grep -v '^torch==' "$CONSTRAINTS" > "$cfile"
  echo "$cfile"
}

# Cheap: reads package metadata, does not import torch.
read -r TORCH_VERSION PY_TAG PLATFORM < <("$PY" - <<'EOF'
import importlib.metadata as md
import sys
import sysconfig

try:
    torch_version = md.version("torch")
except md.PackageNotFoundError:
    torch_version = "none"
print(torch_version, f"cp{sys.version_info[0]}{sys.version_info[1]}",
      sysconfig.get_platform().replace("-", "_").replace(".", "_"))
EOF
)
[ "$TORCH_VERSION" != "none" ] || die "torch is not installed in $VENV; Horovod is built against it, so install torch first"
case "$WITH_MPI" in 0|1) ;; *) die "SPARKDL_HOROVOD_MPI=$WITH_MPI: choose 1 (Gloo and MPI) or 0 (Gloo only)" ;; esac

apt_install() {
  local sudo=""
  if [ "$(id -u)" != "0" ]; then
    command -v sudo >/dev/null 2>&1 || die "not root and no sudo: install $* with apt-get, then rerun"
    sudo="sudo"
  fi
  log "installing $* from Debian"
  # One apt-get at a time (tools/bootstrap.sh takes the same turn): a second one fails rather than
  # waits while another holds dpkg's lock, and tools/test sets two venvs up at once.
  local turn=(flock -w 900 "${TMPDIR:-/tmp}/.sparkdl-apt.lock")
  "${turn[@]}" $sudo apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive "${turn[@]}" $sudo apt-get install -y -q "$@" >&2
}

# "openmpi-4.1.4" or "mpich-4.0.2": which MPI the compiler wrapper on the PATH builds against.
mpi_flavour() {
  local v
  if v="$(mpirun --version 2>/dev/null | sed -n 's/^mpirun (Open MPI) \([0-9.]*\).*/\1/p' | head -n1)" && [ -n "$v" ]; then
    echo "openmpi-$v"
  elif v="$(mpichversion 2>/dev/null | sed -n 's/^MPICH Version:[[:space:]]*\([0-9.]*\).*/\1/p')" && [ -n "$v" ]; then
    echo "mpich-$v"
  fi
}

MPI=""
if [ "$WITH_MPI" = "1" ]; then
  if ! command -v mpicxx >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 \
      || die "no MPI here (mpicxx and mpirun not on the PATH): install Open MPI (or MPICH) with its development files, or set SPARKDL_HOROVOD_MPI=0 for Gloo only"
    apt_install openmpi-bin libopenmpi-dev
  fi
  MPI="$(mpi_flavour)"
  [ -n "$MPI" ] || die "mpirun on the PATH is neither Open MPI nor MPICH; put one first on the PATH, or set SPARKDL_HOROVOD_MPI=0"
fi

KEY="horovod-$HVD_VERSION-torch-$TORCH_VERSION-$PY_TAG-$PLATFORM-r$RECIPE"
[ -z "$GPU_OPS" ] || KEY="$KEY-gpu-$(echo "$GPU_OPS" | tr 'A-Z' 'a-z')"
KEY="$KEY-${MPI:-nompi}"
WHEEL_DIR="$CACHE/$KEY"
STAMP="$VENV/.sparkdl-horovod-stamp"

# The stamp alone would miss a `pip uninstall horovod`; the dist-info is as cheap to look at.
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] \
  && compgen -G "$VENV/lib/python*/site-packages/horovod-$HVD_VERSION.dist-info" >/dev/null; then
  exit 0
fi

cmake_ok() {
  # Horovod's setup.py otherwise downloads a CMake 3.13 with pip behind our back.
  command -v cmake >/dev/null 2>&1 || return 1
  local v
  v="$(cmake --version | sed -n 's/^cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
  read -r major minor <<<"$v"
  [ "${major:-0}" -gt 3 ] || { [ "${major:-0}" -eq 3 ] && [ "${minor:-0}" -ge 13 ]; }
}

find_wheel() {
  local w
  for w in "$WHEEL_DIR"/horovod-*.whl; do
    [ -f "$w" ] && { echo "$w"; return; }
  done
  return 0
}

build_wheel() {
  local missing=()
  cmake_ok || missing+=(cmake)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  command -v make >/dev/null 2>&1 || missing+=(make)
  [ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
  cmake_ok || die "cmake 3.13 or newer is needed to build Horovod"

  # Build-time needs of Horovod's setup.py, which --no-build-isolation does not fetch for us.
  local cfile
  cfile="$(constraints)"
  "$PY" -m pip install -q -c "$cfile" setuptools wheel packaging pyyaml cffi cloudpickle psutil >&2
  rm -f "$cfile"

  local work
  work="$(mktemp -d "${TMPDIR:-/tmp}/sparkdl-horovod-build.XXXXXX")"
  # shellcheck disable=SC2064  # expand $work now: it is local to this function
  trap "rm -rf '$work'" EXIT

  # Horovod's CMake pins C++14 (CMAKE_CXX_STANDARD, which wins over CXXFLAGS), torch >= 2.1's
  # headers need C++17: the compiler it calls rewrites the flag.
  local real_cxx
  real_cxx="$(command -v "${CXX:-g++}")"
  cat > "$work/cxx" <<EOF
#!/bin/sh
# Generated by sparkdl's tools/build-horovod.sh: $real_cxx with C++17 in place of C++14.
n=\$#
while [ "\$n" -gt 0 ]; do
  a=\$1; shift; n=\$((n - 1))
  case "\$a" in
    -std=c++14|-std=c++1y) a=-std=c++17 ;;
    -std=gnu++14|-std=gnu++1y) a=-std=gnu++17 ;;
  esac
  set -- "\$@" "\$a"
done
exec "$real_cxx" "\$@"
EOF
  chmod +x "$work/cxx"

  local mpi_flags=(HOROVOD_WITHOUT_MPI=1)
  [ -z "$MPI" ] || mpi_flags=(HOROVOD_WITH_MPI=1)
  log "building Horovod $HVD_VERSION against torch $TORCH_VERSION ($PY_TAG, ${MPI:-no MPI}, $JOBS jobs); this takes minutes"
  local start=$SECONDS
  # MAKEFLAGS also stops Horovod's setup.py from forcing -j8 on a small machine.
  # HOROVOD_GPU_OPERATIONS, when set, reaches the build from the environment.
  env CXX="$work/cxx" MAKEFLAGS="-j$JOBS" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 "${mpi_flags[@]}" \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    "$PY" -m pip wheel -q --no-build-isolation --no-deps --no-binary horovod \
      --no-cache-dir -w "$work/out" "horovod==$HVD_VERSION" >&2 \
    || die "the Horovod build failed (see the compiler output above)"
  local built
  built=""
  for built in "$work/out"/horovod-*.whl; do break; done
  [ -f "$built" ] || die "pip wheel produced no Horovod wheel"
  # A wheel without the torch extension would install and then fail at import: refuse it here.
  "$PY" -m zipfile -l "$built" | grep -q 'horovod/torch/mpi_lib_v2' \
    || die "the Horovod wheel has no PyTorch extension (horovod/torch/mpi_lib_v2)"
  # Published by rename, so a reader never sees half a wheel.
  mkdir -p "$WHEEL_DIR"
  cp "$built" "$WHEEL_DIR/.$(basename "$built").part"
  mv "$WHEEL_DIR/.$(basename "$built").part" "$WHEEL_DIR/$(basename "$built")"
  rm -rf "$work"
  trap - EXIT
  log "built $(basename "$built") in $((SECONDS - start)) s, cached in $WHEEL_DIR"
}

mkdir -p "$CACHE"
WHEEL="$(find_wheel)"
if [ -z "$WHEEL" ]; then
  # Two bootstraps at once (both stacks in CI, say) build the wheel once: the second waits.
  exec 9>"$CACHE/.$KEY.lock"
  # flock's lock dies with its holder: a leftover lock file never blocks anyone.
  flock -w "$LOCK_WAIT_S" 9 || die "another process is still building $KEY after ${LOCK_WAIT_S}s; wait for it or raise SPARKDL_BUILD_LOCK_WAIT_S"
  WHEEL="$(find_wheel)"
  if [ -z "$WHEEL" ]; then
    build_wheel
    WHEEL="$(find_wheel)"
  fi
  exec 9>&-
else
  log "reusing $WHEEL"
fi

# Its dependencies (cloudpickle, psutil, pyyaml, packaging, cffi) come pinned by the stack;
# torch is already there and is not a dependency of the wheel, so pip never replaces it.
cfile="$(constraints)"
"$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL" >&2
"$PY" -m pip install -q -c "$cfile" "$WHEEL" >&2
rm -f "$cfile"

SPARKDL_EXPECT_MPI="${MPI:+1}" "$PY" - <<'EOF' || die "Horovod installed in $VENV but does not work with torch, Gloo and MPI (see above)"
import os

import horovod.torch as hvd

if not hvd.gloo_built():
    raise SystemExit("horovod.torch was built without Gloo")
if os.environ.get("SPARKDL_EXPECT_MPI") and not hvd.mpi_built():
    raise SystemExit("horovod.torch was built without MPI")
EOF
echo "$KEY" > "$STAMP"
log "Horovod $HVD_VERSION installed in $VENV"
