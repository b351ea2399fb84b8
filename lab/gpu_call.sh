#!/usr/bin/env bash
# The device tool's preamble for a GPU call: the carried wheels into /tmp/site, the repo on the path, and a
# copier that tars the named globs into $OUT/NAME.tgz every 15 s (a machine taken back mid-call keeps what was
# copied).   source lab/gpu_call.sh; keep NAME 'runs/x/*/metrics.jsonl' ...; ...; snap NAME 'runs/x/*/...' ...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# (compute-sanitizer refuses expandable segments' cuMemCreate: unset PYTORCH_CUDA_ALLOC_CONF before it)
snap() {  # NAME GLOB...: tar what the globs match into $OUT/NAME.tgz, now
  local name=$1 globs=("${@:2}")
  tar czf "$OUT/$name.tmp" $(ls -d ${globs[@]} 2>/dev/null) 2>/dev/null && mv "$OUT/$name.tmp" "$OUT/$name.tgz"
}
keep() {  # NAME GLOB...: snap now and every 15 s until the call ends (one copier at a time: a new one stops the last)
  [[ -n ${_KEEP_PID:-} ]] && kill "$_KEEP_PID" 2>/dev/null
  ( while true; do snap "$@"; sleep 15; done ) &
  _KEEP_PID=$!
}
