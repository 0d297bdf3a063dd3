"""vLLM 0.32's own aux-layer id readers, run in its venv on drafter directories loaded as vLLM loads a draft model
(``get_config``, then ``EAGLEConfig`` around a flat config as ``SpeculativeConfig`` does): Model Runner V2's
``get_eagle3_aux_layers_from_config`` (the GPU default; on the CPU vLLM refuses V2: "Model Runner V2 requires
Triton") and the V1 runner's ``GPUModelRunner._get_eagle3_aux_layers_from_config`` (a method that reads only
``self.speculative_config``, called on a stand-in). Both import on a CPU build."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    out = {}
    for name, d in json.loads(sys.argv[1]).items():
        hf = get_config(d, trust_remote_code=False)
        if not isinstance(hf, (EAGLEConfig, SpeculatorsConfig)):
            hf = EAGLEConfig(hf, method="eagle3", model_type="eagle")
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
        v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
        out[name] = {"v1": v1, "v2": get_eagle3_aux_layers_from_config(spec),
                     "num_aux_hidden_states": getattr(hf, "num_aux_hidden_states", None)}
    print(json.dumps(out))
""")


def vllm_reads(vllm_python: Path | str, dirs: dict[str, str | Path]) -> dict[str, dict]:
    """``{name: {"v1": ids, "v2": ids, "num_aux_hidden_states": n}}`` as vLLM's own readers read each directory
    (``None``: that runner reads none and captures the verifier's default layers)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([str(vllm_python), "-c", SCRIPT, json.dumps({k: str(v) for k, v in dirs.items()})],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
