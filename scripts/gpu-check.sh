#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the GPU tests (tests/test_gpu.py), the conformance suite with
# JAX on its default device (the GPU), and `python -m conformance compare --device cuda` in float32 and
# bfloat16, and its long-sequence variant (flash_attention); JAX's ring attention over the machine's GPUs. Logs, JSON and plots go to the folder given as $1 (default gpu-results). Every step runs; the
# exit code is 1 if any failed.
#
#   bash scripts/gpu-check.sh [OUTPUT_DIR]      # PYTHON=... to choose the interpreter (default python3)
#
# The interpreter needs torch with CUDA and/or jax with its CUDA plugin, and numpy, hypothesis and pytest;
# the packages of this checkout are found through PYTHONPATH, so nothing needs to be installed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember a failure
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log" || failed=1
}

step tests "$python" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_fast_path.py tests/test_low_precision.py \
    tests/test_flash.py
for dtype in float32 bfloat16; do  # the machine, the devices and the placement head each table
    sizes=$([ "$dtype" = float32 ] && echo 512,1024,2048,4096 || echo 1024,2048,4096,8192)
    step "compare-$dtype" "$python" -m conformance compare --device cuda --dtype "$dtype" --sizes "$sizes" --quiet \
        --json "$out/compare-$dtype.json" --plot "$out/compare-$dtype.png"
done
step compare-long "$python" -m conformance compare --device cuda --variant long --sizes 1024,4096,16384 --repeats 3 \
    --quiet --json "$out/compare-long.json" --plot "$out/compare-long.png"  # tiled attention (NumPy on the CPU)
step ring-jax "$python" examples/ring_attention_jax.py  # ring attention over every GPU JAX sees
step conformance "$python" -m conformance
echo "== $([ $failed = 0 ] && echo 'all steps passed' || echo 'a step failed'); results in $out/"
exit $failed
