#!/usr/bin/env bash
# The GPU work still open (issues 31-35), one job per name, each made to end inside one device call's ten minutes
# and to leave its results in $OUT as it goes (a machine taken back mid-call keeps what was copied):
#   bash lab/gpu_backlog.sh JOB [JOB...]        (with .whl carried: lab/gpu_call.sh installs it)
# Jobs, in the order they are owed (session 28 ran evidence, reruns, moe-bench, dsv4-bench, ssd-bench, the 32K
# episodes' consistent half and the MoE warm start at 300 steps: bench/results/tests/gpu-tests.log):
#   wall         consistent then baseline, 20 steps each, one after the other, from evidence's warm start (its own
#                where the machine lacks it): the wall time comparison the issue asks for (~4 min)
#   dsv4-rollout DeepSeek-V4's rollout benchmark, consistent / baseline (issue 34's 0.913; it failed to build its
#                engine on the H100 in session 28)
#   long-episode bench/long_episode.py: 4 x 32,768-token episodes, consistent and baseline, diff = 0 before and
#                after the update, peak memory per micro-batch setting (~8 min)
#   family       bench/family_run.py for DeepSeek-V4 then Nemotron-H (8 layers on an H100): the 30-step runs
#   serve        bench/serve.py: 256 streams through the server against the engine alone (issue 35's target), the
#                HTTP front end in its own process and in the engine's thread
#   code         the code task's GRPO run on the GPU (onepath/configs/code.yaml, consistent) and its metrics
#   evidence-moe the four MoE runs (evidence-moe.yaml, warm start 300 steps), two at once (~10 min: may need two
#                calls; a second call resumes from the runs' checkpoints on the same warm machine)
#   evidence-lr  the four dense runs at lr 1e-4 (what makes the mismatch grow), from evidence's warm start where the
#                machine has it
#   evidence     the four dense >= 150-step runs (two at once) and the figure (~8 min)
#   checks, grouped-ws, hybrid, tests, reruns, agentic-tests: GPU test groups (correctness only)
#   ssd-bench, moe-bench, dsv4-bench, moe-calibrate: the kernel timings and the MoE warm start's calibration
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
runs() {  # DIR EXTRA [CONFIG]: the four runs of CONFIG (evidence-dense.yaml) with EXTRA settings, the figure; two at
  # once on an 80 GB card, all four on a larger one (four dense runs held 14.6-24.7 GiB each:
  # bench/results/evidence/README.md)
  local files=("$1/*/metrics.jsonl" "$1/*/spec.json" "$1/*/summary.json" "$1/*.log" "$1/report.png" "$1/evidence.json")
  local mib at_once=2
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  (( ${mib:-0} > 120000 )) && at_once=4
  keep "$(basename "$1")" "${files[@]}"
  EVIDENCE_CONCURRENT=$at_once EVIDENCE_ARGS="$2 --train.save_every 25" timeout 560 \
    bash bench/evidence.sh "${3:-onepath/configs/evidence-dense.yaml}" "$1" 2>&1 | grep -v "it/s" | tail -30
  snap "$(basename "$1")" "${files[@]}"
}
wall() {  # from evidence's warm start where this machine has it, else its own (the same config, ~35 s)
  [[ -d $E/warm_start ]] || python -m onepath train --config onepath/configs/evidence-dense.yaml --out "$E" \
    --train.steps 0 --quiet 2>&1 | tail -2
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
long-episode() {
  timeout 560 python bench/long_episode.py --out "$OUT/long-episode-qwen3-0.6b.json" 2>&1 | tail -12
}
code() {
  timeout 400 python -m onepath train --config onepath/configs/code.yaml --device cuda --mode consistent --quiet \
    --out /tmp/code-gpu 2>&1 | tail -12
  cp /tmp/code-gpu/metrics.jsonl "$OUT/code-gpu-metrics.jsonl" 2>/dev/null
}
dsv4-rollout() {
  timeout 540 python -m onepath.bench.deepseek_v4 rollout --out "$OUT/rollout-flash-4l.json" 2>&1 | tail -14
}
evidence-moe() { runs runs/evidence-moe "" onepath/configs/evidence-moe.yaml; }
serve() {  # the front end in a process of its own (the default now) and in the engine's thread, alternating runs
  for fe in process thread; do
    timeout 270 python bench/serve.py --model qwen3-0.6b --device cuda --requests 256 --prompt-len 512 \
      --max-tokens 512 --front-end $fe --repeat 3 --out "$OUT/serve-qwen3-0.6b-$fe.json" 2>&1 | tail -6
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
