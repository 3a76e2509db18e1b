#!/usr/bin/env bash
# The GPU checks of one lent session, in one command (a lent GPU machine has torch, transformers and
# Triton but not kvrag's small pure-Python needs, and no network):
#
#   here, once:  python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                    --implementation cp -d .whl diskcache platformdirs gguf
#                (and .whl/ in .git/info/exclude)
#   there:       bash benchmarks/gpu_check.sh            (the device tool's run, carrying .whl)
#
# Prints the kernel tests' summary, the one-row attention bench, the smoke checks on the tiny model,
# and the timing and host-wait lines on a random model of SmolLM2's shapes (the bundled model's
# 98 MB GGUF is more than a call carries); each log is kept under $OUT when that is set. About 4
# minutes on an H200. OLD=path/to/an/older/kvrag-tree also times that tree's kvrag on the same machine.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvrag-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/kvrag-site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-/tmp/kvrag-gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"

echo "== kernel tests"
timeout 180 python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tee "$out/kernels.log" | tail -2
echo "== one row's attention"
timeout 90 python3 -W ignore -m benchmarks.one_row --device cuda --keys 1024 4096 2>&1 | tee "$out/one_row.log"
echo "== smoke, tiny model"
timeout 150 python3 -m benchmarks.gpu_smoke --device cuda 2>&1 | tee "$out/smoke.log" | grep -E "^(PASS|FAIL|TIMING|SYNCS|gpu_smoke)"
trees=("new:$PWD")
[ -n "${OLD:-}" ] && trees=("old:$OLD" "${trees[@]}")
for tree in "${trees[@]}"; do
    name=${tree%%:*} dir=${tree#*:}
    echo "== SmolLM2's shapes, random weights ($name tree)"
    (cd "$dir" && timeout 120 python3 -m benchmarks.gpu_smoke --device cuda --shape smollm2 --words 400 --reps 7 \
        --only timing syncs 2>&1 | tee "$out/shape-$name.log" | grep -E "^(FAIL|TIMING|SYNCS)")
done
