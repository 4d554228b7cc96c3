#!/usr/bin/env bash
# Regenerate the Python stubs of every .proto under proto/ (run from anywhere).
# Usage: scripts/gen_proto.sh [OUT_DIR]   (OUT_DIR defaults to the repo root)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
mapfile -t PROTOS < <(find proto -name '*.proto' | sort)
"$PY" -m grpc_tools.protoc -I. --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" "${PROTOS[@]}"
