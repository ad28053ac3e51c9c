"""Builders and reward functions shared by tests (importable by spawned processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.bus.schema import Rollout, RolloutGroup

ROOT = Path(__file__).resolve().parents[1]


def make_group(gid: str = "0:1", texts: tuple[str, ...] = ("123", "12", "1", "9"),
               answer: str = "123", version: int = 0) -> RolloutGroup:
    """A rollout group for the copy task whose completions are ``texts`` (all stopped)."""
    rollouts = []
    for t in texts:
        ids = np.array([4 + int(c) for c in t] + [1], dtype=np.int32)
        rollouts.append(Rollout(completion_ids=ids,
                                logprobs=np.full(len(ids), -0.5, dtype=np.float32),
                                versions=np.full(len(ids), version, dtype=np.int32),
                                mask=np.ones(len(ids), dtype=np.uint8),
                                finish_reason="stop", text=t))
    epoch, idx = (int(x) for x in gid.split(":"))
    return RolloutGroup(group_id=gid, prompt_index=idx, epoch=epoch,
                        prompt={"text": answer + "=", "answer": answer},
                        prompt_ids=np.array([4 + int(c) for c in answer] + [66], dtype=np.int32),
                        generator="test", t_admit=time.time(), t_done=time.time(),
                        rollouts=rollouts)


def hang_reward(*, completions: list[Any], completion_ids: list[list[int]],
                **columns: Any) -> list[float | None]:
    """Never returns in time on sampled completions, so the scorer holding it can be
    killed between read and ack; answers at once the start-up probe, whose dummy
    completions have no token ids (the scorer would otherwise stop at start)."""
    if any(completion_ids):
        time.sleep(3600)
    return [0.0] * len(completions)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_header(run_name: str, output_dir: Path, redis_url: str, **bus: Any) -> str:
    """The ``[run]`` and ``[bus]`` tables of a test config (values of ``bus`` as TOML)."""
    extra = "".join(f"{k} = {v}\n" for k, v in bus.items())
    return (f'[run]\nname = "{run_name}"\noutput_dir = "{output_dir}"\n'
            f'[bus]\nredis_url = "{redis_url}"\n{extra}')


def spawn_role(role: str, config: Path, *overrides: str, name: str | None = None,
               log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``sluice ROLE`` as a real OS process (cwd = repo root, so tests import).

    With ``--allow-config-change``: these tests start the roles of one run directory with
    deliberately different configs (a hanging reward, longer completions), which a real
    run would refuse (`pipeline.rundir`); the pin of the model is unaffected."""
    args = [sys.executable, "-m", "sluice.cli", role, str(config), "--allow-config-change"]
    for o in overrides:
        args += ["--set", o]
    if name:
        args += ["--name", name]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if log is None:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(pred: Any, timeout_s: float, what: str | Callable[[], str],
             interval_s: float = 0.1) -> Any:
    """Poll ``pred()`` until it is truthy (returned) or ``timeout_s`` passes (an
    AssertionError naming ``what``). Tests wait for the condition they assert rather than
    for a time that happens to be long enough on one machine. ``what`` may be a callable:
    it is called at the timeout, so the message shows the state (counters, logs) then,
    not when the wait began."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            break
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for "
                         f"{what() if callable(what) else what}")


async def wait_for_async(pred: Callable[[], Awaitable[Any]], timeout_s: float,
                         what: str | Callable[[], str], interval_s: float = 0.05) -> Any:
    """`wait_for` inside an event loop (the role under test runs in the same loop):
    awaits ``pred()`` until truthy, sleeping with `asyncio.sleep` in between."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while True:
        v = await pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for "
                         f"{what() if callable(what) else what}")


def check_pause_keep_swap(prompts: list[list[int]], groups: list[list[Any]], config: Any,
                          old_logits: Any, new_logits: Any) -> None:
    """A weight swap landed mid-batch with pause-keep semantics: versions go 0…0 1…1,
    every completion that switched did so at the same step s ≥ 1 (one batch), and its
    logprobs equal a cache filled by ``old_logits(ids, cache)`` over prompt + tokens[:s-1],
    continued by ``new_logits(ids, cache)`` over the rest (tolerance 1e-4)."""
    import torch
    from transformers import DynamicCache

    swap_steps, mixed = set(), 0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            v = c.versions
            assert (np.diff(v) >= 0).all() and set(v.tolist()) <= {0, 1}
            if not (v == 1).any():
                continue
            mixed += 1
            s = int(np.argmax(v == 1))
            assert s >= 1  # swap lands between steps, never before the first token
            swap_steps.add(s)
            toks = c.token_ids.tolist()
            with torch.no_grad():
                cache = DynamicCache(config=config)
                old = old_logits(torch.tensor([prompt + toks[: s - 1]]), cache)
                new = new_logits(torch.tensor([toks[s - 1: -1]]), cache)
            lp = torch.log_softmax(torch.cat([old[0, len(prompt) - 1:], new[0]]).float(), -1)
            want = lp.gather(-1, torch.tensor(toks)[:, None]).squeeze(-1)
            np.testing.assert_allclose(c.logprobs, want.numpy(), atol=1e-4)
    assert mixed >= 1
    assert len(swap_steps) == 1  # one batch: every live row switches at the same step


def up_args(config: Path, out: Path, model: Path, name: str, *sets: str) -> list[str]:
    """``sluice up CONFIG`` into ``out`` with a model built at ``model`` (the e2e tests'
    common overrides: 80 steps at lr 1e-3, no early stop, held-out eval every 5 s)."""
    args = [sys.executable, "-m", "sluice.cli", "up", str(config),
            "--set", f"run.output_dir={out}", "--set", f"model.path={model}",
            "--set", f"run.name={name}", "--set", "trainer.max_steps=80",
            "--set", "trainer.lr=1e-3", "--set", "up.stop_at="]
    for s in sets:
        args += ["--set", s]
    return [*args, "--eval-every", "5"]


def run_up(args: list[str], out: Path, cwd: Path, timeout_s: float,
           env: dict[str, str] | None = None, drop_env: tuple[str, ...] = ()
           ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run ``sluice up`` (``args`` from `up_args`) to its end as a real process; assert it
    exited 0 (the failure message carries its output and every role's log tail) and
    return (the process, its ``summary.json``)."""
    import json

    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    for key in drop_env:
        full.pop(key, None)
    proc = subprocess.run(args, cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}\n{role_logs(out)}"
    return proc, json.loads((out / "summary.json").read_text())


def role_logs(out: Path) -> str:
    """The tail of every role's log in a run directory (for assertion messages)."""
    from pipeline.runtime import STACK_DUMP_MARK, log_tail

    def tail(text: str) -> str:  # 1,500 characters, or a whole stack dump at the end
        dumped = log_tail(text, 1)
        return dumped if STACK_DUMP_MARK in dumped else text[-1500:]

    return "\n".join(f"--- {p.name}\n{tail(p.read_text())}"
                     for p in sorted((out / "logs").glob("*.log")))


def scrape_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus /metrics page: (name, sorted labels) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric_value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
                 **labels: str) -> float:
    """The one sample ``name`` (of `scrape_metrics`) whose labels include ``labels``."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def loopback_listener() -> Any:
    """A TCP socket listening on a free 127.0.0.1 port (a port in use, until closed)."""
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s



class RedisProcess:
    """A redis-server a test starts with its own arguments (ACL file, TLS ports): always
    on 127.0.0.1, no persistence, ended by PID in `stop` (also on ``with`` exit).

    Ready means the server answered a PING on ``url`` (with ``client_options``), or
    answered it by asking for a login (``default`` user off): either way it is serving.
    """

    def __init__(self, data_dir: Path, args: list[str], url: str, **client_options: Any):
        self.data_dir, self.args, self.url = data_dir, args, url
        self.client_options = client_options
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        import redis

        from sluice.embedded import find_redis_server

        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("already started (a second server would leak the first)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.data_dir / "redis.log"
        self.proc = subprocess.Popen(
            [find_redis_server(), "--bind", "127.0.0.1", "--protected-mode", "yes",
             "--dir", str(self.data_dir), "--save", "", "--appendonly", "no",
             "--logfile", str(log), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start:\n"
                                   f"{log.read_text()[-2000:] if log.exists() else ''}")
            client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5,
                                          **self.client_options)
            try:
                client.ping()
                return self
            except redis.AuthenticationError:
                return self
            except (redis.ConnectionError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer on {self.url}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def openssl(*args: str, cwd: Path) -> None:
    """Run the openssl command line (tests check it is on PATH first)."""
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> None:
    """A self-signed CA; a server certificate for 127.0.0.1/localhost and a client
    certificate, both signed by it (EC P-256: fast to make)."""
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=sluice test CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                 "extendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\n"
                                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                                       "authorityKeyIdentifier=keyid,issuer\n" + ext)
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=sluice test {name}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
                "-extfile", f"{name}.ext", cwd=d)


def tls_args(certs: Path, port: int, auth_clients: str) -> list[str]:
    """redis-server arguments for a TLS port with `make_certs`' server certificate."""
    return ["--tls-port", str(port), "--tls-cert-file", str(certs / "server.crt"),
            "--tls-key-file", str(certs / "server.key"),
            "--tls-ca-cert-file", str(certs / "ca.crt"), "--tls-auth-clients", auth_clients]


def key_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a nested dict/list message (for structural fuzzing)."""
    out: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out.extend(key_paths(v, (*prefix, k)))
    return out


def value_at(d: Any, path: tuple[Any, ...]) -> Any:
    """The value at a key path of `key_paths`."""
    for p in path:
        d = d[p]
    return d


# ------------------------------------------------------------ models beyond the tiny one

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_bpe_model(out: Path, *, seed: int = 0) -> Path:
    """A tiny Qwen2 with tied embeddings and a real byte-level BPE tokenizer trained here
    (`tokenizers`, a few hundred strings of the copy task) with a ChatML chat template:
    the shape of a real instruct model (Qwen2.5-0.5B-Instruct) at a test's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    rng = np.random.default_rng(seed)
    texts = [f"Copy {n}= {n}" for n in rng.integers(0, 10**6, 400)]
    texts += [f"Say it back: {w} and {w}" for w in ("apple", "banana", "cherry", "digits")]
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, dtype="float32")
    return _save_model(Qwen2ForCausalLM, cfg, tok, out, seed)


def build_slow_tokenizer_model(out: Path, *, seed: int = 0) -> Path:
    """A tiny Llama whose tokenizer is a slow (pure Python, `PythonBackend`) one: ByT5's
    byte tokenizer, which has no fast counterpart and no vocabulary file."""
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    tok = ByT5Tokenizer(extra_ids=0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=256, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None, dtype="float32")
    return _save_model(LlamaForCausalLM, cfg, tok, out, seed)


def _save_model(cls: Any, cfg: Any, tok: Any, out: Path, seed: int) -> Path:
    """A random-init ``cls(cfg)`` (seeded, the caller's RNG untouched) and ``tok`` saved
    as an HF folder at ``out``."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def add_hub_snapshot(hf_home: Path, repo_id: str, model_dir: Path, sha: str,
                     ref: str = "main") -> Path:
    """Put ``model_dir`` into a Hugging Face cache as commit ``sha`` of ``repo_id`` and
    point ``refs/<ref>`` at it: the layout huggingface_hub writes when it downloads
    (``hub/models--org--name/{refs/<ref>, snapshots/<sha>/…}``; real downloads store the
    files under ``blobs/`` and symlink them, which readers do not depend on)."""
    import shutil

    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / sha
    shutil.copytree(model_dir, snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(sha)
    return snap
