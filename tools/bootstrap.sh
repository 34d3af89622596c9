#!/usr/bin/env bash
# Creates or reuses the venv of a stack at the repository root, with Java 17 on the machine.
# Sourced by tools/demo and tools/test; safe to run again (it does nothing when up to date).
#
#   bash tools/bootstrap.sh                                   # modern stack in .venv
#   SPARKDL_STACK=classic bash tools/bootstrap.sh             # classic stack (Spark 3.5, Petastorm) in .venv-classic
#   SPARKDL_WITH_HOROVOD=1 bash tools/bootstrap.sh            # and Horovod, built once by tools/build-horovod.sh
#
# Settings (environment variables):
#   SPARKDL_STACK          modern (default) or classic: the exact versions are in constraints/<stack>.txt
#   SPARKDL_VENV           the venv to create or reuse (default: .venv for modern, .venv-<stack> otherwise)
#   SPARKDL_WITH_HOROVOD   1: also install Horovod with PyTorch and Gloo (compiled once, ~3 min, then cached
#                          in SPARKDL_WHEEL_CACHE, default ~/.cache/sparkdl/wheels); default 0
#   SPARKDL_WITH_TENSORFLOW 1: also install TensorFlow's CPU build and tf-keras (modern stack only: the
#                          pins are in constraints/modern.txt; about 1.3 GB); default 0
#   SPARKDL_WITH_DALI      1: also install NVIDIA DALI (ImageDecoder(engine="dali"); modern stack only: the
#                          pins are in constraints/modern.txt; about 1 GB); default 0
#   SPARKDL_WITH_CHROMIUM  1: also install Debian's chromium, as root (tools/check_site.py renders the
#                          documentation site in it; tools/test sets it for its docs step); default 0
#   SPARKDL_TORCH          torch requirement to install first (default: torch==2.13.0, the CPU build here)
#   SPARKDL_TORCH_INDEX    a wheel index for torch, e.g. https://download.pytorch.org/whl/cu126 for a CUDA build
#   SPARKDL_PYTHON         the Python interpreter that creates the venv (default: python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${SPARKDL_STACK:-modern}"
case "$STACK" in
  modern) DEFAULT_VENV="$ROOT/.venv"; EXTRAS="dev,connect,docs" ;;
  # Petastorm needs pyarrow < 15, which only this stack has; its image codec writes with OpenCV.
  classic) DEFAULT_VENV="$ROOT/.venv-classic"; EXTRAS="dev,petastorm,petastorm-images" ;;
  *) echo "[bootstrap] SPARKDL_STACK=$STACK: choose modern or classic" >&2; exit 1 ;;
esac
VENV="${SPARKDL_VENV:-$DEFAULT_VENV}"
CONSTRAINTS="$ROOT/constraints/$STACK.txt"
WITH_HOROVOD="${SPARKDL_WITH_HOROVOD:-0}"
WITH_TENSORFLOW="${SPARKDL_WITH_TENSORFLOW:-0}"
WITH_CHROMIUM="${SPARKDL_WITH_CHROMIUM:-0}"
WITH_DALI="${SPARKDL_WITH_DALI:-0}"
TORCH_REQ="${SPARKDL_TORCH:-torch==2.13.0}"
TORCH_INDEX="${SPARKDL_TORCH_INDEX:-}"
PYTHON="${SPARKDL_PYTHON:-python3}"

log() { echo "[bootstrap] $*" >&2; }
# apt-get one at a time: tools/test sets both stacks up at once, and a second apt-get fails at
# once, rather than waits, while another holds dpkg's lock (build-horovod.sh takes the same turn).
apt_turn() { flock -w 900 "${TMPDIR:-/tmp}/.sparkdl-apt.lock" "$@"; }

java_major() {
  command -v java >/dev/null 2>&1 || { echo 0; return; }
  java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print (v[1] == "1" ? v[2] : v[1]); exit}'
}

ensure_java() {
  local major
  major="$(java_major)"
  if [ "${major:-0}" -ge 17 ] 2>/dev/null; then
    return
  fi
  log "Java 17 or newer is missing (found: ${major:-none}); installing openjdk-17-jre-headless"
  local sudo=""
  if [ "$(id -u)" != "0" ]; then
    command -v sudo >/dev/null 2>&1 || { log "not root and no sudo: install Java 17 and set JAVA_HOME, then rerun"; exit 1; }
    sudo="sudo"
  fi
  apt_turn $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt_turn $sudo apt-get install -y -q openjdk-17-jre-headless
  major="$(java_major)"
  [ "${major:-0}" -ge 17 ] || { log "Java install did not give Java 17 (found ${major:-none})"; exit 1; }
}

ensure_netns_tools() {
  # tests/test_netns_*.py build namespaced hosts with iproute2 (ip, ss); only root can, so only a
  # root run installs it (a non-root run skips those tests and says why).
  if [ "$(id -u)" != "0" ] || { command -v ip >/dev/null 2>&1 && command -v ss >/dev/null 2>&1; }; then
    return
  fi
  log "iproute2 is missing (ip, ss: the namespaced-host tests); installing it"
  apt_turn apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt_turn apt-get install -y -q iproute2
}

ensure_chromium() {
  # The documentation site's render check (tools/check_site.py); only root can install it, and a
  # non-root run says that the check does not run.
  [ "$WITH_CHROMIUM" = "1" ] || return 0
  command -v chromium >/dev/null 2>&1 && return 0
  if [ "$(id -u)" != "0" ]; then
    log "chromium is missing and this is not root: the site's render check will not run"
    return 0
  fi
  log "installing chromium (the documentation site's render check)"
  apt_turn apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt_turn apt-get install -y -q chromium >&2
}

# A venv set up here is kept as a template (a copy, not links), keyed by everything that decides
# its contents; a checkout without a venv (CI's fresh clone) starts from a copy of it: 40 s to copy
# the modern stack's 4.9 GB against about 290 s to install it (2026-11-29). SPARKDL_VENV_CACHE=0:
# neither kept nor used.
TEMPLATES="${SPARKDL_VENV_CACHE:-$HOME/.cache/sparkdl/venvs}"

template_of() {
  local key
  key="$({ cat "$ROOT/pyproject.toml" "$CONSTRAINTS" "$ROOT/tools/bootstrap.sh" "$ROOT/tools/build-horovod.sh" \
             "$ROOT/tools/pyspark_bytecode.py"
           echo "$STACK $TORCH_REQ $TORCH_INDEX $WITH_TENSORFLOW $WITH_DALI $WITH_HOROVOD"
           "$PYTHON" -VV; } | sha256sum | cut -c1-16)"
  echo "$TEMPLATES/$STACK-$key"
}

from_template() {
  # A venv from the template, when there is none and a template of the same key is: its scripts
  # (shebangs, activate) moved to this venv's path, and this checkout installed editable in it.
  [ "$TEMPLATES" != "0" ] && [ ! -e "$VENV" ] || return 0
  local template made_at tmp
  template="$(template_of)"
  [ -f "$template/.sparkdl-template" ] || return 0
  made_at="$(cat "$template/.sparkdl-template")"
  log "copying the $STACK venv kept with the same pins ($template) to $VENV"
  tmp="$VENV.copy-$$"
  rm -rf "$tmp"
  if ! cp -a "$template" "$tmp"; then
    rm -rf "$tmp"
    log "the copy failed; installing instead"
    return 0
  fi
  rm -f "$tmp/.sparkdl-template"
  grep -rlI --null -F "$made_at" "$tmp/bin" "$tmp/pyvenv.cfg" | xargs -0 -r sed -i "s|$made_at|$VENV|g"
  mv "$tmp" "$VENV"
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >&2
}

keep_template() {
  # After a set-up that made the venv by installing: this venv as the template of its key, the
  # stack's older templates removed (one per stack is kept).
  [ "$TEMPLATES" != "0" ] || return 0
  local template tmp
  template="$(template_of)"
  [ -f "$template/.sparkdl-template" ] && return 0
  mkdir -p "$TEMPLATES" 2>/dev/null || return 0
  tmp="$template.tmp-$$"
  rm -rf "$tmp"
  if cp -a "$VENV" "$tmp" && echo "$VENV" > "$tmp/.sparkdl-template"; then
    find "$TEMPLATES" -maxdepth 1 -name "$STACK-*" ! -name "*.tmp-*" -exec rm -rf {} + 2>/dev/null || true
    mv "$tmp" "$template" && log "kept this venv as the template for the next set-up with the same pins"
  else
    rm -rf "$tmp"
  fi
}

ensure_venv() {
  local stamp_file="$VENV/.sparkdl-stamp"
  local want
  want="$(cat "$ROOT/pyproject.toml" "$CONSTRAINTS" | sha256sum | cut -c1-16) $STACK $TORCH_REQ $TORCH_INDEX"
  if [ -x "$VENV/bin/python" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$want" ]; then
    return
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --upgrade "pip>=24" >&2
  # torch first and alone: a loose requirement elsewhere must not pull a CUDA build of several GB.
  if [ -n "$TORCH_INDEX" ]; then
    log "installing $TORCH_REQ from $TORCH_INDEX"
    "$VENV/bin/python" -m pip install -q --index-url "$TORCH_INDEX" "$TORCH_REQ" >&2
  else
    log "installing $TORCH_REQ"
    "$VENV/bin/python" -m pip install -q "$TORCH_REQ" >&2
  fi
  log "installing sparkdl[$EXTRAS] and its $STACK stack (constraints/$STACK.txt) in $VENV"
  # The torch pin in the constraints file is dropped when the user chose another build.
  local cfile
  cfile="$(mktemp)"
  grep -v '^torch==' "$CONSTRAINTS" > "$cfile"
  "$VENV/bin/python" -m pip install -q -c "$cfile" -e "$ROOT[$EXTRAS]" >&2
  rm -f "$cfile"
  echo "$want" > "$stamp_file"
}

ensure_tensorflow() {
  [ "$WITH_TENSORFLOW" = "1" ] && [ "$STACK" = "modern" ] || return 0
  local want
  want="$(grep -E '^(tensorflow-cpu|tf-keras)==' "$CONSTRAINTS" | tr '\n' ' ')"
  [ "$(cat "$VENV/.sparkdl-tensorflow" 2>/dev/null)" = "$want" ] && return 0
  log "installing TensorFlow (CPU build) and tf-keras in $VENV"
  # tf-keras names the full "tensorflow" distribution; with the CPU build in place it needs nothing
  # more, so it goes in without its dependencies.
  "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" tensorflow-cpu >&2
  "$VENV/bin/python" -m pip install -q --no-deps -c "$CONSTRAINTS" tf-keras >&2
  echo "$want" > "$VENV/.sparkdl-tensorflow"
}

ensure_dali() {
  [ "$WITH_DALI" = "1" ] && [ "$STACK" = "modern" ] || return 0
  local want
  want="$(grep -E '^nvidia-dali-cuda120==' "$CONSTRAINTS")"
  [ "$(cat "$VENV/.sparkdl-dali" 2>/dev/null)" = "$want" ] && return 0
  log "installing NVIDIA DALI in $VENV"
  "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" nvidia-dali-cuda120 >&2
  echo "$want" > "$VENV/.sparkdl-dali"
}

ensure_pyspark_bytecode() {
  # Spark's Python workers import pyspark from pyspark.zip, and Python caches no bytecode for a zip:
  # stored in it, their imports take about 0.5 s less CPU each (tools/pyspark_bytecode.py).
  "$VENV/bin/python" "$ROOT/tools/pyspark_bytecode.py"
}

ensure_jar_times() {
  # pip gives each file it installs the time of the install, and a JVM maps a class-data-sharing
  # archive (the tests make one of Spark's classes: tests/resources/jvm_archive.py) only while the
  # jars on its class path have the sizes and times recorded in it. With one fixed time, a venv
  # made again at the same path (a fresh clone of CI's checkout, a venv rebuilt after a change of
  # constraints) finds the archive made for the one before instead of making its own (40-90 s).
  local jars
  for jars in "$VENV"/lib/python3*/site-packages/pyspark/jars; do
    [ -d "$jars" ] && find "$jars" -maxdepth 1 -name '*.jar' -exec touch -h -d '@946684800' {} +  # 2000-01-01 UTC
  done
  return 0
}

ensure_project_bytecode() {
  # The checkout's own modules (sparkdl, installed editable; tests/resources, tools and jobs, which
  # the tests run as programs or import) load from source, and where PYTHONDONTWRITEBYTECODE is set
  # (this machine's environment, and so CI's) Python keeps none of what it compiles: every Spark
  # Python worker, zygote, CLI and job compiled sparkdl again (an import of it 0.31 s of CPU against
  # 0.15 s). Stored once here; Python checks each .pyc against its source's size and time, so an
  # edited module is compiled from source until the next run. Incremental: a rerun only stats.
  # A module that does not compile is left to its import, which names the error.
  "$VENV/bin/python" -m compileall -qq -j 0 "$ROOT/sparkdl" "$ROOT/tests" "$ROOT/tools" "$ROOT/jobs" \
    || log "some of the checkout's modules did not compile; they load from source"
}

ensure_horovod() {
  # It keeps its own stamp (Horovod, torch and Python versions): a rerun costs one Python start.
  [ "$WITH_HOROVOD" = "1" ] || return 0
  SPARKDL_STACK="$STACK" bash "$ROOT/tools/build-horovod.sh" "$VENV"
}

ensure_java
ensure_netns_tools
ensure_chromium
fresh="$([ -e "$VENV" ] && echo 0 || echo 1)"  # no venv here yet: the template's, or one installed now
from_template
[ "$fresh" = 1 ] && [ -f "$VENV/.sparkdl-stamp" ] && fresh=0  # copied from the template
ensure_venv
ensure_tensorflow
ensure_dali
ensure_pyspark_bytecode
ensure_jar_times
ensure_project_bytecode
# Read by tools/build-horovod.sh, so that a venv gets its own stack's pins.
[ "$(cat "$VENV/.sparkdl-stack" 2>/dev/null)" = "$STACK" ] || echo "$STACK" > "$VENV/.sparkdl-stack"
ensure_horovod
[ "$fresh" = 0 ] || keep_template
