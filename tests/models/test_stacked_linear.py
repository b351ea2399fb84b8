"""StackedLinear: q/k/v and gate/up as one GEMM each (on CUDA; forced on here, on the CPU).

The engine's model reads one stacked weight whose slices are the layers' parameters; the trainer's
stacks the parameters at each forward. Both must give the same bits, gradients must reach the layers'
parameters, and an in-place weight update must reach the stacked storage (captured graphs read it)."""
import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models import dense
from onepath.models.batch import ForwardBatch
from tests.tiny import random_prompts, tiny_model


@pytest.fixture
def stacked(monkeypatch):
    monkeypatch.setattr(dense, "stack_projections", lambda ops, sizes: True)


def forward(model, tokens: list[int]) -> torch.Tensor:
    batch, num_blocks = ForwardBatch.for_sequences([tokens], 16, device=model.device)
    return model(batch, model.make_cache(num_blocks=num_blocks, block_size=16))


def test_stacked_sites_keep_the_layers_parameters(stacked):
    model = tiny_model("consistent", seed=3)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, dense.StackedLinear) and isinstance(mlp.gate_up_proj, dense.StackedLinear)
    names = set(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up" in n for n in names)
    plain = tiny_model("consistent", seed=3)
    assert set(plain.state_dict()) == names


def test_shared_storage_equals_stacking_per_forward_and_takes_updates(stacked):
    gen = torch.Generator().manual_seed(0)
    tokens = random_prompts(gen, 1, low=37, high=37)[0]
    trainer = tiny_model("consistent", seed=5)
    engine_model = tiny_model("consistent", seed=5)
    engine_model.share_projection_storage()
    attn = engine_model.model.layers[1].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_proj.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        assert torch.equal(forward(engine_model, tokens), forward(trainer, tokens))

    # gradients reach the layers' parameters through the per-forward stack, as without stacking
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dense, "stack_projections", lambda ops, sizes: False)
        unstacked = tiny_model("consistent", seed=5)
    forward(trainer, tokens).square().sum().backward()
    forward(unstacked, tokens).square().sum().backward()
    for (name, p), q in zip(trainer.named_parameters(), unstacked.parameters()):
        if name.startswith("lm_head"):
            continue  # forward() stops at the final norm
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)

    # an update through the engine lands in the stacked storage the forward reads
    new = tiny_model("consistent", seed=9)
    engine = LLMEngine(engine_model, num_blocks=16, block_size=16, scheduler=SchedulerConfig(max_model_len=64))
    before = forward(engine_model, tokens)
    engine.update_weights(new.named_parameters())
    with torch.no_grad():
        after, expected = forward(engine_model, tokens), forward(new, tokens)
    assert torch.equal(after, expected) and not torch.equal(after, before)

    # negative control: rebinding a layer's weight (not writing into it) leaves the stack stale
    with torch.no_grad():
        attn.q_proj.weight.data = attn.q_proj.weight.detach() * 2
        assert torch.equal(forward(engine_model, tokens), expected)


def test_engine_outputs_are_the_trainers_with_stacked_projections(stacked):
    gen = torch.Generator().manual_seed(1)
    prompts = random_prompts(gen, 6, low=3, high=30)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    engine = LLMEngine(tiny_model("consistent", seed=2), num_blocks=40, block_size=16,
                       scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=64))
    outputs = engine.generate(prompts, params)
    trainer = tiny_model("consistent", seed=2)
    for out in outputs:
        tokens = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            logits = trainer.compute_logits(forward(trainer, tokens))
        n = len(out.token_ids)
        recomputed, _ = trainer.ops.token_logprobs(logits[-n - 1:-1], torch.tensor(out.token_ids), torch.ones(n))
        assert torch.equal(recomputed, torch.tensor(out.logprobs))


def test_which_sites_stack():
    """On CUDA: unquantised linears, and block-FP8 weights whose 128-row blocks each lie within one layer;
    not NVFP4 (its global scale is the whole tensor's), nothing on the CPU."""
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import Ops

    ops = lambda device, quant=None: Ops(ExecutionSpec.default("consistent", device, quant=quant))
    assert dense.stack_projections(ops("cuda"), [72, 40, 40])
    assert dense.stack_projections(ops("cuda", "fp8"), [2048, 1024, 1024])
    assert not dense.stack_projections(ops("cuda", "fp8"), [2048, 64, 64])
    assert not dense.stack_projections(ops("cuda", "nvfp4_w4a16"), [2048, 1024, 1024])
    assert not dense.stack_projections(ops("cpu"), [2048, 1024, 1024])


def _fp8_sites(monkeypatch):
    """The CUDA predicate for FP8 applied to this CPU spec: stack where the blocks allow."""
    from dataclasses import replace

    from onepath.ops import Ops

    predicate = dense.stack_projections
    monkeypatch.setattr(dense, "stack_projections",
                        lambda ops, sizes: predicate(Ops(replace(ops.spec, device="cuda")), sizes))


# q, k, v, gate, up each 128 rows: every 128x128 weight block within one layer
FP8_SHAPE = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=8, head_dim=16, intermediate_size=128)


def test_fp8_stacked_weights_give_the_layers_bits_and_take_updates(monkeypatch):
    """Block-FP8 W8A8 stacked: the engine's shared stacked weight gives the unstacked layers' bits; after an
    in-place update the cached FP8 copy of the stacked weight (the storage a captured graph reads) is
    rewritten with the new weights' codes. Negative control: blocks that span two layers (64-row k/v)
    forced into one stack give other bits."""
    from onepath.numerics.quant import quantize

    gen = torch.Generator().manual_seed(2)
    tokens = random_prompts(gen, 1, low=41, high=41)[0]
    plain = tiny_model("consistent", seed=4, quant="fp8", **FP8_SHAPE)
    with pytest.MonkeyPatch.context() as m:
        _fp8_sites(m)
        engine_model = tiny_model("consistent", seed=4, quant="fp8", **FP8_SHAPE)
    attn = engine_model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, dense.StackedLinear) and not hasattr(plain.model.layers[0].self_attn, "qkv_proj")
    engine = LLMEngine(engine_model, num_blocks=16, block_size=16, scheduler=SchedulerConfig(max_model_len=64))
    with torch.no_grad():
        assert torch.equal(forward(engine_model, tokens), forward(plain, tokens))

    cached = attn.qkv_proj.weight._quantized[1]
    new = tiny_model("consistent", seed=8, quant="fp8", **FP8_SHAPE)
    engine.update_weights(new.named_parameters())
    want = quantize(attn.qkv_proj.weight, engine_model.ops.spec.op("linear").weight)
    assert torch.equal(cached.codes.view(torch.uint8), want.codes.view(torch.uint8))
    assert torch.equal(cached.scales, want.scales)
    with torch.no_grad():
        assert torch.equal(forward(engine_model, tokens), forward(new, tokens))

    spanning = dict(FP8_SHAPE, num_key_value_heads=4)
    monkeypatch.setattr(dense, "stack_projections", lambda ops, sizes: True)
    forced = tiny_model("consistent", seed=4, quant="fp8", **spanning)
    monkeypatch.setattr(dense, "stack_projections", lambda ops, sizes: False)
    unstacked = tiny_model("consistent", seed=4, quant="fp8", **spanning)
    with torch.no_grad():
        assert not torch.equal(forward(forced, tokens), forward(unstacked, tokens))
