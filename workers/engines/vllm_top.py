"""The sampler's top logprobs as vLLM servers report them, turned into the fixed [T, k]
arrays a `Completion` carries (score centering, pipeline/rl/centering.py).

Two wire shapes (vllm 0.32): ``/inference/v1/generate`` lists, per token, entries
``{token_id, logprob, rank}`` with the sampled token first and the list cut at the
request's ``logprobs`` (the engine asks for k + 1, so rank 1..k are always present);
``/v1/completions`` gives a dict keyed by token text, or ``token_id:N`` under
``--return-tokens-as-token-ids``, holding the sampled token and the top k.
"""

from __future__ import annotations

import numpy as np

from workers.engines.vllm_pool import VLLMError

TOKEN_ID_PREFIX = "token_id:"  # /v1/completions keys under --return-tokens-as-token-ids
CLAMPED_LOGPROB = -9999.0  # vLLM sends -inf (a token top-k/top-p removed) as this


def completions_top(entry: dict[str, float] | None) -> list[tuple[int, float, None]]:
    """One token's ``top_logprobs`` of ``/v1/completions`` as (id, logprob, rank None).

    Its keys are token strings unless the server runs with --return-tokens-as-token-ids
    (then ``token_id:N``): strings cannot be mapped back to ids, so they are refused.
    """
    out = []
    for key, lp in (entry or {}).items():
        if not key.startswith(TOKEN_ID_PREFIX):
            raise VLLMError(f"top logprobs keyed by token text ({key!r}): a server on "
                            "/v1/completions must run with --return-tokens-as-token-ids "
                            "for generation.num_sampler_logprobs")
        out.append((int(key[len(TOKEN_ID_PREFIX):]), float(lp), None))
    return out


def top_arrays(steps: list[list[tuple[int, float, int | None]]], k: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens of every step, most likely first: int32 ids [T, k] (-1 =
    none) and float32 logprobs [T, k] (-inf = none).

    An entry with a rank keeps rank 1..k (the sampled token also appears with its own
    rank, possibly > k); without ranks (``/v1/completions``) the k highest logprobs. A
    token the sampler could not draw (clamped -inf) is no candidate.
    """
    ids = np.full((len(steps), k), -1, dtype=np.int32)
    lps = np.full((len(steps), k), -np.inf, dtype=np.float32)
    for t, entries in enumerate(steps):
        seen: dict[int, float] = {}
        for tok, lp, rank in entries:
            if lp > CLAMPED_LOGPROB and (rank is None or 1 <= rank <= k):
                seen[tok] = lp
        best = sorted(seen.items(), key=lambda e: -e[1])[:k]
        for j, (tok, lp) in enumerate(best):
            ids[t, j], lps[t, j] = tok, lp
    return ids, lps


def candidate_sets(top_ids: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The top-k / top-p candidate set of every token, read off its top logprobs: the
    tokens whose processed logprob is finite. Complete when the engine asked for at least
    ``top_k`` (top-k truncation, top-p applied inside it) or a row shows a token the
    sampler could not draw (-1 here); otherwise None (sets unknown, as without top
    logprobs). Returns (flat int32 ids, int32 [T] set sizes), the `Completion` format."""
    valid = top_ids >= 0
    k = top_ids.shape[1]
    if not (0 < top_k <= k) and not (~valid).any(axis=1).all():
        return None
    return top_ids[valid].astype(np.int32), valid.sum(axis=1).astype(np.int32)
