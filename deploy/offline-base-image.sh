#!/usr/bin/env bash
# Makes the Dockerfiles' base image, python:3.11.13-slim-bookworm, on a machine that
# can reach no image registry: a minimal Debian 12 root file system with Debian's
# Python 3.11 and pip (debootstrap, from a Debian mirror), imported into the local
# Docker engine under that name. The Dockerfiles are unchanged and build FROM it as
# they would from the registry's image. Where the image exists already, it is kept
# (--force rebuilds it). Needs root, debootstrap and a running Docker engine.
#
#   sudo deploy/offline-base-image.sh            # or: sudo make offline-base-image
#
# BASE_IMAGE (default python:3.11.13-slim-bookworm) names the image, DEBIAN_MIRROR
# (default http://deb.debian.org/debian) the mirror. The image keeps that mirror in
# its apt sources (the worker's build installs g++ from it), and this machine's CA
# certificates, so that a build behind a TLS-inspecting proxy reaches PyPI.
set -euo pipefail

BASE_IMAGE=${BASE_IMAGE:-python:3.11.13-slim-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

if [ "$FORCE" = 0 ] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "$BASE_IMAGE exists already (--force rebuilds it)"
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }

ROOT=$(mktemp -d /var/tmp/offline-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT

started=$(date +%s)
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$ROOT" "$DEBIAN_MIRROR" >"$ROOT.log" 2>&1 \
    || { tail -30 "$ROOT.log" >&2; rm -f "$ROOT.log"; exit 1; }
rm -f "$ROOT.log"

# The official image has `python` and `pip` on PATH, and pip installs into the
# system interpreter: Debian's marker that forbids that (PEP 668) goes.
ln -sf /usr/bin/python3 "$ROOT/usr/local/bin/python"
ln -sf /usr/bin/pip3 "$ROOT/usr/local/bin/pip"
rm -f "$ROOT"/usr/lib/python3*/EXTERNALLY-MANAGED

# The updates and security suites, as in the official image.
cat >"$ROOT/etc/apt/sources.list" <<SOURCES
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb ${DEBIAN_MIRROR%/debian}/debian-security bookworm-security main
SOURCES

# This machine's CA bundle, and its local CAs so that update-ca-certificates in a
# later layer keeps them.
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
fi

rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/tmp/*

tar -C "$ROOT" --numeric-owner -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    --message "debootstrap bookworm minbase with Debian's python3 (deploy/offline-base-image.sh)" \
    - "$BASE_IMAGE" >/dev/null
echo "$BASE_IMAGE: made in $(( $(date +%s) - started )) s, $(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}')"
