"""transformers' DeepSeek-V3 (MLA attention, routed + shared experts) for :class:`KimiK2Config`.

The checkpoint keeps one tensor per expert (``mlp.experts.<i>.gate_proj.weight``), as Kimi-K2 ships it and as
vLLM loads it; transformers fuses them on load through the conversion it registers for ``deepseek_v3``, which
is registered here for ``kimi_k2`` too.
"""

from transformers import DeepseekV3ForCausalLM, DeepseekV3Model
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

from .configuration_kimi import KimiK2Config

if get_checkpoint_conversion_mapping(KimiK2Config.model_type) is None:
    register_checkpoint_conversion_mapping(KimiK2Config.model_type, get_checkpoint_conversion_mapping("deepseek_v3"))


class KimiK2Model(DeepseekV3Model):
    config_class = KimiK2Config


class KimiK2ForCausalLM(DeepseekV3ForCausalLM):
    config_class = KimiK2Config
