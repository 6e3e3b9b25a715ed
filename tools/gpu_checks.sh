#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (minutes on one H100):
#   1. the `gpu` tests: sparse and Triton paths against masked, compiled, fp32 and bf16 autocast;
#   2. tools/bench_attention.py on CUDA at two widths (768/12 heads, 384/6), fp32 and bf16, at batch sizes
#      a GPU trains with, each length on its own (their .json records are what `fit_from=` fits the CUDA
#      `auto` table from);
#   3. tools/bench_models.py on CUDA, bf16 autocast.
#
#   bash tools/gpu_checks.sh <out_dir> [parts] [quick]
#
# parts: a comma-separated choice of tests, attention, models (default all three). On one H100 (2026-11-25)
# the tests took 30 s and the attention runs 6 min; the models did not finish in the 80 s left of an 8-minute
# command, so give them a call of their own. Every log, table and .json lands in <out_dir>, and
# <out_dir>/gpu_checks.tar.gz holds them all (refreshed after each step, so a run cut short still returns
# what it finished). `quick` runs tiny settings, on the CPU when there is no GPU: a dry run of this script.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash tools/gpu_checks.sh <out_dir> [tests,attention,models] [quick]}
parts=",${2:-tests,attention,models},"
quick=${3:-}
mkdir -p "$out/runs"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled MPLBACKEND=Agg PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
device=cuda
python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || device=cpu

pack() { tar -czf "$out/gpu_checks.tar.gz" -C "$out" runs; }
step() { echo "== $*" >&2; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1 || true
} | tee "$out/runs/env.txt"

if [[ $parts == *,tests,* ]]; then
  step "gpu tests"
  python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" -m gpu tests/test_sparse_moh.py \
    2>&1 | tee "$out/runs/gpu_tests.log"
  pack
fi

if [[ -n "$quick" ]]; then
  widths=("64 4"); dtypes=(float32); lengths=("64 2"); extra=(repeats=2 warmup=1 ratios=0.5)
else
  widths=("768 12" "384 6"); dtypes=(float32 bfloat16); lengths=("196 64" "1024 16" "4096 4"); extra=()
fi
[[ $parts == *,attention,* ]] || widths=()
for width in "${widths[@]}"; do
  read -r dim heads <<<"$width"
  for dtype in "${dtypes[@]}"; do
    for length in "${lengths[@]}"; do
      read -r seqlen batch <<<"$length"
      name="attn_d${dim}_${dtype}_n${seqlen}_b${batch}"
      step "$name"
      python3 tools/bench_attention.py device=$device dim=$dim heads=$heads dtype=$dtype seqlens=$seqlen batch=$batch \
        "${extra[@]}" out="$out/runs/$name.md" 2>"$out/runs/$name.err"
      pack
    done
  done
done

[[ $parts == *,models,* ]] || exit 0
step "models"
if [[ -n "$quick" ]]; then
  python3 tools/bench_models.py device=$device quick=true rounds=2 warmup=1 out="$out/runs/models.md" \
    2>"$out/runs/models.err"
else
  python3 tools/bench_models.py device=$device batch=32 dtype=bfloat16 impl=auto,masked,sparse \
    out="$out/runs/models_bf16_b32.md" 2>"$out/runs/models_bf16_b32.err"
fi
pack
