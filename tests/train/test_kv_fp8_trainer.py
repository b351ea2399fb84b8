"""With an FP8 KV cache (quant="fp8_kv") the trainer's private cache is written and read through the
engine's quantise/dequantise path: its log-probs equal the engine's bit for bit, before and after an
update + in-place sync, and the straight-through backward trains. Negative control, the "naive"
setting: the engine quantises its KV cache, the trainer does not; that shows a diff."""
import torch

from onepath.numerics.diff import is_exact
from onepath.engine.sampling_params import SamplingParams
from tests.engine.test_kv_fp8 import fp8_model
from tests.train.test_trainer_consistency import engine_vs_trainer

PARAMS = [SamplingParams(max_tokens=16, seed=1), SamplingParams(max_tokens=16, temperature=0.8, top_k=7, seed=2),
          SamplingParams(max_tokens=16, temperature=1.2, top_p=0.85, seed=3)]


def rollout_and_recompute(trainer_quant: str | None, update: bool, sampling=PARAMS):
    policy = fp8_model(trainer_quant, seed=4)

    def trained(before):
        assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())

    return engine_vs_trainer(fp8_model(seed=4), policy, update, sampling, prompts=8, num_blocks=128,
                             after_update=trained)


def test_trainer_equals_engine_before_and_after_an_update():
    before, after = rollout_and_recompute("fp8_kv", update=True)
    assert before["rollout_corr/valid_tokens"] > 50
    assert is_exact(before) and is_exact(after), (before, after)


def test_negative_control_naive_trainer_without_kv_quantisation_differs():
    # no top-k / top-p: the naive trainer's own top-k set could leave out a sampled token
    (metrics,) = rollout_and_recompute(None, update=False, sampling=PARAMS[:1])
    assert metrics["rollout_corr/tokens_differing_frac"] > 0
