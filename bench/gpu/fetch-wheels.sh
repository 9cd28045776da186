#!/usr/bin/env bash
# Run HERE (any machine with pip and the package index), before a GPU check: downloads
# into .whl/ the wheels the lent GPU machine lacks (it has Python 3.12, torch, numpy,
# scipy, grpcio's siblings and most of the scientific stack, but not Opacus, cryptography,
# pydantic, MONAI, ...; see /work/.library/device/KINDS.md), at the versions
# requirements/dev.lock pins (what `make test` runs), for CPython 3.12 on manylinux x86-64. .whl/ is ignored by
# git and travels with `carry: [".whl"]`; bench/gpu/check.sh installs it there.
#
#   bash bench/gpu/fetch-wheels.sh [PYTHON_VERSION]     # default 3.12
set -euo pipefail
cd "$(dirname "$0")/../.."
python_version=${1:-3.12}
lock=requirements/dev.lock
dest=.whl
# Not on the GPU image, or needed there at our pinned version (grpcio and protobuf must
# match the generated code, grpcio-health-checking and grpcio-reflection). The demo and
# `bench round` run a coordinator too, hence reflection.
names=(
  opacus cryptography cffi pycparser
  pydantic pydantic-core pydantic-settings annotated-types typing-inspection python-dotenv
  typing-extensions
  dp-accounting dm-tree
  grpcio grpcio-health-checking grpcio-reflection protobuf
  monai pydicom pylibjpeg pylibjpeg-libjpeg pylibjpeg-openjpeg pyjpegls
)
rm -rf "$dest" && mkdir -p "$dest"
specs=()
for name in "${names[@]}"; do
  pin=$(grep -E "^${name}==" "$lock" | head -1 | cut -d' ' -f1)
  if [ -z "$pin" ]; then
    echo "fetch-wheels: $name is not pinned in $lock" >&2
    exit 2
  fi
  specs+=("$pin")
done
platforms=()
for tag in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 \
           manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
           manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64 any; do
  platforms+=(--platform "$tag")
done
PIP_CONSTRAINT= python3 -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$python_version" --implementation cp "${platforms[@]}" \
  -d "$dest" "${specs[@]}"
count=$(ls "$dest"/*.whl | wc -l)
size=$(du -sm "$dest" | cut -f1)
echo "fetch-wheels: $count wheels, ${size} MiB in $dest (CPython $python_version)"
if [ "$count" -ne "${#names[@]}" ]; then
  echo "fetch-wheels: expected ${#names[@]} wheels" >&2
  exit 1
fi
