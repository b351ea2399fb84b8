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
train "${shared[@]}" --out "$out/consistent" --mode consistent
fast=("${shared[@]}" --mode baseline --trainer_quant none)
train "${fast[@]}" --out "$out/baseline"
train "${fast[@]}" --out "$out/baseline-tis" --train.rollout_is token
train "${fast[@]}" --out "$out/baseline-mis" --train.rollout_rs token
runs=("$out/consistent" "$out/baseline" "$out/baseline-tis" "$out/baseline-mis")
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
