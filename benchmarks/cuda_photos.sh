#!/usr/bin/env bash
# The photos recipe on one CUDA GPU through the product (benchmarks/bench_photos.py: the teacher once, the students
# over 3 seeds), preceded by a one-epoch pass of every stage so that a failure shows in a minute:
#
#   python benchmarks/pack_photos.py --root ../shared/data/imagenette-dev --out .gpudata/imagenette.zip   # here
#   python3 -m zipfile -e .gpudata/imagenette.zip /tmp/data                              # on the GPU machine
#   bash benchmarks/cuda_photos.sh /tmp/data/imagenette "$OUT" 500
#
# Arguments: the image folder, where results go, the seconds the whole script may take. Environment: WORK (run
# directories and the shared pixel cache, default /tmp/photos), WORKERS (DataLoader workers, default 10), SKIP_INSTALL=1
# (use the compress already installed), EXTRA (more --set options for every run, e.g. to try the script on a CPU),
# SEEDS (default 0,1,2; the first one's run trains the teacher the others copy), SMOKE=0 (skip the one-epoch pass).
set -uo pipefail
DATA=$1; OUT=$2; BUDGET=${3:-480}; WORK=${WORK:-/tmp/photos}; WORKERS=${WORKERS:-10}; EXTRA=${EXTRA:-}
SEEDS=${SEEDS:-0,1,2}; SMOKE=${SMOKE:-1}
start=$SECONDS
mkdir -p "$OUT" "$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
python3 -c "import torch, torchvision, onnx, onnxruntime as ort; print('torch', torch.__version__, 'torchvision', \
torchvision.__version__, 'onnx', onnx.__version__, 'onnxruntime', ort.__version__, 'cuda', torch.cuda.is_available())"
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index . || exit 1
fi
COMPRESS="$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/compress"
sets=(--set "data.root=$DATA" --set "data.cache_dir=$WORK/pixels" --set "train.num_workers=$WORKERS"
      --set train.progress=false)
for e in $EXTRA; do sets+=(--set "$e"); done
if [ "$SMOKE" != 0 ] && ! timeout 180 "$COMPRESS" run -c photos --run-dir "$WORK/smoke" "${sets[@]}" --set teacher.epochs=1 \
     --set distill.epochs=1 --set distill.views=1 --set qat.epochs=1 --set qat.max_accuracy_drop=100 > "$OUT/smoke.txt" 2>&1; then
  tail -30 "$OUT/smoke.txt"; cp "$WORK/smoke/log.txt" "$OUT/smoke_log.txt" 2>/dev/null; exit 1
fi
[ "$SMOKE" != 0 ] && echo "every stage ran once at $((SECONDS - start)) s"
bench=(--set "train.num_workers=$WORKERS"); for e in $EXTRA; do bench+=(--set "$e"); done
timeout $((BUDGET - (SECONDS - start))) python3 benchmarks/bench_photos.py --root "$DATA" --work "$WORK" \
  --seeds "$SEEDS" --teacher-seed "${SEEDS%%,*}" --out "$OUT/photos_cuda.json" "${bench[@]}"
echo "bench_photos exit $? at $((SECONDS - start)) s"
for s in ${SEEDS//,/ }; do cp "$WORK/seed$s/log.txt" "$OUT/seed${s}_log.txt" 2>/dev/null; done
cp "$WORK/seed${SEEDS%%,*}/report.md" "$OUT/seed${SEEDS%%,*}_report.md" 2>/dev/null
exit 0
