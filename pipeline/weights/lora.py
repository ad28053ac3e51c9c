"""The `lora` transport: only the trained peft adapter, per version, for LoRA runs; and
`MergedLoraTransport`: the adapter merged into the base, published as full weights.

A version directory holds ``adapter_model.safetensors`` (peft's saved keys,
``base_model.model.….lora_A.weight``) and ``adapter_config.json`` (the adapter's peft
config, in inference mode, ``base_model_name_or_path`` set to the base model when
given): exactly what ``PeftModel.from_pretrained(base, dir)`` and vLLM's
``POST /v1/load_lora_adapter`` read. Both files are built in memory, hashed and written
by `WeightStore.commit` (the config serialised as peft's ``save_pretrained`` does).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save

from pipeline.bus.schema import WeightsPublished
from pipeline.weights.base import WeightSource, WeightTransport
from pipeline.weights.file import FileTransport
from pipeline.weights.shards import HEADER_PT
from pipeline.weights.store import ADAPTER_CONFIG, ADAPTER_FILE, WeightError, WeightStore

if TYPE_CHECKING:
    from peft import PeftModel


def adapter_files(model: PeftModel, *, version: int,
                  base_model: str | Path | None = None) -> Iterator[tuple[str, bytes]]:
    """(file name, bytes) of the active adapter's weights and its peft config."""
    from pipeline.model import adapter_state  # lazy: keeps peft out of full-weight roles

    tensors = adapter_state(model)
    pcfg = copy.deepcopy(model.peft_config[model.active_adapter])
    pcfg.inference_mode = True
    if base_model is not None:
        pcfg.base_model_name_or_path = str(Path(base_model).resolve())
    yield ADAPTER_FILE, save(tensors, metadata=HEADER_PT)
    config = {k: list(v) if isinstance(v, set) else v for k, v in pcfg.to_dict().items()}
    yield ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True).encode()


def read_adapter(directory: Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a lora version directory (peft's saved keys)."""
    path = directory / ADAPTER_FILE
    if not path.is_file():
        raise WeightError(f"{directory} has no {ADAPTER_FILE}")
    return load_file(str(path), device="cpu")


class LoraTransport(WeightTransport):
    """The adapter of a peft model through the shared store."""

    name = "lora"
    format = "lora"

    def __init__(self, root: str | Path | WeightStore, *, keep: int = 4,
                 base_model: str | Path | None = None) -> None:
        """``root``: the store's directory, or a store (its own ``keep`` then)."""
        super().__init__(root if isinstance(root, WeightStore) else WeightStore(root, keep=keep))
        self.base_model = base_model

    def write(self, source: WeightSource, *, version: int, step: int) -> WeightsPublished:
        from pipeline.model import is_peft

        if not isinstance(source, torch.nn.Module) or not is_peft(source):
            raise TypeError(f"the lora transport publishes a peft model's adapter, "
                            f"got {type(source).__name__}")
        t0 = time.perf_counter()
        msg = self.store.commit(adapter_files(source, version=version,  # type: ignore[arg-type]
                                              base_model=self.base_model),
                                fmt=self.format, version=version, step=step)
        self.stats = {"publish_s": time.perf_counter() - t0, "publish_bytes": msg.nbytes}
        return msg

    def load(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        """An announced adapter's tensors, after `WeightStore.verify` (blocking)."""
        return read_adapter(self.store.verify(msg))


class MergedLoraTransport(FileTransport):
    """A LoRA run's versions as full weights (``model.lora.sync = "merged"``): the
    trainer's peft model is merged on the fly (`pipeline.model.merged_state`, the base
    untouched) and written as the `file` transport writes any full version, so every
    reader (a vLLM server without ``--enable-lora``, the in-process engine's plain model,
    `sluice export`) sees an ordinary ``safetensors`` version. The merge lives in
    `serving_source` alone, so the `nccl` transport, which pushes its fallback's
    `serving_state`, sends servers exactly the tensors this transport writes."""

    def serving_source(self, source: WeightSource) -> WeightSource:
        """The merged weights (base + peft delta), keyed as the plain model; cast to the
        serving dtype tensor by tensor as `FileTransport` streams them. Raises
        `TypeError` for anything but a peft model."""
        from pipeline.model import is_peft, merged_state

        if not isinstance(source, torch.nn.Module) or not is_peft(source):
            raise TypeError(f"the merged LoRA transport publishes a peft model merged, "
                            f"got {type(source).__name__}")
        return merged_state(source)
