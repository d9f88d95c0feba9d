#!/usr/bin/env bash
# One entry point for a fresh Debian machine with Python 3.11:
#   scripts/dev.sh demo [--stay]  set everything up, start a local control plane and run a whole
#                                 MoETrainingJob, then the same job planned from its routing statistics
#                                 (the bytes it saves; --quick: one job); --stay keeps the cluster up
#                                 afterwards (runs/demo/env.sh)
#   scripts/dev.sh down           stop the cluster `demo --stay` left running
#   scripts/dev.sh test           set everything up and run the whole test suite (what .ci/run calls;
#                                 tests/test_lint.py in it runs the lint below)
#   scripts/dev.sh lint           ruff check, ruff format --check and mypy (config in pyproject.toml)
#   scripts/dev.sh setup          only install (Debian packages, .venv, Python packages: the product
#                                 and, apart from it, the dev package operator/dev: local cluster,
#                                 demo, fake NVML, fault injection; the images install only the product)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv="$root/.venv"

need_apt=(etcd-server openssl xz-utils procps
          # real nodes (tests/test_realcluster.py): runtime, CNI, image builds, firewall rules
          containerd runc containernetworking-plugins docker.io mmdebstrap iptables iproute2 util-linux)

say() { echo "[setup] $*"; }
took() { local s=$(( SECONDS - $1 )); printf '%dm%02ds' $(( s / 60 )) $(( s % 60 )); }

apt_setup() {
  local missing=()
  for p in "${need_apt[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo="" t=$SECONDS; [ "$(id -u)" -eq 0 ] || sudo=sudo
  say "apt-get install ${missing[*]} (Debian packages: etcd for the local control plane, containerd/docker.io/mmdebstrap for the real nodes; a minute or two)"
  $sudo apt-get update -qq
  # No daemon may start from a package's postinst (docker.io, containerd): the tests start their
  # own, with their own data dirs. policy-rc.d exit 101 = "do not start services".
  local policy=/usr/sbin/policy-rc.d added=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null; $sudo chmod 755 "$policy"; added=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ -z "$added" ] || $sudo rm -f "$policy"
  say "  Debian packages done in $(took $t)"
}

py_setup() {
  local stamp="$venv/.moe-stamp" want t0=$SECONDS t
  want=$(cat pyproject.toml operator/dev/pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  say "installing Python packages into .venv, pinned in constraints.txt (once, and again when"
  say "pyproject.toml or constraints.txt change; the first time downloads ~1 GB and takes minutes)"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  t=$SECONDS; say "  1/3 pip, setuptools, wheel"
  "$venv/bin/pip" install -q --upgrade pip setuptools wheel
  say "      done in $(took $t)"
  # torch first: DeepSpeed's setup.py imports it (built with DS_BUILD_OPS=0, ops JIT-build on use).
  t=$SECONDS; say "  2/3 torch, CPU build (the largest download)"
  "$venv/bin/pip" install -q -c constraints.txt torch
  say "      done in $(took $t)"
  t=$SECONDS; say "  3/3 this project and its dev package (editable) with DeepSpeed, transformers, kopf, kubernetes, pytest, ruff, mypy, ..."
  DS_BUILD_OPS=0 "$venv/bin/pip" install -q --no-build-isolation -c constraints.txt -e ".[operator,trainer,test,lint]" -e operator/dev
  say "      done in $(took $t)"
  echo "$want" > "$stamp"
  say "Python packages ready in $(took $t0)"
}

setup() { apt_setup; py_setup; }

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; exec "$venv/bin/moe-demo" "$@" ;;
  up) setup; exec "$venv/bin/moe-demo" --stay "$@" ;;
  down) exec "$venv/bin/moe-demo" --stop "$@" ;;
  lint)
    setup
    rc=0
    "$venv/bin/ruff" check . || rc=1
    "$venv/bin/ruff" format --check . || rc=1
    "$venv/bin/mypy" || rc=1
    exit "$rc" ;;
  test)
    setup
    set +e
    "$venv/bin/python" -m pytest "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
    exit "$rc" ;;
  *) echo "usage: scripts/dev.sh {demo [--stay]|up|down|test|lint|setup} [args]" >&2; exit 2 ;;
esac
