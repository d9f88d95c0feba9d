#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager, kube-scheduler and kubelet v1.20.2 offline from Debian
# bookworm's `kubernetes` source package (its vendor/ tree makes the build offline), the recipe
# in ../shared/k8s/README.md, and `pause` (the pod sandbox's program: a static build of the source
# tree's build/pause/linux/pause.c). ~7 min on 2 cores for the control plane, ~14 more for the
# kubelet; peak RSS ~1.4 GB; needs root for apt-get.
#
#   build_kube.sh OUT_DIR  -> OUT_DIR/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,pause,SHA256SUMS}
set -euo pipefail
out=${1:?usage: build_kube.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
version=v1.20.2
work=$(mktemp -d "${TMPDIR:-/tmp}/moe-kube-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo

# 1. deb-src for bookworm (same URI and key as the existing deb stanza), toolchain, source.
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
  src=/etc/apt/sources.list.d/debian.sources
  if [ -f "$src" ]; then
    uri=$(awk '/^URIs:/{print $2; exit}' "$src")
    key=$(awk '/^Signed-By:/{print $2; exit}' "$src")
  else
    uri=http://deb.debian.org/debian
    key=/usr/share/keyrings/debian-archive-keyring.gpg
  fi
  printf 'Types: deb-src\nURIs: %s\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: %s\n' \
    "$uri" "$key" | $sudo tee /etc/apt/sources.list.d/moe-deb-src.sources >/dev/null
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq dpkg-dev golang-1.19-go rsync gcc libc6-dev >/dev/null
export PATH=/usr/lib/go-1.19/bin:$PATH

cd "$work"
apt-get source --download-only kubernetes
dpkg-source -x kubernetes_*.dsc k8s >/dev/null
tree="$work/k8s"

# 4. reflect2 v1.0.1 is broken under Go >= 1.18 (apiserver dies on the first CR create):
#    replace it with Debian's 1.0.2 sources.
apt-get download golang-github-modern-go-reflect2-dev
dpkg-deb -x golang-github-modern-go-reflect2-dev_*.deb reflect2
r2=$(find "$work/reflect2" -type d -path '*github.com/modern-go/reflect2' | head -1)
[ -n "$r2" ] || { echo "reflect2 sources not found in the Debian package" >&2; exit 1; }
rm -f "$tree"/vendor/github.com/modern-go/reflect2/*.go "$tree"/vendor/github.com/modern-go/reflect2/*.s
cp "$r2"/*.go "$tree/vendor/github.com/modern-go/reflect2/"
cp "$r2"/*.s "$tree/vendor/github.com/modern-go/reflect2/" 2>/dev/null || true
rm -f "$tree"/vendor/github.com/modern-go/reflect2/*_test.go

# 2. GOPATH mode, as upstream 1.20 builds.
export GOPATH="$work/gopath" GO111MODULE=off CGO_ENABLED=0 GOPROXY=off GOFLAGS=
export GOCACHE="$work/gocache"
mkdir -p "$GOPATH/src/k8s.io"
ln -s "$tree" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"

# 3. the generated OpenAPI definitions are not in the tarball.
make gen_openapi

# 5. build.
pkg=k8s.io/kubernetes/vendor/k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=20 -X $pkg.gitTreeState=clean"
for b in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
  echo "building $b"
  go build -trimpath -ldflags "$ldflags" -o "$out/$b.tmp" "k8s.io/kubernetes/cmd/$b"
  mv "$out/$b.tmp" "$out/$b"
done
gcc -Os -static -DVERSION=$version -o "$out/pause.tmp" build/pause/linux/pause.c
mv "$out/pause.tmp" "$out/pause"
cd "$out"
sha256sum kube-apiserver kube-controller-manager kube-scheduler kubelet pause > SHA256SUMS
"$out/kube-apiserver" --version
