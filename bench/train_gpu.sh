#!/usr/bin/env bash
# GRPO on a Qwen3-0.6B-shaped model on one GPU (onepath/configs/qwen3-0.6b-gpu.yaml): warm start, then
# train.steps steps in consistent and in baseline mode, then the report:
#   bash bench/train_gpu.sh
# Writes $OUT/qwen3-0.6b-gpu/ (consistent/, baseline/, summary.json, report.png) and $OUT/train-gpu.json
# (the summary with command, date, GPU, versions, wall time); without $OUT, under runs/.
# Extra arguments go to `onepath train`, e.g. --train.steps 20 or --resume.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
root=${OUT:-runs}
out=$root/qwen3-0.6b-gpu
command=(onepath train --config onepath/configs/qwen3-0.6b-gpu.yaml --mode both --out "$out" --quiet "$@")
start=$(date +%s)
status=0
"$python" -m onepath.cli "${command[@]:1}" || status=$?
seconds=$(( $(date +%s) - start ))
"$python" -m onepath.cli report "$out"
"$python" - "$out" "$root/train-gpu.json" "$seconds" "${command[*]}" <<'PY'
import datetime, json, platform, sys
from pathlib import Path
import torch
out, record_path, seconds, command = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
summary = out / "summary.json"
record = {
    "command": f"bash bench/train_gpu.sh  ({command})",
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
    "wall_seconds": seconds,
    "summary": json.loads(summary.read_text()) if summary.is_file() else None,
}
record_path.write_text(json.dumps(record, indent=2) + "\n")
print(f"wrote {record_path}")
PY
exit $status
