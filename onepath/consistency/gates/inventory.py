"""C0: the inventory of one generate at the ops boundary: operators, dtypes, quantisation, layout,
the ExecutionSpec and its hash, the backend."""
from __future__ import annotations

from collections import Counter

from onepath.consistency.gates.context import GateContext, GateResult, rollout
from onepath.consistency.recorder import Recorder, RecordingOps
from onepath.engine.sampling_params import SamplingParams
from onepath.numerics.spec import FAMILY_OPS, FP32_OPS, OPS, ExecutionSpec

# Ops methods and the ExecutionSpec entry that states their numerics
OP_SPEC = {"token_logprobs": "logprobs", "probs": "logprobs", "sampling_mask": "topk", "sample": "sampling",
           "sample_with_logprobs": "sampling", "add_rmsnorm": "rmsnorm", "qk_norm_rope": "rope", "router": "lm_head",
           "expert_down": "linear", "grouped_linear": "linear", "grouped_expert_down": "linear",
           "experts": "linear",  # the recorder's one site for a MoE layer's experts: their GEMMs and silu_mul
           "gated_rmsnorm": "rmsnorm",
           "rope_interleaved": "rope", "cache_write": "attention", "cache_read": "attention",
           "cache_read_stored": "indexer",
           "cache_stage": "attention", "cache_copy": "attention", "group_linear": "linear",
           "sparse_attention": "attention", "attention_weights": "attention", "index_topk": "topk",
           "compress": "compressor",  # an op, and the recorder's one site for a DeepSeek-V4 compressor's windows
           "index_scores": "indexer", "hc_pre": "mhc", "hc_post": "mhc", "hc_head": "mhc"}
# Ops members that answer a question about the backend and compute nothing
QUERIES = ("can_stack", "grouped_experts", "grouped_kernel", "grouped_on_device", "index_quant", "kv_quant",
           "kv_tile")


def gate_c0(ctx: GateContext) -> GateResult:
    model = ctx.model()
    prompt = ctx.prompts(ctx.rng(0), 1, 8, 8)
    engine = ctx.engine(model, prompt, 3, graphs=False)  # a replayed CUDA graph makes no ops calls to record
    recorder, sampler_ops = Recorder(), engine.runner.ops
    with recorder.installed(model):
        engine.runner.ops = RecordingOps(sampler_ops, recorder, "sampler")
        try:
            rollout(engine, prompt, [SamplingParams(max_tokens=3, ignore_eos=True)], [0])
        finally:
            engine.runner.ops = sampler_ops
    calls = Counter(c.op for c in recorder.calls)
    out_dtypes = {c.op: str(c.outputs[0].dtype).removeprefix("torch.") for c in recorder.calls if c.outputs}
    no_spec = sorted(op for op in calls if OP_SPEC.get(op, op) not in OPS + FAMILY_OPS + FP32_OPS)
    wrong_dtype = sorted(n for n, p in model.named_parameters() if p.dtype != ctx.spec.dtype)
    round_trip = ExecutionSpec.from_json(ctx.spec.to_json()).hash() == ctx.spec.hash()
    c = ctx.config
    evidence = {
        "model": {"source": ctx.label, "model_type": c.model_type, "layers": c.num_hidden_layers,
                  "hidden": c.hidden_size, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                  "head_dim": c.head_dim, "vocab": c.vocab_size, "tied_embeddings": c.tie_word_embeddings,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "backend": f"{type(model.ops).__module__}:{type(model.ops).__qualname__}",
        "ops": dict(calls), "workload": f"one request, {len(prompt[0])} prompt tokens, 3 generated, "
                                        f"{engine.stats.steps} passes",
        "parameter_dtypes": dict(Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters())),
        "output_dtypes": out_dtypes,
        "op_dtypes": {op: f"{s.dtype}/{s.accum_dtype} accum" for op, s in ctx.spec.ops.items()},
        "quantisation": "none: the ExecutionSpec defines no quantiser",
        "parallel": {"tensor_parallel": 1, "data_parallel": 1, "device": ctx.device},
        "spec_hash": ctx.spec.hash(), "spec": ctx.spec.to_dict(),
    }
    problems = [f"ops without an ExecutionSpec entry: {no_spec}"] * bool(no_spec)
    problems += [f"parameters not in the spec's {ctx.spec.dtype}: {wrong_dtype[:3]}"] * bool(wrong_dtype)
    problems += ["the spec does not survive a JSON round trip with its hash"] * (not round_trip)
    detail = (f"{len(calls)} ops, {sum(calls.values())} calls; {ctx.spec.mode} {ctx.device} spec {ctx.spec.hash()}; "
              "no quantisation; single device") if not problems else "; ".join(problems)
    return GateResult("C0", not problems, evidence, detail)
