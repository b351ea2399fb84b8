#!/usr/bin/env bash
# Runs the embedded demo (what `make demo` runs) and records its summary with the machine it ran on in
# bench/results/demo/demo-cpu.json, its report in bench/results/demo/report.png (the README's picture).
set -euo pipefail
cd "$(dirname "$0")/.."
make install >/dev/null
out=runs/demo-bench
rm -rf "$out"
start=$(date +%s)
.venv/bin/onepath train --config onepath/configs/demo.yaml --mode both --out "$out" --quiet
end=$(date +%s)
.venv/bin/python - "$out" "$((end - start))" <<'PY'
import json, os, platform, sys, datetime
import torch
out, seconds = sys.argv[1], int(sys.argv[2])
record = {
    "command": "bash bench/demo_cpu.sh  (onepath train --config onepath/configs/demo.yaml --mode both)",
    "date": datetime.date.today().isoformat(),
    "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                "python": platform.python_version(), "torch": torch.__version__},
    "wall_seconds_incl_setup": seconds,
    "summary": json.load(open(os.path.join(out, "summary.json"))),
}
os.makedirs("bench/results/demo", exist_ok=True)
json.dump(record, open("bench/results/demo/demo-cpu.json", "w"), indent=2)
print(json.dumps(record["summary"], indent=2))
PY
cp "$out/report.png" bench/results/demo/report.png
