#!/usr/bin/env bash
# Make the container tests' image, localhost/pybase:1 (Debian bookworm minbase + python3), offline
# from the Debian mirror: debootstrap, strip what a test never reads, `podman import`.
# The image is saved to a cache (~120 MB) and loaded from there next time, so a machine builds it once.
#   usage: scripts/build-test-image.sh [IMAGE]   (root: the pool's agent uses rootful podman)
#   env:   CPOOL_IMAGE_CACHE (default ~/.cache/computepool/images), DEBIAN_MIRROR
set -euo pipefail
IMAGE="${1:-localhost/pybase:1}"
CACHE_DIR="${CPOOL_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/computepool/images}"
TAR="$CACHE_DIR/$(basename "${IMAGE//:/-}").tar"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if podman image exists "$IMAGE"; then
  echo "$IMAGE: already present"
  exit 0
fi
if [ -s "$TAR" ]; then
  podman load -q -i "$TAR" >/dev/null
  echo "$IMAGE: loaded from $TAR"
  exit 0
fi

root="$(mktemp -d /var/tmp/cpool-image.XXXXXX)"
trap 'rm -rf "$root"' EXIT
echo "$IMAGE: building with debootstrap from $MIRROR (about a minute)"
debootstrap --variant=minbase --include=python3 bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
  || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/var/log/*
find "$root" -name '__pycache__' -prune -exec rm -rf {} +
tar -C "$root" --numeric-owner -c . \
  | podman import -q --change 'CMD ["/usr/bin/python3"]' --change 'ENV LANG=C.UTF-8' - "$IMAGE" >/dev/null
mkdir -p "$CACHE_DIR"
chmod 0700 "$CACHE_DIR"
podman save -q -o "$TAR.tmp" "$IMAGE"
mv "$TAR.tmp" "$TAR"
echo "$IMAGE: built and cached in $TAR ($(du -h "$TAR" | cut -f1))"
