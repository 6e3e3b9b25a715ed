#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (minutes on one H100):
#   1. the `gpu` tests: sparse and Triton paths against masked, compiled, fp32 and bf16 autocast;
#   2. tools/bench_attention.py on CUDA at two widths (768/12 heads, 384/6), fp32 and bf16, at batch sizes
#      a GPU trains with, each length on its own (their .json records are what `fit_from=` fits the CUDA
#      `auto` table from);
#   3. tools/bench_models.py on CUDA, bf16 autocast;
#   4. (part `routing`, issue 43) the three MoH/dense pairs (DiT-S/2, DiT-B/2, TransNeXt-Base) in bf16 at batch
#      32 and at the batch each family trains with (DiT 256, TransNeXt 128, or 64 where 128 does not fit):
#      eager, compiled, and compiled with CUDA graphs (reduce-overhead), each step under a time limit
#      (TIMEOUT_ROUTING, default 120 s) and all inside ROUTING_BUDGET (default 450 s), after the routing kernels'
#      `gpu` tests (their gated merge is first used on CUDA here), eager first: one call of
#      8 minutes. (On one H100, 2026-11-26, compiling TransNeXt-Base took over 2 minutes a mode: its compiled
#      steps come last and may be cut;) a .json record per step;
#   5. (part `train`) the README's first command on the GPU with bf16 autocast, eval.py on its checkpoint,
#      a short `experiment=diffusion` run and tools/sample.py on it: the trainer end to end on CUDA.
#
#   bash tools/gpu_checks.sh <out_dir> [parts] [quick]
#   bash tools/gpu_checks.sh wheels <dir>     # here: the wheels part `train` needs on a GPU machine
#
# parts: a comma-separated choice of tests, attention, models, routing, train, backbones, candidates (default:
# tests, attention, models). Part `candidates` (issue 42, about 7 minutes) times TransNeXt-T beside Swin-T at batch
# 64 with each CUDA candidate switched on (MOH_VISION_TRANSNEXT_CUDA=flex, triton_dwconv, both; then compiled,
# compiled_dwgrad; TIMEOUT_CANDIDATES, default 100 s each, 200 s the compiled one). Part `backbones` (issue 42), in
# one call of under 10 minutes: a short profile of TransNeXt-T beside Swin-T (batch 64 eager: each one's time by kind
# of work and top kernels, and TransNeXt-T's depthwise convolution in three layouts (the model's, the strided one
# before f746026, NCHW) and in Triton, its attention operator and the FlexAttention candidate alone, the record
# rewritten after each part), the aggregated-attention and depthwise kernels' gpu tests (TransNeXt's shapes first), then tools/bench_backbones.py in bf16 with each model's top kernels: TransNeXt-T/-B
# beside Swin-T/-B at batch 128 eager, TransNeXt-B beside Swin-B at batch 32 (peak memory) and TransNeXt-T/Swin-T
# compiled at 64; each step under a time limit (TIMEOUT_PROFILE 140, TIMEOUT_TESTS 110 and TIMEOUT_BENCH 100 seconds by default). On one H200
# (2026-11-27) the first steps compiled the Triton kernels (~40 s) and the FLOP counts took ~20 s, so at 100 s /
# 70 s only the batch-128 table finished in a 400 s call (docs/bench/h200-2026-11-27/). On one H100
# (2026-11-25) the tests took 30 s, the attention runs 6 min and part train about 2 min; the models did not
# finish in the 80 s left of an 8-minute command, so give them a call of their own. Every log, table and
# .json lands in <out_dir>, and <out_dir>/gpu_checks.tar.gz holds them all but checkpoints (refreshed after
# each step, so a run cut short still returns what it finished; PACK_TO=<dir> writes it there instead).
# `quick` runs tiny settings, on the CPU when there is no GPU: a dry run of this script.
#
# The lent GPU machines have torch, Triton, timm (another version), tqdm, PyYAML, scikit-learn and
# matplotlib, but not Hydra, OmegaConf or fvcore, which `train` needs: `wheels <dir>` writes them (the
# versions requirements.txt pins; pure Python, so they install anywhere) for the machine to install with
# `pip install --no-index --no-deps --target /tmp/site <dir>/*.whl` and `PYTHONPATH=/tmp/site`.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == wheels ]]; then
  dir=${2:?usage: bash tools/gpu_checks.sh wheels <dir>}
  pins=$(grep -E '^(timm|hydra-core|omegaconf|fvcore)==' requirements.txt)
  # and their dependencies the machines lack (versions as this project's environment resolves them)
  deps=$(python3 -m pip list --format=freeze 2>/dev/null |
    grep -iE '^(antlr4-python3-runtime|iopath|yacs|termcolor|portalocker|tabulate)==')
  exec python3 -m pip wheel -q --no-deps -w "$dir" $pins $deps
fi
out=${1:?usage: bash tools/gpu_checks.sh <out_dir> [tests,attention,models,routing,train,backbones] [quick]}
parts=",${2:-tests,attention,models},"
quick=${3:-}
mkdir -p "$out/runs"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled MPLBACKEND=Agg PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
device=cuda
python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || device=cpu

pack() { tar -czf "${PACK_TO:-$out}/gpu_checks.tar.gz" --exclude='*.pt' -C "$out" runs; }
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
    tests/test_fused_routing.py \
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

if [[ $parts == *,models,* ]]; then
  step "models"
  if [[ -n "$quick" ]]; then
    python3 tools/bench_models.py device=$device quick=true rounds=2 warmup=1 out="$out/runs/models.md" \
      2>"$out/runs/models.err"
  else
    python3 tools/bench_models.py device=$device batch=32 dtype=bfloat16 impl=auto,masked,sparse \
      out="$out/runs/models_bf16_b32.md" 2>"$out/runs/models_bf16_b32.err"
  fi
  pack
fi

if [[ $parts == *,routing,* ]]; then  # issue 43: MoH/dense at batch 32 and at the batch each family trains with
  # eager, compiled and compiled with CUDA graphs (reduce-overhead), bf16, impl=auto, MoH's routing on its Triton
  # kernels (the default on CUDA); one bench_models call per (mode, family, batch), each under `timeout`, the
  # eager ones first, all inside ROUTING_BUDGET seconds (default 450: one 8-minute call with room to pack).
  # TransNeXt trains at 128 where it fits, else at 64 (a step that runs out of memory at 128 is rerun at 64).
  dit=moh_dit_s_2_75:dit_s_2,moh_dit_b_2_75:dit_b_2
  tnx=moh_transnext_base_50:transnext_base
  runs=("eager dit 32" "eager tnx 32" "eager dit 256" "eager tnx 128" "default dit 32" "default dit 256"
        "reduce-overhead dit 32" "reduce-overhead dit 256" "default tnx 32" "default tnx 128"
        "reduce-overhead tnx 32" "reduce-overhead tnx 128")
  settings=(device=$device dtype=bfloat16 impl=auto rounds=7 warmup=2)
  limit=${TIMEOUT_ROUTING:-120}
  [[ -n "$quick" ]] && { runs=("eager dit 2" "default dit 2" "reduce-overhead dit 2"); settings=(device=$device
    quick=true impl=auto rounds=2 warmup=1); dit=moh_dit_s_2_75:dit_s_2; }
  deadline=$((SECONDS + ${ROUTING_BUDGET:-450}))
  if [[ -z "$quick" ]]; then  # first, the Triton routing and its gated merge in a layer against the formulas
    step "routing: gpu tests"
    timeout "${TIMEOUT_TESTS:-110}" python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" -m gpu \
      tests/test_fused_routing.py 2>&1 | tail -20 | tee "$out/runs/routing_gpu_tests.log"
    pack
  fi
  for run in "${runs[@]}"; do
    read -r mode family batch <<<"$run"
    pairs=$dit; [[ $family == tnx ]] && pairs=$tnx
    compiled=(compile=true compile_mode=$mode); [[ $mode == eager ]] && compiled=()
    for try in "$batch" half; do
      [[ $try == half ]] && { grep -qi "out of memory" "$out/runs/$name.err" 2>/dev/null && [[ $batch -gt 64 ]] ||
        break; batch=$((batch / 2)); }
      name="models_routing_${mode}_${family}_b${batch}"
      left=$((deadline - SECONDS)); (( left > limit )) && left=$limit
      (( left < 20 )) && { step "$name: skipped, out of time"; break 2; }
      step "$name (at most ${left}s)"
      timeout "$left" python3 tools/bench_models.py pairs=$pairs batch=$batch "${settings[@]}" "${compiled[@]}" \
        out="$out/runs/$name.md" 2>"$out/runs/$name.err" && break
    done
    pack
  done
fi

if [[ $parts == *,backbones,* ]]; then  # issue 42: the aggregated-attention kernels and the backbones beside timm peers
  if [[ -z "$quick" ]]; then  # first, where a step's time goes (2026-11-27 left that unmeasured): top kernels, short
    step "backbones_profile_b64"
    timeout "${TIMEOUT_PROFILE:-140}" python3 tools/bench_backbones.py \
      pairs=transnext_tiny:swin_tiny_patch4_window7_224 batch=64 device=$device dtype=bfloat16 rounds=2 warmup=1 \
      profile=true components=true out="$out/runs/backbones_profile_b64.md" \
      2>"$out/runs/backbones_profile_b64.err"
    pack
  fi
  step "aggregated attention: gpu tests"
  timeout "${TIMEOUT_TESTS:-110}" python3 -m pytest -v -p no:cacheprovider --noconftest -o addopts="" -m gpu \
    tests/test_aggregated_attention.py tests/test_triton_depthwise.py 2>&1 | tail -40 | tee "$out/runs/aggregated_gpu_tests.log"
  pack
  peers=transnext_tiny:swin_tiny_patch4_window7_224,transnext_base:swin_base_patch4_window7_224
  # batch 64 eager: the profile above (TransNeXt-T / Swin-T); the four steps fit one 10-minute call
  runs=("128 $peers false" "32 transnext_base:swin_base_patch4_window7_224 false"
        "64 transnext_tiny:swin_tiny_patch4_window7_224 true")
  settings=(device=$device dtype=bfloat16 rounds=5 warmup=2 profile=true)
  limit=${TIMEOUT_BENCH:-100}
  # the dry run: tiny models, and time for a CPU to compile them
  [[ -n "$quick" ]] && { runs=("1 quick false" "1 quick true"); settings=(device=$device quick=true); limit=${TIMEOUT_BENCH:-600}; }
  for run in "${runs[@]}"; do
    read -r batch pairs compiled <<<"$run"
    name="backbones_b${batch}$([[ $compiled == true ]] && echo _compiled)"
    step "$name"
    timeout "$limit" python3 tools/bench_backbones.py pairs=$pairs batch=$batch compile=$compiled \
      "${settings[@]}" out="$out/runs/$name.md" 2>"$out/runs/$name.err"
    pack
  done
fi

if [[ $parts == *,candidates,* ]]; then  # issue 42: TransNeXt-T with each CUDA candidate switched on, beside Swin-T
  # (moh_vision/models/cuda_candidates.py; the default forms' figures: part backbones' batch-64 profile run)
  runs=(flex triton_dwconv flex,triton_dwconv compiled_dwgrad)  # the last compiled (it acts under compile only)
  settings=(pairs=transnext_tiny:swin_tiny_patch4_window7_224 batch=64 device=$device dtype=bfloat16 rounds=5 warmup=2)
  [[ -n "$quick" ]] && { runs=(flex,triton_dwconv); settings=(device=$device quick=true); }  # a no-op off CUDA
  for candidate in "${runs[@]}"; do
    name="backbones_b64_${candidate//,/_}"
    step "$name"
    compiled=false limit=${TIMEOUT_CANDIDATES:-100}
    [[ $candidate == *compiled_dwgrad* ]] && { compiled=true; limit=${TIMEOUT_CANDIDATES:-200}; }
    MOH_VISION_TRANSNEXT_CUDA=$candidate timeout "$limit" python3 tools/bench_backbones.py \
      "${settings[@]}" compile=$compiled out="$out/runs/$name.md" 2>"$out/runs/$name.err"
    pack
  done
fi

if [[ $parts == *,train,* ]]; then
  short=(); [[ -n "$quick" ]] && short=(trainer.epochs=1 trainer.max_steps=3)
  amp=bf16; [[ $device == cpu ]] && amp=none
  step "train: classification on the digits, $device, amp $amp"
  python3 train.py trainer.device=$device trainer.amp=$amp "${short[@]}" hydra.run.dir="$out/runs/train_cls" \
    >"$out/runs/train_cls.log" 2>&1
  python3 eval.py ckpt="$out/runs/train_cls/checkpoints/best.pt" eval.device=$device eval.amp=$amp \
    hydra.run.dir="$out/runs/eval_cls" >"$out/runs/eval_cls.log" 2>&1
  pack
  step "train: diffusion on the digits, $device, amp $amp"
  python3 train.py experiment=diffusion trainer.device=$device trainer.amp=$amp trainer.epochs=2 "${short[@]}" \
    hydra.run.dir="$out/runs/train_diffusion" >"$out/runs/train_diffusion.log" 2>&1
  python3 tools/sample.py ckpt="$out/runs/train_diffusion/checkpoints/last.pt" per_class=2 steps=20 device=$device \
    out="$out/runs/samples" >"$out/runs/sample.log" 2>&1
  pack
fi
