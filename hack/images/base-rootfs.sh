#!/usr/bin/env bash
# Make the root filesystem of the local base image (localhost/diloco-base): Debian bookworm,
# debootstrap's minbase variant, with python3.11 and a virtual environment first on PATH, so the
# Dockerfile's `pip install` lines work as they do in the python:3.11-slim-bookworm image.
#
# Usage (as root; called by hack/build-images.sh): base-rootfs.sh ROOTFS_DIR
# Reads DEBIAN_SUITE and DEBIAN_MIRROR from the environment (hack/versions.env sets them).
#
# Why a venv and not PIP_BREAK_SYSTEM_PACKAGES: Debian's python3.11 marks itself externally
# managed (PEP 668). Overriding that would let pip overwrite files dpkg owns; a venv at
# /opt/venv is not externally managed, needs no flag in the Dockerfile, and keeps `python`,
# `pip` and the installed console scripts (`diloco`) on PATH, as /usr/local/bin does in the
# python image.
set -euo pipefail

ROOTFS=${1:?usage: base-rootfs.sh ROOTFS_DIR}
SUITE=${DEBIAN_SUITE:?DEBIAN_SUITE is not set (hack/versions.env)}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
PYTHON=${BASE_PYTHON:?BASE_PYTHON is not set (hack/versions.env)}
VENV=/opt/venv

log() { printf '[build-images] %s\n' "$*" >&2; }

[[ $(id -u) -eq 0 ]] || { echo "base-rootfs.sh must run as root (debootstrap, chroot)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

rm -rf "${ROOTFS}"
mkdir -p "${ROOTFS}"
# The image leaves out documentation as debian:*-slim does (dpkg skips these paths).
mkdir -p "${ROOTFS}/etc/dpkg/dpkg.cfg.d"
cat > "${ROOTFS}/etc/dpkg/dpkg.cfg.d/01-slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
CFG

log "debootstrap --variant=minbase ${SUITE} (${MIRROR})"
debootstrap --variant=minbase "${SUITE}" "${ROOTFS}" "${MIRROR}" >&2

# Point releases and security updates: debootstrap only reads the release itself.
cat > "${ROOTFS}/etc/apt/sources.list" <<SRC
deb ${MIRROR} ${SUITE} main
deb ${MIRROR} ${SUITE}-updates main
deb ${SECURITY_MIRROR} ${SUITE}-security main
SRC
cp /etc/resolv.conf "${ROOTFS}/etc/resolv.conf"
in_root() { chroot "${ROOTFS}" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 "$@"; }

log "apt-get install ${PYTHON} ${PYTHON}-venv ca-certificates (with ${SUITE}-updates, -security)"
in_root apt-get update -qq >&2
in_root apt-get upgrade -y -qq >&2
in_root apt-get install -y -qq --no-install-recommends "${PYTHON}" "${PYTHON}-venv" ca-certificates >&2

log "virtual environment ${VENV} (pip from Debian's ensurepip)"
in_root "/usr/bin/${PYTHON}" -m venv "${VENV}"
# pip trusts the system's CA store, as Debian's own pip does (pip's bundled certifi otherwise):
# a build behind a TLS-inspecting proxy mounts the host's store over it (hack/build-images.sh).
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "${ROOTFS}${VENV}/pip.conf"
in_root "${VENV}/bin/python" -m pip --version >&2

# Leave what a container image should not carry: apt's downloads and lists, logs, the build
# host's resolver, a machine id, device nodes (the runtime makes /dev).
in_root apt-get clean
rm -rf "${ROOTFS}"/var/lib/apt/lists/* "${ROOTFS}"/var/cache/apt/*.bin "${ROOTFS}"/var/cache/debconf/*-old
find "${ROOTFS}/var/log" -type f -delete
rm -rf "${ROOTFS}/debootstrap" "${ROOTFS}"/tmp/* "${ROOTFS}"/dev/*
: > "${ROOTFS}/etc/resolv.conf"
: > "${ROOTFS}/etc/machine-id"
echo localhost > "${ROOTFS}/etc/hostname"
log "root filesystem ready: $(du -sh "${ROOTFS}" | cut -f1)"
