#!/usr/bin/env bash
# The headline experiment: consistent vs the fast baseline users run (FP8 rollout on the stock kernels, an
# unquantised trainer), and that baseline with TIS and with MIS; one warm start shared by the four runs
# (the same weights, seeds and data order), then the figure.
#
#   bash bench/evidence.sh [CONFIG] [OUT]
#     CONFIG  default onepath/configs/evidence-dense.yaml (onepath/configs/evidence-moe.yaml: the MoE)
#     OUT     default runs/evidence-<config name>; OUT/report.png and OUT/<run>/metrics.jsonl
# Extra settings for every run go in $EVIDENCE_ARGS, e.g. EVIDENCE_ARGS="--train.steps 20".
# Run again on the same OUT, it goes on where it stopped: the warm start is reused, each run resumes from its
# latest checkpoint (train.save_every), a finished run is kept as it is.
# EVIDENCE_CONCURRENT=N runs up to N of the four at once on the one device (each run's log in OUT/<run>.log): the
# same steps and bits, in less time where one run leaves the GPU idle; each run's wall time is then its time on a
# shared device, so compare wall times from runs made one after another. The four dense runs at once did not fit
# an 80 GB H100's memory, two did (bench/results/evidence/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-onepath/configs/evidence-dense.yaml}
name=$(basename "$config" .yaml)
out=${2:-runs/$name}
py=${PYTHON:-python}
read -r -a extra <<< "${EVIDENCE_ARGS:-}"
train() { "$py" -m onepath train --config "$config" "${extra[@]}" "$@"; }

train --out "$out" --train.steps 0                       # the data and the warm start: $out/warm_start
shared=(--model.path "$out/warm_start" --warm_start.steps 0 --resume)
fast="--mode baseline --trainer_quant none"               # the baseline: FP8 rollout on stock kernels, BF16 trainer
declare -A args=(
  [consistent]="--mode consistent"
  [baseline]="$fast"
  [baseline-tis]="$fast --train.rollout_is token"
  [baseline-mis]="$fast --train.rollout_rs token")
names=(consistent baseline baseline-tis baseline-mis)
one() {  # one run: NAME
  local -a own; read -r -a own <<< "${args[$1]}"
  train "${shared[@]}" --out "$out/$1" "${own[@]}"
}
at_once=${EVIDENCE_CONCURRENT:-1}
if (( at_once > 1 )); then
  for n in "${names[@]}"; do
    while (( $(jobs -rp | wc -l) >= at_once )); do wait -n || true; done
    rm -f "$out/$n.rc"
    ( set +e; one "$n" > "$out/$n.log" 2>&1; echo $? > "$out/$n.rc" ) &
  done
  wait
  failed=0
  for n in "${names[@]}"; do
    if [[ $(cat "$out/$n.rc" 2>/dev/null) == 0 ]]; then tail -n 6 "$out/$n.log"
    else failed=1; echo "run $n failed: $out/$n.log" >&2; tail -n 20 "$out/$n.log" >&2; fi
  done
  (( failed == 0 ))
else
  for n in "${names[@]}"; do one "$n"; done
fi
runs=("${names[@]/#/$out/}")
"$py" -m onepath report "${runs[@]}" --out "$out/report.png"
"$py" - "$out/evidence.json" "bash bench/evidence.sh $* (EVIDENCE_ARGS=${EVIDENCE_ARGS:-})" "${runs[@]}" <<'PY'
import json, sys
from pathlib import Path
from onepath.bench.results import environment
from onepath.train.report import report_summary
import torch
path, command, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
record = {"command": command, **environment("cuda" if torch.cuda.is_available() else "cpu"),
          "runs": report_summary(runs)}
path.write_text(json.dumps(record, indent=2) + "\n")
print(f"wrote {path}")
PY
