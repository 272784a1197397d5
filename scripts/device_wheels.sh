#!/usr/bin/env bash
# Wheels of the packages the accelerator image lacks, for its Python 3.12 on x86-64, into .whl/
# (git-ignored), so a device run can install them offline before the accelerator check:
#
#   scripts/device_wheels.sh            # here, once (needs the package registry)
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:$PWD python3 scripts/accelerator_check.py --out_dir=$OUT   # there
#
# The image has JAX 0.11, flax, optax, orbax, torch, transformers, tensorboard, absl, etils and
# most of tensorflow-datasets' needs; missing are the packages below (versions as pinned here).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"  # also in a worktree (.git is a file there)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
PACKAGES=(
  ml-collections==1.1.0 tensorflow-datasets==4.9.10 array-record==0.8.6 dm-tree==0.1.10
  immutabledict==4.3.1 simple-parsing==0.1.9 docstring-parser==0.18.0
  tensorflow-metadata==1.21.0 googleapis-common-protos==1.76.0 termcolor==3.3.0 toml==0.10.2
  tensorboardX==2.6.5
)
PLATFORMS=()
for n in 39 35 34 31 28 27 24 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
mkdir -p .whl
# promise ships only an sdist: build its (pure-Python) wheel here.
python3 -m pip wheel -q --no-deps -w .whl promise==2.3
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d .whl "${PACKAGES[@]}"
du -sh .whl && ls .whl
