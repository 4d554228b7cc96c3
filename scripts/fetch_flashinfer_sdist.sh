#!/usr/bin/env bash
# Fetch FlashInfer's source release into third_party/ on a machine that can reach the package
# registry, so scripts/gpu_check.sh can install it on an offline GPU machine (about 3.8 MB).
# Only flashinfer-python is taken as source (--no-binary flashinfer-python): with
# `--no-binary :all:` pip must also build its build backend (setuptools) from source while
# preparing metadata, which fails. 0.3.1.post1 is the default: the newest 0.3.x, and the first
# line with the CUDA 13 JIT link fix (the device image has nvcc 13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${FLASHINFER_VERSION:-0.3.1.post1}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p third_party
"$PY" -m pip download --no-deps --no-binary flashinfer-python "flashinfer-python==${VERSION}" -d third_party/
ls -l third_party/flashinfer_python-"${VERSION}".tar.gz
