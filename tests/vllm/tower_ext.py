"""A vLLM worker extension (``--worker-extension-cls tests.vllm.tower_ext.TowerHash``)
that lets a test ask a server for its vision tower: vLLM's ``/collective_rpc`` calls a
worker method by name, and this adds one. Test-only; never loaded by sluice itself."""

from __future__ import annotations

import hashlib
from typing import Any


class TowerHash:
    def tower_hash(self) -> dict[str, Any]:
        """sha256 over the served model's vision-tower parameters (names containing
        ``visual``, in name order: each name, then its bytes as float32) and their
        count. Reads ``self.model_runner.model``, the worker's loaded model."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        h = hashlib.sha256()
        n = 0
        for name, p in sorted(model.named_parameters()):
            if "visual" in name:
                n += 1
                h.update(name.encode())
                h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return {"sha256": h.hexdigest(), "tensors": n}
