"""The verifiers and OpenEnv adapters' episodes with the model's turns sampled by the
session's real vLLM server (the tiny model): the same checks as the in-process engine's
(`tests/unit/test_env_adapters.py`) — observations at mask 0 decode to what the
environment returned, the model's turns at mask 1, rewards the environment's own."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("verifiers", reason="pip install -e '.[environments]'")
pytest.importorskip("openenv.core", reason="pip install -e '.[environments]'")

from pipeline.model import load_model
from tests.adapter_envs import (
    GUESS,
    check_echo_episode,
    check_guess_episode,
    generate_echo_env,
    make_runner,
    run_group,
)
from tests.vllm.conftest import VLLMServer
from workers.engines.vllm import VLLMEngine

VF = "workers.environments.verifiers_adapter:VerifiersEnv"
OE = "workers.environments.openenv_adapter:OpenEnvEnv"


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    root = tmp_path_factory.mktemp("openenv")
    yield generate_echo_env(root, "sluice_echo_vllm")
    sys.path.remove(str(root))


def _groups(srv: VLLMServer, runner: Any, prompt: dict[str, Any]) -> tuple[list[Any], Any]:
    _, tok = load_model(srv.model_dir)

    async def go() -> list[Any]:
        engine = VLLMEngine([srv.url], srv.model, seed=0)
        await engine.start()
        try:
            return await run_group(runner, engine, tok, prompt, n=4)
        finally:
            await engine.close()

    return asyncio.run(go()), tok


def test_verifiers_guess_episodes_on_vllm(vllm_server: VLLMServer) -> None:
    runner = make_runner(VF, {"env": "tests.adapter_envs:load_guess",
                              "env_args": {"max_turns": 3}})
    eps, tok = _groups(vllm_server, runner, GUESS)
    for e in eps:
        check_guess_episode(e, tok, max_turns=3)
    assert any(e.mask.min() == 0 for e in eps)


def test_openenv_echo_episodes_on_vllm(vllm_server: VLLMServer,
                                       echo: tuple[str, str]) -> None:
    env_path, action_path = echo
    runner = make_runner(OE, {"env": env_path, "action": action_path, "max_steps": 3})
    eps, tok = _groups(vllm_server, runner, {"text": "Echo this"})
    for e in eps:
        check_echo_episode(e, tok, "Sluice Echo Vllm environment ready!", max_steps=3)
