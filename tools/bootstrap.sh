#!/usr/bin/env bash
# Creates or reuses .venv at the repository root, with Java 17 on the machine.
# Sourced by tools/demo and tools/test; safe to run again (it does nothing when up to date).
#
# Settings (environment variables):
#   SPARKDL_TORCH          torch requirement to install first (default: torch==2.13.0, the CPU build here)
#   SPARKDL_TORCH_INDEX    a wheel index for torch, e.g. https://download.pytorch.org/whl/cu126 for a CUDA build
#   SPARKDL_PYTHON         the Python interpreter that creates the venv (default: python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPARKDL_VENV:-$ROOT/.venv}"
STACK="${SPARKDL_STACK:-modern}"
CONSTRAINTS="$ROOT/constraints/$STACK.txt"
TORCH_REQ="${SPARKDL_TORCH:-torch==2.13.0}"
TORCH_INDEX="${SPARKDL_TORCH_INDEX:-}"
PYTHON="${SPARKDL_PYTHON:-python3}"

log() { echo "[bootstrap] $*" >&2; }

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
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q openjdk-17-jre-headless
  major="$(java_major)"
  [ "${major:-0}" -ge 17 ] || { log "Java install did not give Java 17 (found ${major:-none})"; exit 1; }
}

ensure_venv() {
  local stamp_file="$VENV/.sparkdl-stamp"
  local want
  want="$(cat "$ROOT/pyproject.toml" "$CONSTRAINTS" | sha256sum | cut -c1-16) $TORCH_REQ $TORCH_INDEX"
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
  log "installing sparkdl and its $STACK stack (constraints/$STACK.txt)"
  # The torch pin in the constraints file is dropped when the user chose another build.
  local cfile
  cfile="$(mktemp)"
  grep -v '^torch==' "$CONSTRAINTS" > "$cfile"
  "$VENV/bin/python" -m pip install -q -c "$cfile" -e "$ROOT[dev]" >&2
  rm -f "$cfile"
  echo "$want" > "$stamp_file"
}

ensure_java
ensure_venv
