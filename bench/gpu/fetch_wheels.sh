#!/usr/bin/env bash
# Downloads into .whl/ the wheels bench/gpu/run.sh installs on a GPU machine that has JAX,
# torch and transformers but not the rest of the project's needs (Python 3.12, x86-64
# Linux): tensorflow-datasets and what it imports, array_record, tensorboardX, num2words.
# run.py installs only those whose package is missing there (protobuf only where the
# machine's is older than the wheels ask for). ~11 MB; .whl/ is git-ignored.
#
#   bench/gpu/fetch_wheels.sh            # then carry .whl with the device call
set -eu
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DEST=.whl
mkdir -p "$DEST"
# The versions this project's CI installs (pip show in its venv), pinned.
BINARY="tensorflow-datasets==4.9.10 array_record==0.8.6 dm-tree==0.1.10 immutabledict==4.3.1
  simple_parsing==0.1.9 docstring-parser==0.18.0 tensorflow-metadata==1.21.0
  googleapis-common-protos==1.76.0 termcolor==3.3.0 toml==0.10.2 num2words==0.5.14
  tensorboardX==2.6.5 protobuf==7.36.2"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" $BINARY
# promise (tfds imports it) publishes only a source archive: pure Python, built here.
"$PY" -m pip wheel -q --no-deps -w "$DEST" promise==2.3
ls -l "$DEST"
du -sh "$DEST"
