"""`sluice init-model OUT --from-gguf FILE` on the real SmolLM2-135M-Instruct GGUF file:
the folder it writes is a plain Hugging Face model whose logits equal the GGUF model's,
whose tokenizer keeps the chat template and EOS token, and which answers as the original
does. Bad input is refused at the command line, naming what is wrong, before any weight
is read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.smollm2 import GGUF_NAME, ROOT, smollm2_gguf

QUESTION = "What is 7 + 5? Answer with just the number."


def chat_ids(tokenizer: object, text: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


def test_the_imported_folder_is_the_gguf_model(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert not list(smollm2_dir.parent.glob(".tmp-*")), "a temporary folder was left"
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == (
        "llama", 30, 49152)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert json.loads((smollm2_dir / "generation_config.json").read_text())[
        "eos_token_id"] == tokenizer.eos_token_id
    ids = chat_ids(tokenizer, QUESTION)
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    gguf = AutoModelForCausalLM.from_pretrained(smollm2_dir.parent, gguf_file=GGUF_NAME,
                                                dtype=torch.float32)
    with torch.no_grad():
        # The same weights (the state dicts are equal), but not bit-equal logits on every
        # run: a CPU matmul kernel may sum in another order for another allocation (seen
        # once in a full run on a 2-core Xeon, equal when rerun). A wrong conversion (a
        # permuted q/k, a lost tie) moves logits by whole units; rounding by ~1e-5.
        for name, w in gguf.state_dict().items():
            assert torch.equal(model.state_dict()[name], w), name
        torch.testing.assert_close(model(ids).logits, gguf(ids).logits, rtol=0, atol=1e-3)
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "12" in tokenizer.decode(out[0, ids.shape[1]:])


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", "init-model", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bad_input_is_refused_before_any_weight_is_read(tmp_path: Path) -> None:
    gguf = smollm2_gguf(tmp_path)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    cases = {
        (str(tmp_path / "out"), "--from-gguf", str(tmp_path / "nope.gguf")): "no such file",
        (str(tmp_path / "out"), "--from-gguf", str(full / "x")): "is not a .gguf file",
        (str(full), "--from-gguf", str(gguf)): "exists and is not an empty folder",
    }
    for args, message in cases.items():
        res = sluice(*args)
        assert res.returncode == 2 and message in res.stderr, (args, res.stderr)
    bad_dtype = sluice(str(tmp_path / "out"), "--from-gguf", str(gguf), "--dtype", "int8")
    assert bad_dtype.returncode == 2 and "--dtype" in bad_dtype.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_the_weights_are_written_in_the_chosen_dtype(tmp_path: Path, dtype: str) -> None:
    from safetensors import safe_open

    res = sluice(str(tmp_path / "model"), "--from-gguf", str(smollm2_gguf(tmp_path)),
                 "--dtype", dtype)
    assert res.returncode == 0, res.stderr
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert json.loads((tmp_path / "model" / "config.json").read_text())["dtype"] == dtype
