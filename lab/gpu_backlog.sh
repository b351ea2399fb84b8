#!/usr/bin/env bash
# The GPU work still open (issues 31-35), one job per name, each made to end inside one device call's ten minutes
# and to leave its results in $OUT as it goes (a machine taken back mid-call keeps what was copied):
#   bash lab/gpu_backlog.sh JOB [JOB...]        (with .whl carried: lab/gpu_call.sh installs it)
# Jobs, in the order they are owed:
#   evidence     the four dense >= 150-step runs (two at once) and the figure: $OUT/evidence.tgz (~8 min)
#   wall         consistent then baseline, 20 steps each, one after the other, from evidence's warm start: the
#                wall time comparison the issue asks for (needs evidence's runs/ on the same warm machine)
#   evidence-lr  the four runs at lr 1e-4 (what makes the mismatch grow), from evidence's warm start where the
#                machine has it
#   tests        the GPU tests not yet passed: DeepSeek-V4's graph / engine-trainer cases, the baseline's library
#                FP8 GEMM at K 2816 (~6 min)
#   hybrid       the SSD kernels' GPU tests (the split dots and the column blocks changed their bits), the
#                Nemotron-H model's, and the sliced hybrid's gates (C7 with the split)
#   reruns       the GPU tests session 27's call failed and the CPU mended (the captured SSD decode step, DeepSeek-V4's
#                engine = trainer / baseline / planted ties, the library FP8 GEMM), then C7 over 8 CUDA draws (is
#                mamba.ssm's 2.15x the stock path's error the draw or the CUDA path?) (~5 min)
#   ssd-bench    bench/kernels_ssd.py (the split's cost, 8 warps beside 4; a quiet GPU)
#   checks       grouped-ws, hybrid, tests and agentic-tests at once (correctness only, no timings: ~9 min)
#   moe-calibrate  evidence-moe.yaml's warm start (600 steps, uncalibrated): val/score after it and one RL step, at
#                300 and 600 warm-start steps (the issue wants 0.2-0.5), consistent mode
#   grouped-ws   the warp-specialized grouped FP8 kernel's GPU tests, with the tile map's aligned first rows (its
#                first launch faulted at an unaligned TMA coordinate); compute-sanitizer on its first case if
#                they fail
#   dsv4-bench   DeepSeek-V4's index_topk (k = 2048) against torch.topk (issue 34's 5.9 us), lab/topk_split.py's
#                rows cut over many programs beside it, eager and in CUDA graphs, then its rollout
#                benchmark, consistent / baseline (issue 34's 0.913)
#   family       bench/family_run.py for DeepSeek-V4 then Nemotron-H (8 layers on an H100)
#   moe-bench    bench/kernels_moe.py at 256 and 8192 tokens (a quiet GPU: nothing beside it)
#   agentic-tests  the server's and the long episodes' GPU tests
#   agentic      issue 35 on the GPU: agentic-tests, bench/long_episode.py
#                (4 x 32,768-token episodes, diff = 0, peak memory), then the code task's GRPO run
#                (onepath/configs/code.yaml, consistent) and its metrics
#   serve        bench/serve.py: 256 streams through the server against the engine alone (issue 35's target), at
#                Python's GIL switch interval and at 0.5 ms
set -uo pipefail
cd "$(dirname "$0")/.."
source lab/gpu_call.sh
E=runs/evidence-dense
evidence() { runs "$E" ""; }
evidence-lr() {  # from evidence's warm start where this machine has it, else from its own
  local L=runs/evidence-dense-lr1e-4
  [[ -d $E/warm_start && ! -d $L ]] && mkdir -p "$L" && cp -r "$E/data" "$E/warm_start" "$L/"
  runs "$L" "--train.lr 1e-4"
}
runs() {  # DIR EXTRA: the four runs of evidence-dense.yaml with EXTRA settings, the figure; two at once on an
  # 80 GB card, all four on a larger one (four held 14.6-24.7 GiB each: bench/results/evidence/README.md)
  local files=("$1/*/metrics.jsonl" "$1/*/spec.json" "$1/*/summary.json" "$1/*.log" "$1/report.png" "$1/evidence.json")
  local mib at_once=2
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  (( ${mib:-0} > 120000 )) && at_once=4
  keep "$(basename "$1")" "${files[@]}"
  EVIDENCE_CONCURRENT=$at_once EVIDENCE_ARGS="$2 --train.save_every 25" timeout 560 \
    bash bench/evidence.sh onepath/configs/evidence-dense.yaml "$1" 2>&1 | grep -v "it/s" | tail -30
  snap "$(basename "$1")" "${files[@]}"
}
wall() {
  for mode in consistent baseline; do
    local extra=(); [[ $mode == baseline ]] && extra=(--trainer_quant none)
    python -m onepath train --config onepath/configs/evidence-dense.yaml --model.path "$E/warm_start" \
      --warm_start.steps 0 --train.steps 20 --train.val_every 0 --mode "$mode" "${extra[@]}" --quiet \
      --out "/tmp/wall-$mode" 2>&1 | tail -4
    cp "/tmp/wall-$mode/metrics.jsonl" "$OUT/wall-$mode-metrics.jsonl"
  done
}
tests() {
  timeout 540 python -m pytest -q -rf --tb=line -p no:cacheprovider -m "gpu_smoke or gpu" \
    tests/ops/test_linear_fp8_gpu.py tests/models/test_deepseek_v4_gpu.py \
    -k "baseline_runs_the_librarys or request_alone or graph_equals or engine_equals or baseline_trainer or planted" \
    2>&1 | tail -40 | tee "$OUT/tests.txt"
}
moe-calibrate() {
  for steps in 300 600; do
    timeout 280 python -m onepath train --config onepath/configs/evidence-moe.yaml --out "/tmp/moe-ws$steps" \
      --warm_start.steps $steps --train.steps 1 --train.val_every 1 --mode consistent --quiet 2>&1 | tail -6
    cp "/tmp/moe-ws$steps/metrics.jsonl" "$OUT/moe-ws$steps-metrics.jsonl" 2>/dev/null
  done
}
grouped-ws() {
  timeout 400 python -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/ops/test_linear_grouped_fp8_gpu.py \
    -k warp_specialized 2>&1 | tail -40 | tee "$OUT/grouped-ws.txt"
  if ! grep -q " passed" "$OUT/grouped-ws.txt" || grep -q "failed\|error" "$OUT/grouped-ws.txt"; then
    (unset PYTORCH_CUDA_ALLOC_CONF; timeout 150 compute-sanitizer --tool memcheck python -m pytest -q -x -m gpu \
      -p no:cacheprovider tests/ops/test_linear_grouped_fp8_gpu.py -k "warp_specialized and awkward_bf16" 2>&1 \
      | head -60 > "$OUT/grouped-ws-sanitizer.txt")
  fi
}
hybrid() {
  timeout 360 python -m pytest -q -rf --tb=short -p no:cacheprovider -m "gpu_smoke or gpu" tests/ops/test_ssd_gpu.py \
    tests/models/test_nemotron_h_gpu.py tests/consistency/test_hybrid_check_gpu.py 2>&1 | tail -40 | tee "$OUT/hybrid.txt"
}
reruns() {
  timeout 300 python -m pytest -q -rf --tb=short -p no:cacheprovider -m "gpu_smoke or gpu" tests/ops/test_ssd_gpu.py \
    tests/models/test_deepseek_v4_gpu.py tests/ops/test_linear_fp8_gpu.py -k "captured_decode_step or engine_equals \
    or baseline_trainer or planted or baseline_runs_the_librarys" 2>&1 | tail -30 | tee "$OUT/reruns.txt"
  timeout 200 python lab/c7_bf16_draws.py 8 cuda 2>&1 | tail -16 | tee "$OUT/c7-cuda-draws.log"
}
ssd-bench() {
  timeout 240 python bench/kernels_ssd.py --warps 8 --out "$OUT/kernels-ssd.json" 2>&1 | tail -30
}
agentic-tests() {
  timeout 200 python -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/serve/test_app_gpu.py \
    tests/*/test_long_episode_gpu.py 2>&1 | tail -20 | tee "$OUT/agentic-tests.txt"
}
checks() {  # each job's output lands in its own $OUT file; the console gets their tails after all end
  local job pids=() jobs=(grouped-ws hybrid tests agentic-tests)
  for job in "${jobs[@]}"; do "$job" > "$OUT/console-$job.txt" 2>&1 & pids+=($!); done
  wait "${pids[@]}"
  for job in "${jobs[@]}"; do echo "-- $job"; tail -8 "$OUT/console-$job.txt"; done
}
agentic() {
  agentic-tests
  timeout 300 python bench/long_episode.py --out "$OUT/long-episode-qwen3-0.6b.json" 2>&1 | tail -12
  timeout 250 python -m onepath train --config onepath/configs/code.yaml --device cuda --mode consistent --quiet \
    --out /tmp/code-gpu 2>&1 | tail -12
  cp /tmp/code-gpu/metrics.jsonl "$OUT/code-gpu-metrics.jsonl" 2>/dev/null
}
serve() {
  for ms in 5 0.5; do
    timeout 280 python bench/serve.py --model qwen3-0.6b --device cuda --requests 256 --prompt-len 512 \
      --max-tokens 512 --gil-switch-ms $ms --out "$OUT/serve-qwen3-0.6b-switch$ms.json" 2>&1 | tail -4
  done
}
dsv4-bench() {
  for shape in "--rows 64 --length 32768" "--rows 256 --length 8192" "--rows 1 --length 32768"; do
    # shellcheck disable=SC2086
    timeout 90 python -m onepath.bench.deepseek_v4 topk $shape --sweep 2>&1 | tail -16 | tee -a "$OUT/topk.txt"
  done
  timeout 120 python lab/topk_split.py 2>&1 | tail -4 | tee "$OUT/topk-split.txt"
  timeout 400 python -m onepath.bench.deepseek_v4 rollout --out "$OUT/rollout-flash-4l.json" 2>&1 | tail -12
}
family() {
  for preset in deepseek-v4-flash-4l "nemotron-3-nano-13l --layers 8"; do
    local name=${preset%% *}
    # shellcheck disable=SC2086
    timeout 280 python bench/family_run.py --preset $preset --device cuda --mode-timeout 130 \
      --run-dir "/tmp/$name" --out "$OUT/family-$name.json" 2>&1 | tail -12
  done
}
moe-bench() {
  timeout 540 python bench/kernels_moe.py --tokens 256 8192 --rep-ms 60 --out "$OUT/kernels-moe.json" 2>&1 | tail -20
}
for job in "$@"; do
  echo "== $job"
  "$job"
done
