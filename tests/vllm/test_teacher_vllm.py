"""The vLLM teacher backend against the session's server (serving the tiny model): its
prompt logprobs equal the in-process teacher's on the same weights."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.model import load_model
from tests.unit.test_teacher import ROWS
from tests.vllm.conftest import VLLMServer
from workers.engines.vllm import VLLMEngine
from workers.teacher import LocalTeacher, TeacherError, VLLMTeacher, load_teacher


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _base_weights(srv: VLLMServer) -> None:
    """Put the server back on its base weights (an earlier test may have swapped them):
    an engine's start does that."""
    e = VLLMEngine([srv.url], srv.model)
    await e.start()
    await e.close()


def test_vllm_teacher_logprobs_equal_the_in_process_teachers(vllm_server: VLLMServer,
                                                             tmp_path: Any) -> None:
    cfg = load_config(None, [f"model.path={vllm_server.model_dir}",
                             f"scoring.teacher={vllm_server.model_dir}",
                             f"scoring.teacher_urls=[\"{vllm_server.url}\"]",
                             f"run.output_dir={tmp_path}"])

    async def go() -> list[np.ndarray]:
        await _base_weights(vllm_server)
        teacher = load_teacher(cfg)
        assert isinstance(teacher, VLLMTeacher)
        await teacher.start()
        try:
            return await teacher.logprobs(ROWS)
        finally:
            await teacher.close()

    got = run(go())
    model, _ = load_model(vllm_server.model_dir)
    want = LocalTeacher(model).forward(ROWS)
    for (_, c, m), g, w in zip(ROWS, got, want, strict=True):
        assert g.shape == c.shape and g.dtype == np.float32
        # fp32 on both sides; vLLM's prompt logprobs are of the raw logits (temperature 1)
        np.testing.assert_allclose(g[m > 0], w[m > 0], atol=1e-4, rtol=0)
        assert (g[m == 0] == 0).all()


def test_vllm_teacher_refusals(vllm_server: VLLMServer) -> None:
    async def go() -> None:
        wrong = VLLMTeacher([vllm_server.url], ["some/other-model"])
        with pytest.raises(ConfigError, match=r"^scoring\.teacher_urls: .* not the teacher"):
            await wrong.start()
        await wrong.close()
        teacher = VLLMTeacher([vllm_server.url], [vllm_server.model], attempts=3)
        await teacher.start()
        try:
            long = (np.full(600, 5, np.int32), np.array([6], np.int32), np.ones(1, np.uint8))
            with pytest.raises(TeacherError, match="HTTP 400"):  # over --max-model-len 512
                await teacher.logprobs([long])
            assert teacher.next == 1  # refused at once: not retried on another server
        finally:
            await teacher.close()

    run(go())
