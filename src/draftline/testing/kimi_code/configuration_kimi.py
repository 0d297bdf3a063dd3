"""A DeepSeek-V3 config under Kimi-K2's model_type (custom code: transformers does not know ``kimi_k2``)."""

from transformers import DeepseekV3Config


class KimiK2Config(DeepseekV3Config):
    model_type = "kimi_k2"
