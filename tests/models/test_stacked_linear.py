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
from onepath.models.kv_cache import KVCache
from tests.tiny import random_prompts, tiny_model


@pytest.fixture
def stacked(monkeypatch):
    monkeypatch.setattr(dense, "stack_projections", lambda ops: True)


def forward(model, tokens: list[int]) -> torch.Tensor:
    batch, num_blocks = ForwardBatch.for_sequences([tokens], 16, device=model.device)
    return model(batch, KVCache.for_model(model, num_blocks=num_blocks, block_size=16))


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
        m.setattr(dense, "stack_projections", lambda ops: False)
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
