#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go. Run part `backbones` first (issue 52: on the change and on the commit
# before it); every log, table and .json record lands in <out_dir>/runs, and <out_dir>/gpu_checks.tar.gz holds them
# all but checkpoints (refreshed after each step, so a run cut short still returns what it finished; PACK_TO=<dir>
# writes it there instead). Each step runs under `timeout`.
#
#   bash tools/gpu_checks.sh <out_dir> [parts] [quick]
#   bash tools/gpu_checks.sh wheels <dir>     # here: the wheels part `train` needs on a GPU machine
#
# parts (comma-separated; default steps,backbones,tests):
#   steps      one training step of each recipe's model (experiment=moh_transnext_small_80: MoH-TransNeXt-S/80, fp16;
#              experiment=moh_dit_xl_2_90: MoH-DiT-XL/2-90 on ImageNet-256's latents, EMA), batch STEP_BATCH (default
#              4), after a warm-up step, under torch.cuda.set_sync_debug_mode("error") (the batch copied to the device
#              before it): runs/steps.json records per recipe whether it passed, the error and its stack, and which
#              kernels ran and which fell back to their formulas (python -m moh_vision.apps.step_check; needs
#              Hydra: see `wheels`). TIMEOUT_STEPS, default 300 s.
#   backbones  TransNeXt-T beside Swin-T, bf16, batch 64: a profile (each model's time by kind of work and top
#              kernels) with TransNeXt-T's pieces under every CUDA implementation (components); then
#              benchmarks/bench_kernels.py on TransNeXt-T, the same weights under kernels variants (auto; the aggregated
#              attention's reference and flex; the depthwise convolution's channels_last, triton, written_grad;
#              no recompute): the records that decide the CUDA defaults; then TransNeXt-T/-B beside Swin-T/-B at
#              batch 128 and TransNeXt-B beside Swin-B at batch 32 (peak memory). TIMEOUT_BENCH (default 120 s) a step.
#   tests      the `gpu` tests (routing, aggregated attention, depthwise kernels; TIMEOUT_TESTS, default 150 s).
#   models     benchmarks/bench_models.py, bf16, batch 32 (MoH against its dense twin), and benchmarks/bench_kernels.py on
#              MoH-DiT-B/2 with kernels.routing=reference against the fused routing.
#   routing    the MoH/dense pairs (DiT-S/2, DiT-B/2, TransNeXt-Base) in bf16, batch 32, eager and compiled.
#   train      the README's first command on the GPU with bf16 autocast, eval.py on its checkpoint, a short
#              `experiment=diffusion` run and tools/sample.py on it: the trainer end to end on CUDA.
# `quick` runs tiny settings, on the CPU when there is no GPU: a dry run of this script.
#
# The lent GPU machines have torch, Triton, timm (another version), tqdm, PyYAML, scikit-learn and matplotlib, but
# not Hydra, OmegaConf or fvcore: `wheels <dir>` writes them (the versions requirements.txt pins) for the machine to
# install with `pip install --no-index --no-deps --target /tmp/site <dir>/*.whl` and `PYTHONPATH=/tmp/site`.
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
out=${1:?usage: bash tools/gpu_checks.sh <out_dir> [steps,backbones,tests,models,routing,train] [quick]}
parts=",${2:-steps,backbones,tests},"
quick=${3:-}
mkdir -p "$out/runs"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled MPLBACKEND=Agg PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
device=cuda
python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || device=cpu
limit=${TIMEOUT_BENCH:-120}
[[ -n "$quick" ]] && limit=${TIMEOUT_BENCH:-600}  # a CPU compiles the tiny models slowly

pack() { tar -czf "${PACK_TO:-$out}/gpu_checks.tar.gz" --exclude='*.pt' -C "$out" runs; }
step() { echo "== $*" >&2; }
run() {  # run <name> <benchmark> <args...>: one timed step, its table and record under runs/<name>.*
  local name=$1 tool=$2; shift 2
  step "$name"
  timeout "$limit" python3 "benchmarks/$tool.py" "$@" out="$out/runs/$name.md" 2>"$out/runs/$name.err"
  pack
}

{
  date -u
  git rev-parse --short HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1 || true
} | tee "$out/runs/env.txt"

if [[ $parts == *,steps,* ]]; then
  step "steps: a training step of each recipe's model, $device, sync debug mode error"
  recipes=(moh_transnext_small_80 moh_dit_xl_2_90)
  [[ -n "$quick" ]] && recipes=("moh_transnext_small_80+model=transnext_nano+attention=moh+data.img_size=32"
                                "moh_dit_xl_2_90+model=dit_tiny_2+attention=moh")
  timeout "${TIMEOUT_STEPS:-300}" python3 -m moh_vision.apps.step_check "$out/runs/steps.json" "${STEP_BATCH:-4}" \
    "${recipes[@]}" 2>&1 | tail -40 | tee "$out/runs/steps.log"
  pack
fi

tiny=transnext_tiny:swin_tiny_patch4_window7_224
base=transnext_base:swin_base_patch4_window7_224
if [[ $parts == *,backbones,* ]]; then
  if [[ -n "$quick" ]]; then
    run backbones_profile bench_backbones quick=true device=$device profile=true components=true
    run kernels_tiny bench_kernels model=transnext_nano batch=1 rounds=1 warmup=1 device=$device \
      variants=auto,aggregated=reference,recompute=reference
  else
    run backbones_profile_b64 bench_backbones pairs=$tiny batch=64 device=$device dtype=bfloat16 rounds=3 warmup=1 \
      profile=true components=true
    run kernels_tiny_b64 bench_kernels model=transnext_tiny batch=64 device=$device dtype=bfloat16 rounds=5 warmup=2 \
      variants=auto,aggregated=reference,aggregated=flex,depthwise=channels_last,depthwise=triton,\
depthwise=written_grad,recompute=reference
    run backbones_b128 bench_backbones pairs=$tiny,$base batch=128 device=$device dtype=bfloat16 rounds=5 warmup=2
    run backbones_base_b32 bench_backbones pairs=$base batch=32 device=$device dtype=bfloat16 rounds=5 warmup=2
  fi
fi

if [[ $parts == *,tests,* ]]; then
  step "gpu tests"
  timeout "${TIMEOUT_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" -m gpu \
    tests/test_fused_routing.py tests/test_aggregated_attention.py tests/test_depthwise.py 2>&1 |
    tail -40 | tee "$out/runs/gpu_tests.log"
  pack
fi

if [[ $parts == *,models,* ]]; then
  if [[ -n "$quick" ]]; then
    run models bench_models device=$device quick=true rounds=2 warmup=1
  else
    run models_bf16_b32 bench_models device=$device batch=32 dtype=bfloat16 rounds=7
    run kernels_moh_dit_b_b32 bench_kernels model=moh_dit_b_2_75 batch=32 device=$device dtype=bfloat16 rounds=7 \
      variants=auto,routing=reference
  fi
fi

if [[ $parts == *,routing,* ]]; then
  pairs=moh_dit_s_2_75:dit_s_2,moh_dit_b_2_75:dit_b_2,moh_transnext_base_50:transnext_base; batch=32
  [[ -n "$quick" ]] && { pairs=moh_dit_s_2_75:dit_s_2; batch=2; }
  for mode in eager default reduce-overhead; do
    compiled=(compile=true compile_mode=$mode); [[ $mode == eager ]] && compiled=()
    run "models_routing_${mode}_b$batch" bench_models pairs=$pairs batch=$batch device=$device dtype=bfloat16 \
      rounds=7 warmup=2 "${compiled[@]}"
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
