"""Model definitions, written once against `ops` and run by both the engine and the trainer."""
from __future__ import annotations

from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.models.fields import HYBRID_MODEL_TYPES
from onepath.models.moe import MoeDecoder
from onepath.ops import Ops


def build_decoder(config: ModelConfig, ops: Ops, max_positions: int | None = None) -> DenseDecoder:
    """The decoder config.json describes: NemotronHDecoder for a hybrid, DeepseekV4Decoder for deepseek_v4,
    MoeDecoder for a mixture-of-experts model_type, else DenseDecoder."""
    if config.model_type in HYBRID_MODEL_TYPES:
        from onepath.models.nemotron_h import NemotronHDecoder
        return NemotronHDecoder(config, ops, max_positions=max_positions)
    if config.model_type == "deepseek_v4":
        from onepath.models.deepseek_v4 import DeepseekV4Decoder
        return DeepseekV4Decoder(config, ops, max_positions=max_positions)
    return (MoeDecoder if config.is_moe else DenseDecoder)(config, ops, max_positions=max_positions)
