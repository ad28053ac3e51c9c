"""A generator on an `hf` task with conversational prompts: each group's prompt is the
row's conversation and columns, its prompt ids the chat-template rendering (with the
system prompt) of exactly the prompt its index names (real model, tokenizer, Redis)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry
from pipeline.bus.schema import RolloutGroup
from pipeline.config import load_config
from pipeline.model import load_tokenizer
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from workers.generator import Generator
from workers.tasks.catalog import task_from_config
from workers.tasks.prompts import render_prompt

pytestmark = pytest.mark.integration

CHAT = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}={% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")


def test_generator_renders_conversations_and_ships_their_columns(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tok = load_tokenizer(model)
    tok.chat_template = CHAT
    tok.save_pretrained(model)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}"}],
                                        "solution": str(2 * i), "meta": {"i": i}}) + "\n"
                            for i in range(20)))
    cfg = load_config(None, [f"run.name={run_name}", f"run.output_dir={tmp_path / 'out'}",
                             f"bus.redis_url={redis_server.url}", f"model.path={model}",
                             "model.init=''", "generation.num_generations=2",
                             "generation.max_new_tokens=2", "task.name=hf",
                             f"task.dataset={data}", "task.answer_column=solution",
                             "task.system_prompt=S"])
    gen = Generator(cfg, "g0")

    async def go() -> list[Any]:
        bus = Bus.connect(cfg.redis_url, run_name)
        try:
            cursors = [await bus.admit(16, gen.wid) for _ in range(3)]
            await gen.generate_batch(bus, [c for c in cursors if c is not None])
            return [decode_entry(f) for _i, f in await bus.r.xrange(bus.keys.rollouts)]
        finally:
            await bus.close()

    groups = arun(go())
    task = task_from_config(cfg, load_tokenizer(model))
    assert len(groups) == 3
    for g in groups:
        assert isinstance(g, RolloutGroup)
        want = task.prompt(g.prompt_index)
        assert g.prompt == want and isinstance(g.prompt["text"], list)
        assert g.prompt["answer"] == g.prompt["solution"] and "i" in g.prompt["meta"]
        ids = render_prompt(tok, want["text"], "S")
        assert g.prompt_ids.tolist() == ids
        assert tok.decode(ids).startswith("system:S=user:")
