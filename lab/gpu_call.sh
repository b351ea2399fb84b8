#!/usr/bin/env bash
# The device tool's preamble for a GPU call: the carried wheels into /tmp/site, the repo on the path, and a
# copier that tars the named globs into $OUT every 15 s (a machine taken back mid-call keeps what was copied).
#   source lab/gpu_call.sh; keep 'runs/x/*/metrics.jsonl' ...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
keep() {  # GLOB...: tar them into $OUT/kept.tgz now and every 15 s until the call ends
  local globs=("$@")
  ( while true; do tar czf "$OUT/kept.tmp" $(ls -d ${globs[@]} 2>/dev/null) 2>/dev/null \
      && mv "$OUT/kept.tmp" "$OUT/kept.tgz"; sleep 15; done ) &
}
snap() { tar czf "$OUT/kept.tmp" $(ls -d "$@" 2>/dev/null) 2>/dev/null && mv "$OUT/kept.tmp" "$OUT/kept.tgz"; }
