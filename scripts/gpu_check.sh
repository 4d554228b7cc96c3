#!/usr/bin/env bash
# Device check for the FlashInfer attention backend, on one CUDA GPU (sized for an H200), in
# under 9 minutes: (1) install flashinfer from the carried source release if it is not
# importable, (2) time decode, prefill, the attention kernel and the whole engine
# (scripts/gpu_check.py), writing $OUT/gpu_check.json when $OUT is set, (3) run tests/gpu.
#
# Before: bash scripts/fetch_flashinfer_sdist.sh   (here, with registry access)
# Then:   bash scripts/gpu_check.sh                (on the GPU machine, from the repo root)
# The machine needs torch with CUDA, nvcc, ninja; flashinfer's kernels are JIT-compiled on
# first use (cached under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TOTAL_S="${GPU_CHECK_BUDGET_S:-530}"   # leaves headroom under 9 minutes
start=$SECONDS
left() { echo $(( TOTAL_S - (SECONDS - start) )); }
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}"
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; export CUDA_HOME
fi
LOG_DIR="${OUT:-/tmp/gpu_check}"; mkdir -p "$LOG_DIR"
status=0

echo "== gpu_check: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
echo "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo missing)   CUDA_HOME=${CUDA_HOME:-unset}"

# ---- 1. flashinfer from source -----------------------------------------------------------------
if ! "$PY" -c "import flashinfer" 2>/dev/null; then
  sdist="$(ls third_party/flashinfer_python-*.tar.gz 2>/dev/null | sort -V | tail -1)"
  if [ -z "$sdist" ]; then
    echo "!! flashinfer is not importable and no third_party/flashinfer_python-*.tar.gz was carried" >&2
    echo "   run scripts/fetch_flashinfer_sdist.sh first and carry third_party/" >&2
    status=1
  else
    echo "== installing $sdist (pip, no build isolation: this machine is offline)"
    if ! timeout 180 "$PY" -m pip install -q --no-deps --no-build-isolation "$sdist" >"$LOG_DIR/pip_install.log" 2>&1; then
      # An old setuptools cannot build it (it wants >= 77): use the source tree in place, laid out
      # the way FlashInfer's editable install lays it out (flashinfer/data/* -> sources).
      echo "   pip install failed (tail of $LOG_DIR/pip_install.log below); using the source tree in place"
      tail -5 "$LOG_DIR/pip_install.log"
      src=/tmp/flashinfer-src; rm -rf "$src"; mkdir -p "$src"
      tar xzf "$sdist" -C "$src" --strip-components=1
      mkdir -p "$src/flashinfer/data"
      for d in csrc include tvm_binding; do ln -sfn "$src/$d" "$src/flashinfer/data/$d"; done
      for d in cutlass spdlog; do ln -sfn "$src/3rdparty/$d" "$src/flashinfer/data/$d"; done
      export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
    fi
  fi
fi
"$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__, 'from', flashinfer.__file__)" || status=1
echo "   setup took $(( SECONDS - start )) s"

# ---- 2. timings first: they need only the bench model's kernels, and are the figures we report
bench_s=$(( $(left) - 240 )); [ "$bench_s" -gt 260 ] && bench_s=260
if [ "$bench_s" -lt 60 ]; then
  echo "!! only ${bench_s} s left: skipping timings"; status=1
else
  echo "== timings (limit ${bench_s} s)"
  json_arg=(); [ -n "${OUT:-}" ] && json_arg=(--json "$OUT/gpu_check.json")
  timeout "$bench_s" "$PY" scripts/gpu_check.py --budget-s $(( bench_s - 60 )) "${json_arg[@]}" 2>&1 | tee "$LOG_DIR/timings.log"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "!! gpu_check.py exit $rc (124: timed out)"; status=1; }
fi
# ---- 3. tests with the rest of the budget (-v prints each result as it lands: a timeout keeps them)
xdist=""
"$PY" -c "import xdist" 2>/dev/null && xdist="-n 4"   # parallel workers JIT-compile different kernels at once
test_s=$(( $(left) - 10 ))
echo "== pytest tests/gpu (limit ${test_s} s) $xdist"
set -o pipefail
timeout "$test_s" "$PY" -m pytest tests/gpu -v -rs -p no:cacheprovider $xdist 2>&1 | tee "$LOG_DIR/pytest.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error" | tail -60
rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "!! pytest exit $rc (124: timed out, 5: nothing ran)"; status=1; }

echo "== gpu_check done in $(( SECONDS - start )) s, status $status"
exit $status
