"""The bearer key between sluice and its vLLM servers (docs/security.md: vLLM servers).

A vLLM server sluice starts runs with ``VLLM_SERVER_DEV_MODE=1`` (pause, reload and
``/collective_rpc``: whoever can call those can make the server load any weights), so it
is started with a key and refuses every request without it (`workers.engines.vllm_guard`
guards every path, not only vLLM's own ``/v1/*`` check). Every client sluice has
(generate, weight swaps, NCCL pushes, metrics, teacher) sends ``Authorization: Bearer
<key>`` on every request, resolved here in one way:

1. ``generation.vllm.api_key_file`` (a file holding the key, first line), else
2. the environment variable ``VLLM_API_KEY`` (vLLM's own name for it), else
3. no key (servers the user runs without one).

`sluice up` makes one key per run (`run_key`): kept in ``<output>/vllm/api_key``
(0600), handed to the servers and the roles in ``VLLM_API_KEY`` (the environment, never a
command line: ``ps`` shows command lines to every local user).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from pipeline.config import ConfigError

API_KEY_ENV = "VLLM_API_KEY"
KEY_FILE_MODE = 0o600


class APIKeyError(ConfigError):
    """``generation.vllm.api_key_file`` names a file that cannot be read, or an empty one."""


def read_key_file(path: str | Path) -> str:
    """The key in ``path`` (its first line, stripped); `APIKeyError` when unreadable or
    empty (an empty key would silently turn the check off)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise APIKeyError(f"generation.vllm.api_key_file: cannot read {path}: {e}") from e
    key = (text.splitlines() or [""])[0].strip()
    if not key:
        raise APIKeyError(f"generation.vllm.api_key_file: {path} holds no key")
    return key


def vllm_api_key(key_file: str = "") -> str | None:
    """The key to send to vLLM servers: ``key_file``'s, else ``$VLLM_API_KEY``, else None."""
    if key_file:
        return read_key_file(key_file)
    return os.environ.get(API_KEY_ENV) or None


def auth_headers(key: str | None) -> dict[str, str]:
    """The headers that carry ``key`` (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def run_key(folder: Path, key_file: str = "") -> str:
    """The key for the servers `sluice up` launches: the configured one (`vllm_api_key`)
    when there is one, else the run's own from ``folder/api_key``, created once (random,
    256 bits, mode 0600 from its creation: never readable by others, even briefly) and
    reused when the run is resumed."""
    configured = vllm_api_key(key_file)
    if configured:
        return configured
    path = folder / "api_key"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
    except FileExistsError:
        return read_key_file(path)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return read_key_file(path)
