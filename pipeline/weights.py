"""Older import path of the weight store's names; the transports live in
`pipeline.transports` (file, lora, nccl behind one contract).

Kept for the trainer's checkpoints, which name their files like published versions:
``model.safetensors`` (full weights, one file) and peft's ``adapter_model.safetensors``.
"""

from pipeline.transports import ADAPTER_FILE, MANIFEST, WeightError
from pipeline.transports.file import SINGLE_FILE as WEIGHTS_FILE

__all__ = ["ADAPTER_FILE", "MANIFEST", "WEIGHTS_FILE", "WeightError"]
