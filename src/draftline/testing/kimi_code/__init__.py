"""The custom code a tiny ``kimi_k2`` verifier directory ships, as Kimi-K2-Instruct ships its own: a config
class, a model class and a tokenizer class named in ``auto_map``. draftline's own small classes (not
Moonshot's code): the config and model are transformers' DeepSeek-V3 under Kimi's ``model_type``, the tokenizer
loads a byte-level BPE ``tokenizer.json``. :mod:`draftline.testing.kimi` copies these files into the directory;
transformers runs them only with ``trust_remote_code``."""
