"""Reading a vLLM server's ``/metrics`` and sizing its concurrency cap from them.

The cap counts sequences in flight on one server (a request for ``n`` completions is
``n`` sequences: vLLM schedules each as its own request). Rule (`next_cap`):

- start at the KV-cache capacity in whole sequences, ``kv_cache_tokens // max_model_len``
  (every admitted sequence can grow to full length without preemption);
- grow by 25% when ``kv_cache_usage_perc`` < 0.6 and nothing waits (the server has room);
- shrink by 30% when usage > 0.8 (preemptions are near: they recompute whole prefixes);
- never above the configured ceiling, never below 1.

Pure functions here; the engine polls and applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

GROW, SHRINK = 1.25, 0.7
GROW_BELOW, SHRINK_ABOVE = 0.6, 0.8


@dataclass(frozen=True)
class ServerMetrics:
    """The few series the engine uses (summed over the server's engines/labels)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # fraction in [0, 1]
    kv_cache_tokens: int | None = None  # from vllm:cache_config_info, when exported
    max_loras: int | None = None  # from vllm:lora_requests_info, when LoRA is enabled
    preemptions: float = 0.0


def parse_metrics(text: str) -> ServerMetrics:
    """Parse Prometheus text from a vLLM server (0.32 names: ``vllm:…``)."""
    vals: dict[str, float] = {}
    kv_tokens: int | None = None
    max_loras: int | None = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name
            if name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                        "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
                vals[name] = vals.get(name, 0.0) + float(s.value)
            elif name == "vllm:cache_config_info":
                kv_tokens = _kv_tokens(s.labels, kv_tokens)
            elif name == "vllm:lora_requests_info" and "max_lora" in s.labels:
                max_loras = int(float(s.labels["max_lora"]))
    return ServerMetrics(running=vals.get("vllm:num_requests_running", 0.0),
                         waiting=vals.get("vllm:num_requests_waiting", 0.0),
                         kv_usage=vals.get("vllm:kv_cache_usage_perc", 0.0),
                         kv_cache_tokens=kv_tokens, max_loras=max_loras,
                         preemptions=vals.get("vllm:num_preemptions_total", 0.0))


def _kv_tokens(labels: dict[str, str], current: int | None) -> int | None:
    """KV capacity in tokens from cache_config_info's labels: ``kv_cache_size_tokens``
    (0.32, CPU and GPU), else ``num_gpu_blocks`` × ``block_size``."""
    try:
        if "kv_cache_size_tokens" in labels:
            return int(float(labels["kv_cache_size_tokens"]))
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return current


def initial_cap(kv_cache_tokens: int | None, max_model_len: int, ceiling: int) -> int:
    """Whole max-length sequences the KV cache holds (ceiling if unknown)."""
    if not kv_cache_tokens or max_model_len <= 0:
        return ceiling
    return max(1, min(ceiling, kv_cache_tokens // max_model_len))


def next_cap(cap: int, m: ServerMetrics, ceiling: int) -> int:
    """One adaptation step of the cap (see the module docstring)."""
    if m.kv_usage > SHRINK_ABOVE:
        return max(1, min(ceiling, int(cap * SHRINK)))
    if m.kv_usage < GROW_BELOW and m.waiting == 0:
        return max(1, min(ceiling, max(cap + 1, int(cap * GROW))))
    return max(1, min(ceiling, cap))
