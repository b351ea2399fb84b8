"""Python's garbage-collector pauses inside the rollout benchmark's timed sections, with and without
`young_collections_only` (the engine's generate() and the decode windows run under it).

    python lab/gc_pauses.py [--out lab/results/gc-pauses-cpu.json] [--windows 6] [--scale 0.5]
    python lab/gc_pauses.py --full [--only young]

Runs onepath.bench.rollout in this process on the tiny model (CPU unless told otherwise): the fixed-1000
workload (lengths x --scale), consistent mode, then --windows all-decode windows after 150-token prompts
(--full: the README's sequence, both workloads and modes, then windows after 150, 1000 and 3000-token
prompts); first with young_collections_only replaced by a no-op, then as shipped (--only: one of them).
gc.callbacks time every collection; the table gives, per section (each generate, each window with its
prefill and the steps after its timed ones), the full (generation 2) collections and their milliseconds,
and those that fell in the window's timed steps; under each, where it began (the collector's thresholds,
counts and frozen objects then, and the innermost Python frames, which allocated or called gc.collect). The
host work per engine step is the GPU run's, so a pause here is one the H200's windows can meet; its length
depends on this machine's CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench import rollout  # noqa: E402
from onepath.bench.results import environment, save_json  # noqa: E402
from onepath.engine import llm_engine  # noqa: E402


class Pauses:
    """Every collection's generation, milliseconds and whether it fell in a window's timed steps, filed under
    the section running it. A window's timed steps lie between the two device syncs decode_window makes."""

    def __init__(self):
        self.section, self.started, self.sections, self.timed = None, 0.0, [], False

    def __call__(self, phase, info):
        if phase == "start":
            self.started = time.perf_counter()
            if info["generation"] == 2 and self.section is not None:  # who asked: a caller or the thresholds
                self.section["full_starts"].append(dict(
                    threshold=gc.get_threshold(), count=gc.get_count(), frozen=gc.get_freeze_count(),
                    stack=[f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[-14:-1]]))
        elif self.section is not None:
            self.section["collections"].append(
                (info["generation"], (time.perf_counter() - self.started) * 1e3, self.timed))

    def sync(self, sync):
        """rollout._sync, toggling `timed` at a window's syncs (the first opens its timed steps, the second closes)."""
        def wrapped(device):
            sync(device)
            if self.section is not None and self.section["name"].startswith("window"):
                self.timed = not self.timed
        return wrapped

    @contextlib.contextmanager
    def timing(self, name):
        self.section = dict(name=name, collections=[], full_starts=[])
        self.sections.append(self.section)
        try:
            yield
        finally:
            self.section, self.timed = None, False


def run(args, young: bool) -> list[dict]:
    pauses = Pauses()
    generate, window = rollout.timed_generate, rollout.decode_window
    gc_block = llm_engine.young_collections_only if young else contextlib.nullcontext

    def timed_generate(*a, **k):
        with pauses.timing("generate"):
            return generate(*a, **k)

    def decode_window(*a, **k):
        with pauses.timing(f"window {sum(s['name'].startswith('window') for s in pauses.sections) + 1}"):
            return window(*a, **k)

    patched = dict(timed_generate=timed_generate, decode_window=decode_window, young_collections_only=gc_block,
                   _sync=pauses.sync(rollout._sync))
    saved = {name: getattr(rollout, name) for name in patched}
    saved_engine = llm_engine.young_collections_only
    gc.collect()
    gc.callbacks.append(pauses)
    try:
        for name, fn in patched.items():
            setattr(rollout, name, fn)
        llm_engine.young_collections_only = gc_block
        sequence = (["--workloads", "fixed-1000,ragged", "--modes", "consistent,baseline", "--decode-prompts",
                     "150,1000,3000"] if args.full else
                    ["--workloads", "fixed-1000", "--modes", "consistent", "--decode-prompts",
                     ",".join(["150"] * args.windows)])
        rollout.main(["--model", args.model, "--device", args.device, "--no-hf", "--scale", str(args.scale),
                      *(["--threads", "2"] if args.device == "cpu" else []), *sequence, "--out", args.rollout_out])
    finally:
        gc.callbacks.remove(pauses)
        for name, fn in saved.items():
            setattr(rollout, name, fn)
        llm_engine.young_collections_only = saved_engine
    rows = []
    for s in pauses.sections:
        full = [ms for g, ms, _ in s["collections"] if g == 2]
        timed = [ms for g, ms, in_steps in s["collections"] if g == 2 and in_steps]
        rows.append(dict(section=s["name"], full_collections=len(full), full_ms=sum(full),
                         longest_full_ms=max(full, default=0.0), collections=len(s["collections"]),
                         all_ms=sum(ms for _, ms, _ in s["collections"]),
                         full_in_timed_steps=len(timed), full_ms_in_timed_steps=sum(timed),
                         full_starts=s["full_starts"]))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="lab/results/gc-pauses-cpu.json")
    p.add_argument("--rollout-out", default="/tmp/gc-pauses-rollout.json", help="the rollout runs' own JSON")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--scale", type=float, default=0.5)
    p.add_argument("--full", action="store_true",
                   help="the README's rollout sequence instead (both workloads and modes, windows after 150, 1000 "
                        "and 3000-token prompts; no HF)")
    p.add_argument("--only", choices=["plain", "young"], help="one of the two runs")
    args = p.parse_args()
    result = dict(environment(args.device), command="python " + " ".join(sys.argv), options=vars(args), runs={})
    for young in (False, True):
        if args.only and args.only != ("young" if young else "plain"):
            continue
        name = "young_collections_only" if young else "plain gc"
        result["runs"][name] = rows = run(args, young)
        print(f"\n{name}: full collections in timed sections (count, ms, longest ms; of them in a window's timed "
              "steps: count, ms)")
        for r in rows:
            print(f"  {r['section']:>10s} {r['full_collections']:3d} {r['full_ms']:8.1f} {r['longest_full_ms']:8.1f}"
                  f" {r['full_in_timed_steps']:3d} {r['full_ms_in_timed_steps']:8.1f}")
            for start in r["full_starts"]:
                print(f"{'':14s}thresholds {start['threshold']}, counts {start['count']}, frozen {start['frozen']}; "
                      f"from {' <- '.join(reversed(start['stack'][-4:]))}")
    save_json(result, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
