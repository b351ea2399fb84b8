"""The float64 reference decoder (the gradient gate's yardstick) windows the same layers as transformers."""
import pytest
import torch

from onepath.consistency.reference import ReferenceDecoder
from onepath.models.config import ModelConfig
from tests.models.test_sliding_window_vs_transformers import (CASES, TOL, config_json, hf_model, reference_logits,
                                                              sequences, without_window)

DENSE = [name for name, (family, _, _) in CASES.items() if family in ("qwen2", "qwen3", "mistral")]


@pytest.mark.parametrize("name", DENSE)
def test_reference_logits_match_transformers_with_a_window(name):
    family, window, how = CASES[name]
    hf = hf_model(family, window)
    config = ModelConfig.from_dict(config_json(hf, how))
    seqs = sequences()
    reference = ReferenceDecoder(config, hf.state_dict())
    with torch.no_grad():
        got = torch.cat([reference.logits(s) for s in seqs]).float()
    torch.testing.assert_close(got, reference_logits(hf, seqs), rtol=TOL, atol=TOL)
    # negative control: the same weights read without the window are further off than the tolerance
    full = ModelConfig.from_dict({**config_json(hf, how), **without_window(family, window)})
    with torch.no_grad():
        unwindowed = torch.cat([ReferenceDecoder(full, hf.state_dict()).logits(s) for s in seqs]).float()
    assert (unwindowed - got).abs().max() > 100 * TOL
