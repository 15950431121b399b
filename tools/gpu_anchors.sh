#!/usr/bin/env bash
# Puts the GPU benchmark's anchors into .anchors/ (ignored by git), for a GPU machine without network: seqdist 0.0.3
# unpacked as the package `seqdist003` (its imports are relative, so it loads beside our seqdist). Run it where pip
# reaches PyPI, then take .anchors along (the device tool's `carry`); seqdist.bench.load_seqdist003 finds it.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --disable-pip-version-check seqdist==0.0.3 -d "$tmp" 2>&1 | grep -v '^WARNING: Location' || true
python3 -m zipfile -e "$tmp"/seqdist-0.0.3-*.whl "$tmp/unpacked"
mkdir -p .anchors && rm -rf .anchors/seqdist003
mv "$tmp/unpacked/seqdist" .anchors/seqdist003
rm -rf "$tmp"
echo "seqdist 0.0.3 in .anchors/seqdist003"
