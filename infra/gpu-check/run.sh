#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA GPU and PyTorch but not necessarily Ray
# or MLflow (a lent GPU box, a cloud notebook). Run from anywhere:
#
#   bash infra/gpu-check/run.sh smoke          # CUDA tests, forward (ViT-B/16, eager and compiled)
#                                              # and training-step benchmarks, a small study
#   bash infra/gpu-check/run.sh speed          # CUDA tests; where the recipe's forward time goes on the
#                                              # GPU (bench parts: both studies' models and ViT-B/16,
#                                              # bf16, eager, then compiled at batch 256) and ViT-B/16
#                                              # against timm's (bench forward, eager and compiled)
#   bash infra/gpu-check/run.sh study ARGS...  # the one-gpu study; ARGS go to single_gpu_study.py
#                                              # (e.g. --workers 8 --backbone-epochs 24 --method-epochs 12;
#                                              # --tracking-uri sqlite:///... where MLflow is installed);
#                                              # run again, it reuses the runs /tmp/<study> finished;
#                                              # STUDY=studies/study_fashion_seg.yaml for the dense one
#
# Results land in $OUT (default /tmp/gpu-check); `speed` writes a .txt and a .json per step
# (12 files): where only a few files come back, point OUT elsewhere and tar the folder. Optional, beside the repository root:
#   .whl/*.whl            wheels installed first into /tmp/site (e.g. the pinned timm);
#   .data/fashion-mnist/  the four Fashion-MNIST idx files, where the machine cannot download.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/platform${PYTHONPATH:+:$PYTHONPATH}"
[ -d .data/fashion-mnist ] && export SPLITVIT_DATA_DIR="$PWD/.data"
study=${STUDY:-studies/study_fashion.yaml}
name=$(basename "$study" .yaml)

stage=${1:-smoke}
shift || true
status=0
case "$stage" in
  smoke)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, torch.cuda.get_device_name())"
    python3 -m pytest --noconftest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log" || status=1
    # ViT-B/16 at 224 px (the default workload), bf16, batch 256: eager, then fixed shapes under torch.compile
    python3 -m splitvit.cli bench forward --device cuda --batch-size 256 --repeats 20 --json "$out/bench_forward.json" \
      2>&1 | grep -v "USDT\|gpuGetDeviceCount" | tee "$out/bench_forward.log" || status=1
    python3 -m splitvit.cli bench forward --device cuda --batch-size 256 --repeats 20 --token-buckets 4 --compile \
      --no-memory --json "$out/bench_forward_compiled.json" 2>&1 | grep -v "USDT\|gpuGetDeviceCount" \
      | tee "$out/bench_forward_compiled.log" || status=1
    python3 -m splitvit.cli bench train --parts steps --device cuda --batch-size 128 --repeats 10 \
      --json "$out/bench_train.json" 2>&1 | tee "$out/bench_train.log" || status=1
    # a small study with the real model and batch: checks the path and measures images/s for --plan
    python3 infra/gpu-check/single_gpu_study.py "$study" --scale one-gpu --out /tmp/smoke-study \
      --json "$out/smoke_study.json" --backbone-epochs 2 --method-epochs 1 "$@" \
      --set data.options.train_samples=8192 --eval-samples 2000 2>&1 \
      | grep -v " epoch [0-9]*: \|bench: round" | tail -60
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1  # the runner's status, not tail's
    ;;
  speed)
    # each step has its own time limit, so that a slow compile leaves the next steps their turn;
    # DEVICE=cpu BATCH=8 REPEATS=2 tries the whole stage on a CPU
    dev=${DEVICE:-cuda} batch=${BATCH:-256} repeats=${REPEATS:-20}
    recipe="--method split-0.5-agg-mixed-ctx --device $dev"
    vitb="--set model.name=vit_base_patch16_224 --set model.timm_kwargs={} --set model.image_size=256"
    bench() {  # NAME LIMIT ARGS...: splitvit bench ARGS, printout to NAME.txt, JSON to NAME.json
      local name=$1 limit=$2; shift 2
      echo "== $name: splitvit bench $*"
      timeout "$limit" python3 -m splitvit.cli bench "$@" --json "$out/$name.json" 2>&1 \
        | grep -v "USDT\|gpuGetDeviceCount" > "$out/$name.txt"
      local rc=${PIPESTATUS[0]}
      tail -n 40 "$out/$name.txt"
      [ "$rc" -eq 0 ] || { echo "== $name: exit $rc"; status=1; }
    }
    [ "$dev" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    if [ "$dev" = cuda ]; then
      python3 -m pytest --noconftest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log" | tail -5
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    fi
    bench vitb16_forward 90 forward --device "$dev" --image-size 256 --batch-size "$batch" --repeats "$repeats" \
      --policies learned_shared --fine-aggregation --level-context --policy-depth 1 --no-memory
    bench parts_vitb16 150 parts --study studies/study_fashion.yaml $recipe $vitb --batch-sizes "1,64,$batch" \
      --ratios 0.5,0.7 --repeats "$repeats"
    for s in study_fashion study_fashion_seg; do
      bench "parts_$s" 150 parts --study "studies/$s.yaml" $recipe --batch-sizes "1,8,64,$batch" \
        --ratios 0.5,0.7,0.8 --repeats "$repeats"
    done
    bench vitb16_forward_compiled 120 forward --device "$dev" --image-size 256 --batch-size "$batch" \
      --repeats "$repeats" --policies learned_shared --fine-aggregation --level-context --policy-depth 1 \
      --no-memory --token-buckets 4 --compile
    bench parts_study_fashion_compiled 200 parts --study studies/study_fashion.yaml $recipe --batch-sizes "$batch" \
      --ratios 0.5,0.7,0.8 --repeats "$repeats" --compile --token-buckets 4
    ;;
  study)
    python3 -m pytest --noconftest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log" | tail -15
    python3 infra/gpu-check/single_gpu_study.py "$study" --scale one-gpu --out "/tmp/$name" \
      --json "$out/$name.json" "$@" 2>&1 | tee "$out/$name.log" | grep -v " epoch [0-9]*: \|bench: round" | tail -60
    status=${PIPESTATUS[0]}
    cp "/tmp/$name/study.png" "$out/$name.png" 2>/dev/null
    ;;
  *) echo "usage: $0 smoke|speed|study [args]" >&2; exit 2 ;;
esac
exit $status
