"""Starting and stopping local vLLM servers with the flags sluice needs.

One place builds the command line and environment, used by `sluice up`
(``generation.vllm.launch``), the real-vLLM tests and ``benchmarks/engines.py``, so the
flags docs/vllm.md documents are the flags that run.

Flags every server gets and why:
- ``--logprobs-mode processed_logprobs``: logprobs of the distribution tokens are drawn
  from (after temperature / top-k / top-p); the IS correction needs exactly that.
- ``--enable-scale-out``: the token-in/token-out ``/inference/v1/generate`` route, which
  reports per-token weight versions.
- ``--host 127.0.0.1``: servers started here listen on loopback only.
- ``--enforce-eager`` on the CPU only (a spec without ``cuda_device``): on a GPU it would
  turn off CUDA graphs and torch.compile.
- ``--api-server-count N`` where generation.vllm.api_server_count > 1, through vLLM's
  ``serve`` entry (the api_server module runs one front end), started by
  `workers.engines.vllm_serve` because the CPU wheel's own ``vllm`` command cannot start.
- ``--max-logprobs k + 1`` where generation.num_sampler_logprobs = k needs more than
  vLLM's 20 (the engine asks one more than k: vllm_top.py says why).
- LoRA runs: ``--enable-lora --max-lora-rank R --max-loras max_staleness + 2`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (adapters are loaded per version at run time).
- With a key (``ServerSpec.api_key``; `sluice up` always gives one): ``--middleware
  workers.engines.vllm_guard.RequireKey``, which refuses (401) every request but
  ``/health`` without ``Authorization: Bearer <key>``, dev-mode routes included (vLLM's
  own key check covers only ``/v1/*``-like paths). The key itself travels in the
  environment (``VLLM_API_KEY``), never on the command line ``ps`` shows.
Environment: ``VLLM_SERVER_DEV_MODE=1`` (pause / reload / version routes), offline hub,
on CPU ``VLLM_CPU_OMP_THREADS_BIND`` = the core this server owns, on a GPU
``CUDA_VISIBLE_DEVICES`` = the GPU it is given (an entry of the parent's list).

`launch` starts a server with ``start_after`` only once that earlier server answers
/health (servers sharing a GPU: each profiles its memory alone); the rest load in parallel.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.ports import free_port
from pipeline.vllm_auth import API_KEY_ENV
from workers.engines.vllm_guard import MIDDLEWARE as GUARD_MIDDLEWARE

CHECKOUT = Path(__file__).resolve().parents[1]  # holds `workers`, for the guard's import


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's ``--max-lora-rank`` accepts (``MaxLoRARanks``, vllm/config/lora.py)."""


def max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds an adapter of ``rank``
    (a rank of 4 or 12 as such is refused at server start)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank "
                     f"({VLLM_LORA_RANKS[-1]})")


@dataclass
class ServerSpec:
    """What one local server serves and how; defaults are the CPU test settings."""

    python: str
    model: str
    dtype: str = "float32"
    max_model_len: int = 512
    kv_cache_memory_bytes: int = 64 * 2**20
    gpu_memory_utilization: float = 0.0
    lora_rank: int = 0  # 0 = LoRA off
    max_loras: int = 2
    max_logprobs: int = 20  # vLLM's default; score centering asks k + 1 per token
    api_server_count: int = 1  # HTTP front ends before one engine (`vllm serve` entry)
    cpu_core: int | None = 0  # CPU machines: the core the server's OpenMP threads bind to
    cuda_device: str | None = None  # GPU machines: its CUDA_VISIBLE_DEVICES (None: CPU)
    start_after: int | None = None  # `launch`: index of an earlier server to wait for
    extra_args: list[str] = field(default_factory=list)
    # the bearer key every request must carry (env VLLM_API_KEY + `vllm_guard` on every
    # path); None: an open server (module docstring). Never on the command line.
    api_key: str | None = field(default=None, repr=False)

    def command(self, port: int) -> list[str]:
        # the api_server module runs one front end and ignores --api-server-count;
        # vllm_serve is `vllm serve` made to start from the CPU wheel too
        entry = (["workers.engines.vllm_serve"] if self.api_server_count > 1
                 else ["vllm.entrypoints.openai.api_server"])
        cmd = [self.python, "-m", *entry,
               "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
               "--logprobs-mode", "processed_logprobs", "--enable-scale-out"]
        if self.max_logprobs != 20:
            cmd += ["--max-logprobs", str(self.max_logprobs)]
        if self.api_server_count > 1:
            cmd += ["--api-server-count", str(self.api_server_count)]
        if self.cuda_device is None:  # the CPU; a GPU keeps CUDA graphs
            # A prompt prefilled over two steps (chunked prefill) makes vLLM's runner
            # rewind its request's seeded generator (`set_offset`), which a CPU
            # torch.Generator does not support ("CPU Generator does not use offset":
            # every request of that batch fails). vLLM splits a prompt only when a step's
            # new tokens pass max_num_batched_tokens (2048 by default on the CPU: two
            # batches of 32 chat prompts of SmolLM2 did). A budget of 8192 (or
            # max_model_len) makes that rare, not impossible; disabling chunked prefill
            # would end it but vLLM warns that its engine does not support that.
            cmd += ["--enforce-eager",
                    "--max-num-batched-tokens", str(max(self.max_model_len, 8192))]
        if self.gpu_memory_utilization > 0:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        else:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        if self.lora_rank:
            cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(self.lora_rank)),
                    "--max-loras", str(self.max_loras)]
        if self.api_key:
            cmd += ["--middleware", GUARD_MIDDLEWARE]
        return cmd + list(self.extra_args)

    def env(self, cache_dir: Path) -> dict[str, str]:
        """This process's environment, less every Redis credential (a server never logs in
        to Redis: `sluice up`'s environment may hold roles' passwords), plus `own_env`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_REDIS_")}
        return {**env, **self.own_env(cache_dir)}

    def own_env(self, cache_dir: Path | str) -> dict[str, str]:
        """The variables a server needs beyond its parent's environment (the module
        docstring's list); `sluice deploy render` writes exactly these."""
        env = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_CACHE_ROOT": str(cache_dir), "PYTHONUNBUFFERED": "1"}
        if self.cpu_core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu_core)
        if self.cuda_device is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda_device
        if self.lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        if self.api_key or self.api_server_count > 1:
            # `vllm_guard` / `vllm_serve` importable from wherever the server runs
            path = os.environ.get("PYTHONPATH")
            env["PYTHONPATH"] = str(CHECKOUT) + (os.pathsep + path if path else "")
        return env


class ServerError(RuntimeError):
    """A local vLLM server did not start (the message names its log)."""


@dataclass
class LocalServer:
    """A vLLM server process this code started; `stop` ends it (and only it) by PID."""

    spec: ServerSpec
    workdir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    _terminated: bool = field(default=False, repr=False)  # `terminate` sent SIGTERM

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"vllm-{self.port}.log"

    @property
    def terminated(self) -> bool:
        """Whether `terminate` (or `stop`) asked this start of the server to stop."""
        return self._terminated

    def start(self) -> LocalServer:
        """Spawn the server (returns at once; `wait_ready` blocks). Reuses ``port`` when
        set, so a restarted server comes back at the URL generators already know."""
        if not Path(self.spec.python).exists():
            raise ServerError(f"no vLLM environment at {self.spec.python}: run "
                              "`bash deploy/setup.sh --vllm` (or set generation.vllm.python)")
        self.spec.python = str(Path(self.spec.python).absolute())  # it runs in workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self._terminated = False
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.spec.command(self.port), stdout=log, stderr=subprocess.STDOUT,
                env=self.spec.env(self.workdir / "cache"), cwd=self.workdir,
                start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> LocalServer:
        assert self.proc is not None, "start() first"
        deadline = time.time() + timeout_s
        while not self.is_ready(deadline, timeout_s):
            time.sleep(0.5)
        return self

    def is_ready(self, deadline: float, timeout_s: float) -> bool:
        """Whether the started server answers /health now; `ServerError` once it has
        exited, or when it does not and ``deadline`` (``timeout_s`` after its start)
        has passed."""
        assert self.proc is not None, "start() first"
        if self.proc.poll() is not None:
            raise ServerError(f"vLLM server exited with {self.proc.returncode} before it "
                              f"was ready:\n{self.tail()}")
        try:
            urllib.request.urlopen(self.url + "/health", timeout=1).close()
            return True
        except OSError:
            if time.time() > deadline:
                raise ServerError(f"vLLM server at {self.url} not ready within "
                                  f"{timeout_s:.0f} s; log: {self.log_path}") from None
            return False

    def tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server's whole process group (API server, engine core, resource
        tracker: it runs in its own session), like a crash; the port is kept for a
        restart."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def terminate(self) -> None:
        """Ask the server to stop (SIGTERM, once: vLLM shuts its children down) without
        waiting; `stop` then waits for it. `stop_all` asks every server first."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self.proc.terminate()
            self._terminated = True

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM (unless `terminate` sent it), then SIGKILL the group after
        ``grace_s``; also reaps children left behind by an earlier `kill`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def launch(specs: list[ServerSpec], workdir: Path, timeout_s: float = 300.0,
           poll_s: float = 0.5) -> list[LocalServer]:
    """Start the servers and return once every one answers /health.

    A spec with ``start_after`` = j starts only once server j answers (servers sharing
    a GPU: vLLM sizes its KV cache from the memory free while it profiles, so two must
    not load at once); the others start at once and load in parallel. Each must answer
    within ``timeout_s`` of its own start. On any failure (one exits, one is late) the
    servers started so far are stopped, the rest never start, and the error is raised."""
    for i, spec in enumerate(specs):
        if spec.start_after is not None and not 0 <= spec.start_after < i:
            raise ValueError(f"server {i}: start_after must name an earlier server, got "
                             f"{spec.start_after}")
    servers = [LocalServer(s, workdir) for s in specs]
    ready = [False] * len(servers)
    deadlines = [0.0] * len(servers)
    try:
        while not all(ready):
            for i, s in enumerate(servers):
                after = s.spec.start_after
                if s.proc is None and (after is None or ready[after]):
                    s.start()
                    deadlines[i] = time.time() + timeout_s
            for i, s in enumerate(servers):
                if s.proc is not None and not ready[i]:
                    ready[i] = s.is_ready(deadlines[i], timeout_s)
            if not all(ready):
                time.sleep(poll_s)
    except BaseException:
        stop_all(servers, grace_s=10)
        raise
    return servers


def stop_all(servers: list[LocalServer], grace_s: float = 30.0) -> None:
    """Stop servers together: SIGTERM to every one first, then wait for each against one
    deadline ``grace_s`` away, then SIGKILL each one's group (`LocalServer.stop`). WHY: a
    vLLM server takes seconds to shut down (API server, engine core, workers, resource
    tracker); stopped one after another, `sluice up`'s exit waited for their sum."""
    for s in servers:
        s.terminate()
    deadline = time.monotonic() + grace_s
    for s in servers:
        s.stop(grace_s=max(0.0, deadline - time.monotonic()))
