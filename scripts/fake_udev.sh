#!/usr/bin/env bash
# cuFile identifies a file's block device through the udev database; containers without udev
# (our lent H200 machine) have none, so cuFileHandleRegister fails even in compat mode
# ("udev property not found: ID_FS_USAGE"). Opt-in workaround for test machines only: describe
# the device holding DIR in /run/udev/data so cuFile can register files there.
set -eu
dir=${1:-/tmp}
dev=$(stat -c '%d' "$dir")
maj=$((dev >> 8)); min=$((dev & 255))
f=/run/udev/data/b$maj:$min
mkdir -p /run/udev/data
fstype=$(df -T "$dir" | awk 'NR==2{print $2}')
[ -e "$f" ] || printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$fstype" > "$f"
echo "udev entry $f: $(tr '\n' ' ' < "$f")"
