"""bisect: the first operator whose outputs differ between two sides, and a standalone repro of it.

A side is a model (its ops: backend and ExecutionSpec), a Layout (whole prefill as the trainer's
forward, prefill then decode as the engine, chunked prefill, logits on all rows or on sampling rows)
and the batch the probe sequence shares (other sequences, the probe's place among them). Both sides
run the same probe tokens; every op output is recorded at the `ops` boundary and compared row by
row for the probe's tokens (the alignment rule is in recorder.py). Sites are compared in the order a
forward pass calls them, so at the first differing site every input of the probe's rows is equal on
both sides (outputs of earlier sites, for this and earlier tokens): the operator itself diverges.

The repro holds that operator's inputs on each side (the whole launch: the batch rows and the KV
cache it was given) as safetensors, each side's backend class and spec, the probe's rows, and
repro.py, which calls the op on each side and compares those rows; it exits 1 when they differ.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from onepath.consistency.recorder import Layout, Site, SiteRows, check_same_sites, common_region, snapshot, trace
from onepath.engine.device import require_device
from onepath.models import build_decoder
from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops


@dataclass(slots=True)
class Side:
    model: DenseDecoder
    layout: Layout = Layout()
    others: list[list[int]] = field(default_factory=list)   # sequences sharing the probe's passes
    at: int = 0                                              # the probe's place among them
    label: str = ""

    def sequences(self, probe: list[int]) -> tuple[list[list[int]], int]:
        at = min(self.at, len(self.others))
        return self.others[:at] + [list(probe)] + self.others[at:], at

    def describe(self) -> str:
        ops, spec = self.model.ops, self.model.ops.spec
        batch = f"in a batch of {len(self.others) + 1} at {min(self.at, len(self.others))}" if self.others else "alone"
        backend = "" if type(ops) is Ops else f" ({type(ops).__qualname__})"
        head = f"{self.label}: " if self.label else ""
        return f"{head}{batch}, {self.layout.describe()} | {spec.mode} {spec.device} spec {spec.hash()}{backend}"


@dataclass(slots=True)
class SiteDiff(Site):
    site: int                  # the site's index in call order
    shape: list[int]           # the compared rows of the first output, [tokens, ...]
    dtype: str
    differing: int             # elements that differ (all outputs of the op)
    elements: int
    max_abs: float
    max_ulp: int
    first_position: int | None  # the probe's first token position that differs


@dataclass(slots=True)
class BisectReport:
    a: str
    b: str
    probe_tokens: int
    sites: list[SiteDiff]
    first: SiteDiff | None
    repro: str | None = None
    reproduces: bool | None = None  # the op alone on the captured inputs still differs

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "probe_tokens": self.probe_tokens, "diverges": self.first is not None,
                "first": dataclasses.asdict(self.first) if self.first else None, "repro": self.repro,
                "reproduces": self.reproduces,
                "sites": [dataclasses.asdict(s) for s in self.sites]}

    def format(self, all_sites: bool = False) -> str:
        lines = [f"bisect  A: {self.a}", f"        B: {self.b}",
                 f"probe: {self.probe_tokens} tokens, {len(self.sites)} sites compared"]
        if all_sites:
            lines += [f"  {s.site:4d} {s.name:48s} {s.differing:8d} / {s.elements:<8d} max|d| {s.max_abs:.3g}  "
                      f"{s.max_ulp} ULP" for s in self.sites]
        f = self.first
        if f is None:
            lines.append("no divergence: every site is bitwise equal over the probe's tokens")
            return "\n".join(lines)
        later = [s for s in self.sites if s.differing]
        layers = sorted({s.layer for s in later if s.layer is not None})
        layer = "" if f.layer is None else f"layer {f.layer}, "
        lines += [f"FIRST DIVERGENCE: {f.name} ({layer}site {f.site}), first at position {f.first_position}",
                  f"  rows {f.shape} {f.dtype}: {f.differing} of {f.elements} elements differ, "
                  f"max |d| {f.max_abs:.3g}, max {f.max_ulp} ULP",
                  f"  sites that differ: {len(later)} of {len(self.sites)}"
                  + (f" (layers {layers[0]}..{layers[-1]})" if layers else "")]
        alone = ("reproduces alone" if self.reproduces else "does NOT reproduce alone: the output depends on more "
                 "than the inputs (a non-deterministic kernel, global state)")
        if self.repro:
            lines.append(f"  repro: python {self.repro}  ({alone})")
        elif self.reproduces is not None:
            lines.append(f"  a module-level site: no repro script (it needs the module's weights); rerun on the "
                         f"captured inputs: {alone}")
        return "\n".join(lines)


_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between a and b of one float dtype (0 for +0 vs -0), as int64."""
    if not a.is_floating_point():
        return (a.long() - b.long()).abs()
    if a.dtype not in _INT_VIEW:
        a, b = a.float(), b.float()
    view = _INT_VIEW[a.dtype]
    magnitude = torch.iinfo(view).max

    def ordered(x):
        i = x.contiguous().view(view).long()
        return torch.where(i < 0, -(i & magnitude), i)
    return (ordered(a) - ordered(b)).abs()


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise a != b, NaN equal to NaN (torch.equal's notion of equal, elementwise)."""
    d = a != b
    if a.is_floating_point():
        d &= ~(a.isnan() & b.isnan())
    return d


def compare_site(k: int, site: Site, a: SiteRows, b: SiteRows) -> SiteDiff:
    positions, ia, ib = a.common(b)
    shape, dtype = [0], "none"
    count = elements = max_ulp = 0
    max_abs, first = 0.0, None
    for i, (x, y) in enumerate(zip(a.values, b.values)):
        x, y = x[ia], y[ib]
        real = [m[idx] if m is not None else torch.ones_like(v, dtype=torch.bool)
                for m, v, idx in ((a.present[i], x, ia), (b.present[i], y, ib))]
        # trailing dims that grow with a pass's longest context (candidate entries) are compared where they overlap
        x, y, ra, rb = common_region(x, y, *real)
        if shape == [0]:
            shape, dtype = list(x.shape), str(x.dtype).removeprefix("torch.")
        if x.dtype != y.dtype:  # two specs with different storage dtypes: compare values, ULPs of the coarser one
            coarse = x.dtype if torch.finfo(x.dtype).eps > torch.finfo(y.dtype).eps else y.dtype
            x, y = x.to(coarse), y.to(coarse)
        d = differs(x, y) & ra & rb
        elements += d.numel()
        n = int(d.sum())
        if n == 0:
            continue
        count += n
        delta = (x.double() - y.double()).abs().nan_to_num(nan=float("inf"))[d]
        max_abs = max(max_abs, float(delta.max()))
        max_ulp = max(max_ulp, int(ulp_distance(x[d], y[d]).max()))
        row = int(d.reshape(d.shape[0], -1).any(dim=1).nonzero()[0])
        first = positions[row] if first is None else min(first, positions[row])
    return SiteDiff(site.op, site.module, site.layer, k, shape, dtype, count, elements, max_abs, max_ulp, first)


def bisect(a: Side, b: Side, probe: list[int], out_dir: str | Path | None = None,
           block_size: int = BLOCK_SIZE) -> BisectReport:
    """Compare every op output of the probe's tokens on sides a and b; write a repro of the first
    divergence under out_dir when given."""
    seqs_a, pa = a.sequences(probe)
    seqs_b, pb = b.sequences(probe)
    ta = trace(a.model, seqs_a, a.layout, block_size)
    tb = trace(b.model, seqs_b, b.layout, block_size)
    check_same_sites(ta, tb)
    sites = [compare_site(k, s, ta.rows[k][pa], tb.rows[k][pb]) for k, s in enumerate(ta.sites)]
    first = next((s for s in sites if s.differing), None)
    report = BisectReport(a.describe(), b.describe(), len(probe), sites, first)
    if first is not None and out_dir is not None:
        launch_a = _launch(ta.rows[first.site][pa], first.first_position)
        launch_b = _launch(tb.rows[first.site][pb], first.first_position)
        shared = sorted(launch_a.keys() & launch_b.keys())
        calls = {}
        for key, side, seqs, launch in (("a", a, seqs_a, launch_a), ("b", b, seqs_b, launch_b)):
            index = launch[first.first_position][0]
            # a second run captures this one launch's inputs: capturing all would copy every KV cache
            call = trace(side.model, seqs, side.layout, block_size, capture={index}).captured[index]
            calls[key] = (side, call, [launch[p][1] for p in shared])
        if not any(isinstance(call.ops, torch.nn.Module) for _, call, _ in calls.values()):
            # a module-level site (MoE experts) needs its module's weights: no standalone script, the rerun only
            report.repro = str(write_repro(Path(out_dir), first, shared, calls))
        report.reproduces = _rerun(calls)
    return report


@torch.no_grad()
def _rerun(calls: dict) -> bool:
    """Does the op, called alone on each side's captured inputs, still give the probe's rows different bits?"""
    outs = []
    for _, call, rows in calls.values():
        out = call.function()(**{k: snapshot(v) for k, v in call.inputs.items()})
        outs.append([o[rows] for o in (out if isinstance(out, tuple) else (out,))])
    return any(x.dim() != y.dim() or bool(differs(*common_region(x, y)).any()) for x, y in zip(*outs))


def _launch(rows: SiteRows, position: int) -> dict[int, tuple[int, int]]:
    """position -> (call, row) for the positions computed by the launch that computed `position`."""
    call = rows.calls[rows.positions.index(position)]
    return {p: (c, r) for p, c, r in zip(rows.positions, rows.calls, rows.rows) if c == call}


REPRO_SCRIPT = '''"""{title}

Calls the operator on each side's recorded inputs with each side's backend and spec, and compares
the rows of the probe's tokens. Exit status 1 when they differ (the divergence reproduces)."""
import importlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from onepath.numerics.spec import ExecutionSpec

HERE = Path(__file__).resolve().parent
case = json.loads((HERE / "case.json").read_text())
tensors = load_file(HERE / "inputs.safetensors")
sys.path[:0] = case["sys_path"]


def load(path):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def decode(v, device):
    if "tensor" in v:
        return tensors[v["tensor"]].to(device)
    if "dtype" in v:
        return getattr(torch, v["dtype"])
    if "dataclass" in v:
        return load(v["dataclass"])(**{{k: decode(f, device) for k, f in v["fields"].items()}})
    return v["value"]


def run(side):
    spec = ExecutionSpec.from_dict(side["spec"])
    ops = load(side["ops_class"])(spec)
    out = getattr(ops, case["op"])(**{{k: decode(v, spec.device) for k, v in side["args"].items()}})
    return [o[side["rows"]].cpu() for o in (out if isinstance(out, tuple) else (out,))]


print(f"{{case['op']}} at {{case['module'] or 'the model'}}, positions {{case['positions']}}")
for key in ("a", "b"):
    print(f"  {{key.upper()}}: {{case[key]['label']}}")
diverged = False
for i, (x, y) in enumerate(zip(run(case["a"]), run(case["b"]))):
    if x.dim() == y.dim():  # trailing dims that grow with the launch (candidate entries): where they overlap
        region = (slice(None),) + tuple(slice(0, min(m, n)) for m, n in zip(x.shape[1:], y.shape[1:]))
        x, y = x[region], y[region]
    d = (x != y) & ~(x.isnan() & y.isnan()) if x.is_floating_point() else x != y
    if x.shape != y.shape or bool(d.any()):
        diverged = True
        delta = (x.double() - y.double()).abs()[d].max() if x.shape == y.shape else float("nan")
        print(f"output {{i}}: DIFFER on {{int(d.sum())}} of {{d.numel()}} elements, max |d| {{float(delta):.3g}}")
    else:
        print(f"output {{i}}: EQUAL ({{d.numel()}} elements)")
print("the divergence reproduces" if diverged else "EQUAL: the divergence does not reproduce in isolation")
sys.exit(1 if diverged else 0)
'''


def _import_path(obj) -> tuple[str, str | None]:
    """'module:Class' of obj's class, and the sys.path entry its module was imported from."""
    cls = type(obj) if not isinstance(obj, type) else obj
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ValueError(f"{cls.__qualname__} is defined in __main__ or inside a function: define it at the top "
                         "level of an importable module so the repro script can load it")
    module = sys.modules[cls.__module__]
    parts = cls.__module__.split(".")
    if parts[0] == "onepath" or not getattr(module, "__file__", None):
        return f"{cls.__module__}:{cls.__qualname__}", None
    file = Path(module.__file__).resolve()
    root = file.parents[len(parts) - (0 if file.name == "__init__.py" else 1)]
    return f"{cls.__module__}:{cls.__qualname__}", str(root)


def _encode(value, key: str, tensors: dict) -> dict:
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().cpu().contiguous()
        return {"tensor": key}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if dataclasses.is_dataclass(value):
        path, _ = _import_path(value)
        return {"dataclass": path, "fields": {f.name: _encode(getattr(value, f.name), f"{key}.{f.name}", tensors)
                                              for f in dataclasses.fields(value)}}
    try:
        json.dumps(value)
    except TypeError:
        raise ValueError(f"argument {key} is a {type(value).__name__}: the repro stores tensors, dtypes, "
                         "dataclasses and JSON values only") from None
    return {"value": value}


def write_repro(out: Path, first: SiteDiff, positions: list[int], calls: dict) -> Path:
    """calls: side key ("a", "b") -> (Side, the captured Call, the probe's rows in its output)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors, case, sys_path = {}, {"op": first.op, "module": first.module, "layer": first.layer,
                                   "site": first.site, "positions": positions}, []
    for key, (side, call, rows) in calls.items():
        ops_class, root = _import_path(call.ops)
        if root and root not in sys_path:
            sys_path.append(root)
        case[key] = {"label": side.describe(), "ops_class": ops_class, "spec": call.ops.spec.to_dict(), "rows": rows,
                     "args": {name: _encode(v, f"{key}.{name}", tensors) for name, v in call.inputs.items()}}
    if sys_path:  # the backend's module may import from the directory bisect ran in, as the caller's did
        sys_path.append(os.getcwd())
    case["sys_path"] = sys_path
    save_file(tensors, str(out / "inputs.safetensors"))
    (out / "case.json").write_text(json.dumps(case, indent=2))
    layer = "" if first.layer is None else f" (layer {first.layer})"
    title = f"Repro written by `onepath bisect`: {first.name}{layer} differs first, at position {first.first_position}."
    script = out / "repro.py"
    script.write_text(REPRO_SCRIPT.format(title=title))
    return script


# ---- command line: `onepath bisect` (diagnose and check reuse the model and sequence arguments) ----

# 'tiny': the built-in random model that check, bisect and diagnose accept in place of a checkpoint
TINY = dict(vocab_size=53, hidden_size=48, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, model_type="qwen3", max_position_embeddings=256, eos_token_id=2)
MODEL_HELP = ("a Hugging Face checkpoint directory (config.json, safetensors; tokenizer.json for text prompts) "
              "or 'tiny' (a built-in random model for smoke runs)")

PRESETS = {  # --sides: (layout A, layout B, spec B)
    "batch": ("", "batch=4,at=1", "consistent"),
    "prefill-decode": ("", "prefill=1", "consistent"),
    "engine-trainer": ("", "prefill={prompt},head=last,batch=3", "consistent"),
    "spec": ("", "", "baseline"),
}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=MODEL_HELP)
    parser.add_argument("--spec-a", default="consistent", help="'consistent', 'baseline' (with presets: "
                        "'consistent+fp8+fp8_kv') or a spec.json path")
    parser.add_argument("--spec-b", default=None, help="as --spec-a (default: set by --sides)")
    parser.add_argument("--ops-a", default=None, help="backend class 'module:Class' (an Ops subclass; default Ops)")
    parser.add_argument("--ops-b", default=None, help="as --ops-a")
    parser.add_argument("--layout-a", default=None,
                        help="comma-separated prefill=N, chunk=N, head=all|last, batch=N, at=N "
                             "(default: set by --sides)")
    parser.add_argument("--layout-b", default=None, help="as --layout-a")
    parser.add_argument("--tokens", action="append", default=[], help="a sequence as comma-separated token ids")
    parser.add_argument("--prompt", action="append", default=[], help="a sequence as text (needs tokenizer.json)")
    parser.add_argument("--length", type=int, default=24, help="length of random sequences when none is given")
    parser.add_argument("--seed", type=int, default=0, help="random sequences and 'tiny''s weights (default 0)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both sides run (default cpu)")
    parser.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens (default 16)")
    parser.add_argument("--json", default=None, help="also write the report as JSON to this path")


def parse_layout(text: str) -> tuple[Layout, int, int]:
    """'prefill=8,chunk=4,head=last,batch=3,at=1' -> (Layout, others in the batch, probe's place)."""
    fields = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("prefill", "chunk", "head", "batch", "at"):
            raise ValueError(f"layout item {item!r} is not one of prefill=N, chunk=N, head=all|last, batch=N, at=N")
        if key != "head" and not value.isdigit():
            raise ValueError(f"layout item {item!r} needs a whole number")
        fields[key] = value if key == "head" else int(value)
    batch, at = fields.pop("batch", 0), fields.pop("at", 0)
    return Layout(**fields), batch, at


def load_spec(text: str, device: str) -> ExecutionSpec:
    """'consistent' or 'baseline', optionally with low-precision presets ('consistent+fp8+fp8_kv'), or a
    spec.json path."""
    mode, _, quant = text.partition("+")
    if mode in ("consistent", "baseline"):
        return ExecutionSpec.default(mode, device, quant=quant or None)
    return ExecutionSpec.from_json(Path(text).read_text())


def load_class(text: str | None):
    if not text:
        return Ops
    module, sep, name = text.partition(":")
    if not sep:
        raise ValueError(f"backend {text!r} must be 'module:Class', e.g. 'mypkg.ops:MyOps'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"backend {text!r} cannot be loaded ({e}): give 'module:Class' of an importable module, "
                         "run from the directory it imports from") from None


def load_weights(model: str | ModelConfig, seed: int = 0) -> tuple[ModelConfig, dict, object, str]:
    """(config, weights, tokenizer or None, label) of `model`: 'tiny' (the built-in random model, weights from
    `seed`), a ModelConfig (random weights from `seed`) or a Hugging Face checkpoint directory."""
    from onepath.models.checkpoint import TOKENIZER, load_config, load_state_dict, load_tokenizer
    if isinstance(model, ModelConfig) or model == "tiny":
        config, label = (ModelConfig(**TINY), "tiny") if model == "tiny" else (model, model.model_type)
        built = build_decoder(config, Ops(ExecutionSpec("baseline", "cpu")), max_positions=2)
        built.init_weights(seed, std=0.15)  # large enough that distributions are far from uniform
        return config, built.hf_state_dict(), None, label
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r} is neither a checkpoint directory nor 'tiny': give a directory "
                                "holding config.json and safetensors, or 'tiny' for the built-in random model")
    tokenizer = load_tokenizer(path) if (path / TOKENIZER).is_file() else None
    return load_config(path), load_state_dict(path), tokenizer, str(path)


def load_models(args, config: ModelConfig, state: dict, max_positions: int) -> tuple[DenseDecoder, DenseDecoder]:
    """Sides A and B over the same weights, each with its backend and spec."""
    models = []
    for spec, ops in ((args.spec_a, args.ops_a), (args.spec_b, args.ops_b)):
        model = build_decoder(config, load_class(ops)(load_spec(spec, args.device)), max_positions=max_positions)
        model.load_hf_state_dict(state)
        models.append(model)
    return models[0], models[1]


def sequences_from_args(args, config: ModelConfig, tokenizer, count: int = 1) -> list[list[int]]:
    seqs = [[int(t) for t in s.split(",") if t.strip()] for s in args.tokens]
    if args.prompt:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer and model {args.model} has no tokenizer.json: "
                             "give the sequence as token ids, e.g. --tokens 5,17,3")
        seqs += [tokenizer.encode(p).ids for p in args.prompt]
    if not seqs:
        gen = torch.Generator().manual_seed(args.seed)
        seqs = [torch.randint(0, config.vocab_size, (args.length,), generator=gen).tolist() for _ in range(count)]
    if any(not s for s in seqs):
        raise ValueError("a sequence is empty: give at least one token")
    return seqs


def random_others(count: int, probe_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(1, 2 * probe_len + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def main(argv: list[str]) -> int:
    """`onepath bisect`: exit 0 when the sides agree bitwise, 1 on a divergence (report and repro written)."""
    parser = argparse.ArgumentParser(prog="onepath bisect", description="find the first operator whose outputs "
                                     "differ between two sides and write a standalone repro of it; exit 1 when "
                                     "one differs", epilog="example: onepath bisect tiny --sides spec --out repro")
    add_model_args(parser)
    parser.add_argument("--sides", default="batch", choices=sorted(PRESETS),
                        help="batch: alone vs in a batch; prefill-decode; engine-trainer: the trainer's whole-sequence "
                             "forward vs the engine's prefill + decode in a batch; spec: --spec-a vs --spec-b")
    parser.add_argument("--prompt-len", type=int, default=None, help="engine-trainer: tokens prefilled (default half)")
    parser.add_argument("--out", default="bisect_repro", help="directory for the repro (inputs, case.json, repro.py)")
    parser.add_argument("--sites", action="store_true", help="print every site's comparison")
    args = parser.parse_args(argv)
    require_device(args.device)
    layout_a, layout_b, spec_b = PRESETS[args.sides]
    args.spec_b = args.spec_b or spec_b
    config, state, tokenizer, _ = load_weights(args.model, args.seed)
    probe = sequences_from_args(args, config, tokenizer)[0]
    prompt = args.prompt_len or max(1, len(probe) // 2)
    sides = []
    for text, preset in ((args.layout_a, layout_a), (args.layout_b, layout_b)):
        sides.append(parse_layout(preset.format(prompt=prompt) if text is None else text))
    longest = 2 * len(probe) + 1
    model_a, model_b = load_models(args, config, state, max_positions=longest)
    vocab = model_a.config.vocab_size
    labels = ("trainer", "engine") if args.sides == "engine-trainer" else ("", "")
    a, b = [Side(model, layout, random_others(batch, len(probe), vocab, args.seed + i), at, label)
            for i, (model, (layout, batch, at), label) in enumerate(zip((model_a, model_b), sides, labels))]
    report = bisect(a, b, probe, args.out, args.block_size)
    print(report.format(all_sites=args.sites))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    return 1 if report.first else 0
