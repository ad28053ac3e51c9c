"""`sluice up` refuses, before any server starts, a CPU vLLM server whose KV cache cannot
hold one ``max_model_len`` sequence (vLLM refuses it only after loading the model)."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError
from sluice.vllm_placement import check_kv_budget, kv_bytes_per_token

# SmolLM2-135M's shape (config.json of HuggingFaceTB/SmolLM2-135M-Instruct)
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}


def test_bytes_per_token_follow_vllms_full_attention_layout() -> None:
    assert kv_bytes_per_token(SMOLLM2, "float32") == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(SMOLLM2, "bfloat16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token({**SMOLLM2, "head_dim": 128}, "bfloat16") == 2 * 30 * 3 * 128 * 2
    assert kv_bytes_per_token({"text_config": SMOLLM2}, "float32") == 46080  # a VLM
    # layouts the formula does not describe are not judged
    assert kv_bytes_per_token({**SMOLLM2, "sliding_window": 4096}, "float32") is None
    assert kv_bytes_per_token({**SMOLLM2, "layer_types": ["sliding_attention"]}, "x") is None
    assert kv_bytes_per_token({"num_hidden_layers": 2}, "float32") is None


def test_a_kv_cache_too_small_for_one_sequence_is_refused_naming_both_keys() -> None:
    per_token = 46080
    check_kv_budget(SMOLLM2, "float32", 1024, per_token * 1024)  # exactly one: fine
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes = .*max_model_len = 2048"):
        check_kv_budget(SMOLLM2, "float32", 2048, 64 * 2**20)
    check_kv_budget({**SMOLLM2, "sliding_window": 8}, "float32", 2048, 2**20)  # not judged
