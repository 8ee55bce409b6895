#!/usr/bin/env bash
# Packs what a machine with torch (and accelerate, safetensors, numpy, pillow) but no network lacks to run
# training/ (diffusers, vizdoom, importlib_metadata), built for that machine's Python, into one tar.xz:
#
#   PYTHON=.venv/bin/python bash training/offline_site.sh 3.12 site.tar.xz           # here, with a network
#   mkdir -p /tmp/site && tar xJf site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site   # there
#
# The versions are this environment's (pip show), so both machines run the same code. Unpacked instead of
# pip-installed: the wheels' own layout is a site folder. freedoom2.wad (29 MB) is left out: the project plays
# freedoom1. xz packs it to ~21 MB where the wheels take ~45.
set -euo pipefail
PY=${PYTHON:-python3}  # the project's environment (e.g. PYTHON=.venv/bin/python): its versions are packed
py=${1:?usage: offline_site.sh PYTHON_VERSION OUT.tar.xz}
out=$(realpath -m "${2:?usage: offline_site.sh PYTHON_VERSION OUT.tar.xz}")
pkgs=()
for name in diffusers vizdoom importlib_metadata; do
    pkgs+=("$name==$("$PY" -m pip show "$name" | sed -n 's/^Version: //p')")
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$tmp/wheels" "${pkgs[@]}"
mkdir "$tmp/site"
for w in "$tmp"/wheels/*.whl; do
    "$PY" -m zipfile -e "$w" "$tmp/site"
done
rm -f "$tmp/site/vizdoom/freedoom2.wad"
chmod +x "$tmp/site/vizdoom/vizdoom"  # zipfile drops the mode bits; the engine is a program vizdoom starts
tar cJf "$out" -C "$tmp/site" .
echo "offline_site: ${pkgs[*]} for Python $py in $out ($(du -h "$out" | cut -f1))"
