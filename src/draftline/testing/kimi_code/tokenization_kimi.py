"""A tokenizer shipped as custom code: a byte-level BPE read from ``tokenizer.json``, with Kimi's chat roles
(``<|im_user|>``, ``<|im_assistant|>``, ``<|im_system|>``, ``<|im_middle|>``, ``<|im_end|>``) as special
tokens."""

from transformers import PreTrainedTokenizerFast


class TinyKimiTokenizer(PreTrainedTokenizerFast):
    vocab_files_names = {"tokenizer_file": "tokenizer.json"}
    model_input_names = ["input_ids", "attention_mask"]
    slow_tokenizer_class = None
