#!/bin/sh
# Makes a local Debian bookworm base image with python3 and python3-venv, for
# machines that reach no container registry (`just base-image`). Bookworm's
# python3 is 3.11, as in python:3.11-slim-bookworm, the Containerfile's default.
# Needs root, debootstrap and podman (`just base-image` installs them when missing);
# a few minutes, mostly downloading packages.
#   usage: base-image.sh TAG [PODMAN...]   e.g. base-image.sh localhost/ibex-base:bookworm podman
set -eu
tag="$1"
shift
[ "$#" -gt 0 ] || set -- podman
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
root="$(mktemp -d /tmp/ibex-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
chmod 0755 "$root"  # it becomes the image's /: mktemp's 0700 would lock out non-root users
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$mirror" >/dev/null
# A base layer carries no package caches or lists: the image build installs nothing with apt.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" -c . | "$@" import \
    --change 'CMD ["/bin/bash"]' \
    --change 'ENV LANG=C.UTF-8' \
    - "$tag"
