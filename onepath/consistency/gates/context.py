"""GateContext (the model, spec and backend every gate runs) and the helpers the gates share:
a rollout, the diff evidence of a trainer recompute, the first differing token or op site."""
from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from onepath.consistency.bisect import BisectReport, Side, bisect, compare_site, load_spec, load_weights
from onepath.consistency.recorder import Layout, check_same_sites, trace
from onepath.engine.device import require_device
from onepath.engine.llm_engine import LLMEngine, RequestOutput
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.config import ModelConfig
from onepath.models import build_decoder
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.numerics.diff import is_exact, rollout_diff
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.train.actor import Actor, Responses

TITLES = {"C0": "inventory", "C1": "baseline throughput", "C2": "kernel determinism", "C3": "batch invariance",
          "C4": "phase consistency", "C5": "trainer equals engine", "C6": "layer-by-layer trainer vs engine",
          "C7": "gradients vs float64 reference", "C8": "two RL updates", "C9": "checkpoint and HF export",
          "C10": "consistent / baseline throughput"}
SAMPLING = [{}, {"temperature": 0.7, "top_k": 9}, {"temperature": 1.3, "top_p": 0.8}]


@dataclass(slots=True)
class GateResult:
    name: str
    passed: bool
    evidence: dict
    detail: str
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"gate": self.name, "title": TITLES.get(self.name, ""), **asdict(self)}


@dataclass(slots=True)
class Workload:
    """C1 and C10's fixed workload: `requests` prompts of random lengths, `max_tokens` each (EOS ignored)."""
    requests: int = 8
    prompt_len: tuple[int, int] = (8, 32)
    max_tokens: int = 16
    repeats: int = 2


def engine_has_graphs() -> bool:
    """Whether this LLMEngine can replay decode steps from captured CUDA graphs (its cuda_graphs switch)."""
    return "cuda_graphs" in inspect.signature(LLMEngine).parameters


@dataclass
class GateContext:
    config: ModelConfig
    state: dict                                  # canonical weights (DenseDecoder.hf_state_dict), on the CPU
    spec: ExecutionSpec                          # the spec under test (consistent mode for a real check)
    ops_factory: Callable = Ops                  # spec -> ops for every model under test
    tokenizer: object = None
    label: str = ""
    seed: int = 0
    max_model_len: int = 256
    block_size: int = BLOCK_SIZE
    lr: float = 1e-2
    workload: Workload = field(default_factory=Workload)
    repro_dir: Path | None = None                # where C3..C6 write bisect's repro of a divergence
    min_throughput_ratio: float = 0.0
    throughput: dict = field(default_factory=dict)  # mode -> C1/C10 measurement, measured once

    @classmethod
    def load(cls, model, device: str = "cpu", spec: ExecutionSpec | str | None = None, **options) -> "GateContext":
        """model: 'tiny' (built-in random model), a Hugging Face checkpoint directory, or a ModelConfig
        (random weights)."""
        require_device(device)
        if isinstance(spec, str) or spec is None:
            spec = load_spec(spec or "consistent", device)
        if spec.device != device:
            raise ValueError(f"the spec is for device {spec.device!r}, the check runs on {device!r}: "
                             "give a spec for the same device")
        config, state, tokenizer, label = load_weights(model, options.get("seed", 0))
        built = build_decoder(config, Ops(ExecutionSpec("baseline", "cpu", spec.ops)), max_positions=2)
        built.load_hf_state_dict(state)
        return cls(config, built.hf_state_dict(), spec, tokenizer=tokenizer, label=label, **options)

    @property
    def device(self) -> str:
        return self.spec.device

    def model(self, state: dict | None = None, spec: ExecutionSpec | None = None,
              ops_factory: Callable | None = None) -> DenseDecoder:
        spec = spec or self.spec
        model = build_decoder(self.config, (ops_factory or self.ops_factory)(spec), max_positions=self.max_model_len)
        model.load_hf_state_dict(self.state if state is None else state)
        return model

    def baseline_model(self) -> DenseDecoder:
        return self.model(spec=self.spec.with_mode("baseline"), ops_factory=Ops)

    def engine(self, model: DenseDecoder, prompts, max_tokens: int, prefix_caching: bool | None = None,
               graphs: bool | None = None, **scheduler) -> LLMEngine:
        """graphs: the engine's cuda_graphs (None: its default, on for a CUDA model); an engine without
        CUDA graphs runs eager whatever it says. prefix_caching None: the engine's default (on, off for a
        model with per-sequence state: a hybrid's recurrent state, DeepSeek-V4's rings)."""
        blocks = sum(-(-(len(p) + max_tokens) // self.block_size) for p in prompts) + 4
        options = {"cuda_graphs": graphs} if graphs is not None and engine_has_graphs() else {}
        return LLMEngine(model, num_blocks=blocks, block_size=self.block_size,
                         scheduler=SchedulerConfig(max_model_len=self.max_model_len, **scheduler),
                         enable_prefix_caching=prefix_caching, **options)

    def rng(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 7919 + salt)

    def prompts(self, gen: torch.Generator, count: int, low: int, high: int) -> list[list[int]]:
        high = max(low, min(high, self.max_model_len // 2))
        lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
        return [torch.randint(0, self.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def sampling_params(count: int, max_tokens: int, seed: int, ignore_eos: bool = False) -> list[SamplingParams]:
    """Plain, top-k and top-p sampling in turn, each request its own seed."""
    return [SamplingParams(max_tokens=max_tokens, seed=seed + i, ignore_eos=ignore_eos, **SAMPLING[i % len(SAMPLING)])
            for i in range(count)]


def rollout(engine: LLMEngine, prompts, params, ids) -> tuple[Responses, list[RequestOutput]]:
    outs = engine.generate(prompts, params, request_ids=ids)
    failed = [o for o in outs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first {failed[0].request_id}: {failed[0].error}")
    r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], list(params),
                        [o.logprobs for o in outs])
    return r, outs


def diff_evidence(r: Responses, train_logprobs: torch.Tensor) -> dict:
    """rollout_diff's metrics, and the first (request, token) whose log-probs differ."""
    lp = train_logprobs.detach().float().cpu()
    metrics = rollout_diff(r.rollout_logprobs, lp, r.mask)
    out = {"exact": is_exact(metrics), **{k.split("/")[-1]: v for k, v in metrics.items()}}
    bad = ((lp != r.rollout_logprobs) & r.mask).nonzero()
    if len(bad):
        i, t = bad[0].tolist()
        out["first_differing"] = {"request": i, "token": t, "engine": float(r.rollout_logprobs[i, t]),
                                  "trainer": float(lp[i, t])}
    return out


def recompute(actor: Actor, r: Responses) -> tuple[torch.Tensor | None, dict]:
    """The trainer's log-probs of a rollout and their diff evidence. A sampled token outside the
    trainer's top-k/top-p set means its logits differ from the engine's: a divergence, not a crash."""
    try:
        lp, _ = actor.logprobs(r)
    except ValueError as e:
        if "top-k/top-p" not in str(e):
            raise
        return None, {"exact": False, "tokens_differing_frac": float("nan"), "valid_tokens": int(r.mask.sum()),
                      "error": f"{e} (here: the trainer's logits differ from the engine's)"}
    return lp, diff_evidence(r, lp)


def first_difference(a: RequestOutput, b: RequestOutput) -> dict | None:
    """The first generated token whose id or log-prob bits differ between two outputs of one request."""
    for i, (ta, tb, la, lb) in enumerate(zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs)):
        if ta != tb or la != lb:
            return {"token": i, "tokens": [ta, tb], "logprob_abs_diff": abs(la - lb)}
    if len(a.token_ids) != len(b.token_ids):
        return {"token": min(len(a.token_ids), len(b.token_ids)), "lengths": [len(a.token_ids), len(b.token_ids)]}
    return None


def compare_traces(model_a, model_b, sequences, layout_a: Layout, layout_b: Layout, block_size: int) -> dict:
    """Every op output of every sequence's tokens under two layouts; the first differing site in call order."""
    ta = trace(model_a, sequences, layout_a, block_size)
    tb = trace(model_b, sequences, layout_b, block_size)
    check_same_sites(ta, tb)
    elements, differing, first = 0, 0, None
    for k, site in enumerate(ta.sites):
        for s in range(len(sequences)):
            d = compare_site(k, site, ta.rows[k][s], tb.rows[k][s])
            elements += d.elements
            if d.differing:
                differing += 1
                first = first or {"sequence": s, **site_summary(d)}
    return {"layout": layout_b.describe(), "sites": len(ta.sites), "elements": elements,
            "differing_site_rows": differing, "first": first}


def site_summary(d) -> dict:
    return {"op": d.op, "module": d.module, "layer": d.layer, "site": d.site, "position": d.first_position,
            "differing": d.differing, "elements": d.elements, "max_abs": d.max_abs, "max_ulp": d.max_ulp}


def locate(ctx: GateContext, a: Side, b: Side, probe: list[int], gate: str) -> tuple[BisectReport, dict]:
    """bisect's first diverging operator (and its repro under ctx.repro_dir/<gate>)."""
    out = None if ctx.repro_dir is None else Path(ctx.repro_dir) / gate
    report = bisect(a, b, probe, out, ctx.block_size)
    if report.first is None:
        return report, {"found": False, "a": report.a, "b": report.b,
                        "note": "no op differs when this case is replayed teacher-forced with one prefill length for "
                                "every sequence; the engine's own schedule mixed phases: see C4, or run `onepath "
                                "bisect` with other --layout-a/--layout-b"}
    return report, {"found": True, "a": report.a, "b": report.b, **site_summary(report.first),
                    "repro": report.repro, "reproduces": report.reproduces}
