#!/usr/bin/env bash
# One entry point for a fresh Debian machine with Python 3.11:
#   scripts/dev.sh demo   set everything up, start a local control plane and run a whole MoETrainingJob
#   scripts/dev.sh test   set everything up and run the whole test suite (what .ci/run calls)
#   scripts/dev.sh setup  only install (Debian packages, .venv, Python packages)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv="$root/.venv"

need_apt=(etcd-server openssl xz-utils procps)

apt_setup() {
  local missing=()
  for p in "${need_apt[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "[setup] apt-get install ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

py_setup() {
  local stamp="$venv/.moe-stamp" want
  want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  echo "[setup] installing Python packages into .venv (pinned in constraints.txt)"
  "$venv/bin/pip" install -q --upgrade pip setuptools wheel
  # torch first: DeepSpeed's setup.py imports it (built with DS_BUILD_OPS=0, ops JIT-build on use).
  "$venv/bin/pip" install -q -c constraints.txt torch
  DS_BUILD_OPS=0 "$venv/bin/pip" install -q --no-build-isolation -c constraints.txt -e ".[operator,trainer,test]"
  echo "$want" > "$stamp"
}

setup() { apt_setup; py_setup; }

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; exec "$venv/bin/moectl" demo "$@" ;;
  test)
    setup
    set +e
    "$venv/bin/python" -m pytest "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
    exit "$rc" ;;
  *) echo "usage: scripts/dev.sh {demo|test|setup} [args]" >&2; exit 2 ;;
esac
