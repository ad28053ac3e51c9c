"""The one codec: msgpack maps with short stable keys, arrays as raw little-endian bytes.

Invariants:
- Every message carries ``schema`` and ``type``; a decoder accepts exactly
  `SCHEMA_VERSION` and raises `DecodeError` (with a reason fit for the dead-letter
  stream) on anything else: wrong types, ragged lengths, non-finite floats, token ids
  outside the vocabulary, an empty prompt (the trainer predicts the first completion
  token from it), or a payload above the size limit. Nothing is unpickled.
- A group's ``prompt`` dict (what reward functions get) holds JSON-like values: scalars,
  None, lists and string-keyed maps, at most 16 levels deep; its ``text`` is a string or
  a conversation (messages with a str ``role`` and a str or list ``content``).
- ``decode(encode(m)) == m`` for every valid message.
- A ``scored`` message carries a `TrainGroup` (gid, prompt ids, per completion the token
  arrays and candidate sets, ``clip`` flags), never the prompt dict or the texts
  (docs/design.md §5: the trainer reads none of it). docs/wire-format.md lists every field.
A stream entry holds one field, ``m``, with the encoded message.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from pipeline.bus.prompt_values import DecodeError as DecodeError
from pipeline.bus.prompt_values import check_prompt_value as check_prompt_value
from pipeline.bus.prompt_values import decode_prompt
from pipeline.bus.schema import (
    SCHEMA_VERSION,
    Limits,
    Rollout,
    RolloutGroup,
    RunFinished,
    ScoredGroup,
    TrainGroup,
    TrainRollout,
    WeightsPublished,
    split_candidates,
)

FIELD = b"m"

Message = RolloutGroup | ScoredGroup | WeightsPublished | RunFinished



_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")
_F16 = np.dtype("<f2")
MAX_TOP_LOGPROBS = 64
"""Most sampler top logprobs per token a message may carry (score centering uses ~8)."""


def _arr(a: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def _tokens_map(r: Rollout | TrainRollout) -> dict[str, Any]:
    """The arrays both streams carry of a completion (candidate sets only if recorded)."""
    m = {"ids": _arr(r.completion_ids, _I32), "lp": _arr(r.logprobs, _F32),
         "ver": _arr(r.versions, _I32), "mask": _arr(r.mask, _U8)}
    if r.candidate_ids is not None and r.candidate_counts is not None:
        m["cand"] = _arr(r.candidate_ids, _I32)
        m["ncand"] = _arr(r.candidate_counts, _I32)
    if r.top_ids is not None and r.top_logprobs is not None:
        # float16 logprobs: 6 bytes per entry instead of 8; an error of <= 0.05% in a
        # probability is far below the sampler-trainer gap centering corrects
        m["topk"] = int(r.top_ids.shape[1])
        m["top"] = _arr(r.top_ids, _I32)
        lp = np.where(r.top_ids >= 0, np.maximum(r.top_logprobs, -6e4), 0.0)  # f16 range
        m["toplp"] = _arr(lp, _F16)
    return m


def _rollout_map(r: Rollout) -> dict[str, Any]:
    m = {**_tokens_map(r), "fin": r.finish_reason, "text": r.text}
    if r.messages is not None:
        m["msgs"] = r.messages
    if r.env_reward is not None:
        m["env"] = r.env_reward
    return m


def _group_map(g: RolloutGroup) -> dict[str, Any]:
    return {
        "gid": g.group_id,
        "pidx": g.prompt_index,
        "epoch": g.epoch,
        "prompt": g.prompt,
        "pids": _arr(g.prompt_ids, _I32),
        "gen": g.generator,
        "t_admit": g.t_admit,
        "t_done": g.t_done,
        "ro": [_rollout_map(r) for r in g.rollouts],
    }


def encode(msg: Message) -> bytes:
    """Encode one message to bytes (never fails on a well-typed message)."""
    body: dict[str, Any]
    if isinstance(msg, RolloutGroup):
        body = {"type": "rollout", **_group_map(msg)}
    elif isinstance(msg, ScoredGroup):
        g = msg.group
        body = {
            "type": "scored",
            "gid": g.group_id,
            "pids": _arr(g.prompt_ids, _I32),
            "ro": [_tokens_map(r) for r in g.rollouts],
            "clip": _arr(np.array([r.clipped for r in g.rollouts]), _U8),
            "rew": _arr(msg.rewards, _F32),
            "parts": {k: _arr(v, _F32) for k, v in msg.reward_parts.items()},
            "adv": _arr(msg.advantages, _F32),
            **({"tadv": [_arr(a, _F32) for a in msg.token_advantages]}
               if msg.token_advantages is not None else {}),
            "scorer": msg.scorer,
            "t_scored": msg.t_scored,
        }
    elif isinstance(msg, WeightsPublished):
        body = {
            "type": "weights",
            "version": msg.version,
            "step": msg.step,
            "uri": msg.uri,
            "format": msg.format,
            "sha256": msg.sha256,
            "nbytes": msg.nbytes,
            "t": msg.t,
            # optional keys: absent on a full version of a run without deltas, so those
            # announcements are byte for byte what schema 3 always sent
            **({"base": msg.base} if msg.base >= 0 else {}),
            **({"state": msg.state} if msg.state else {}),
        }
    elif isinstance(msg, RunFinished):
        body = {"type": "finished", "reason": msg.reason, "t": msg.t}
    else:
        raise TypeError(f"cannot encode {type(msg).__name__}")
    body["schema"] = SCHEMA_VERSION
    return msgpack.packb(body, use_bin_type=True)


# ---------------------------------------------------------------- decoding helpers


def _get(m: dict[str, Any], key: str, types: type | tuple[type, ...], where: str) -> Any:
    if key not in m:
        raise DecodeError(f"{where}: missing field {key!r}")
    v = m[key]
    # bool is an int subclass: never accept it where a number is expected
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise DecodeError(f"{where}.{key}: expected {types}, got bool")
    if not isinstance(v, types):
        raise DecodeError(f"{where}.{key}: expected {_names(types)}, got {type(v).__name__}")
    return v


def _names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return "|".join(t.__name__ for t in ts)


def _finite(v: float, where: str) -> float:
    if not math.isfinite(v):
        raise DecodeError(f"{where}: not finite ({v})")
    return float(v)


def _array(m: dict[str, Any], key: str, dtype: np.dtype, where: str, limits: Limits) -> np.ndarray:
    raw = _get(m, key, bytes, where)
    if len(raw) % dtype.itemsize:
        raise DecodeError(f"{where}.{key}: {len(raw)} bytes is not a multiple of {dtype.itemsize}")
    a = np.frombuffer(raw, dtype=dtype)
    if len(a) > limits.max_tokens:
        raise DecodeError(f"{where}.{key}: {len(a)} elements exceeds limit {limits.max_tokens}")
    if dtype.kind == "f" and len(a) and not np.isfinite(a).all():
        raise DecodeError(f"{where}.{key}: contains NaN or inf")
    return a.astype(dtype.newbyteorder("="), copy=True)


def _token_ids(m: dict[str, Any], key: str, where: str, limits: Limits) -> np.ndarray:
    a = _array(m, key, _I32, where, limits)
    if len(a) and (a.min() < 0 or a.max() >= limits.vocab_size):
        raise DecodeError(f"{where}.{key}: token id outside [0, {limits.vocab_size})")
    return a


def _decode_tokens(m: Any, where: str, limits: Limits) -> dict[str, Any]:
    """A completion's arrays (`_tokens_map`), validated: the keyword arguments shared by
    `Rollout` and `TrainRollout`."""
    if not isinstance(m, dict):
        raise DecodeError(f"{where}: expected a map")
    ids = _token_ids(m, "ids", where, limits)
    lp = _array(m, "lp", _F32, where, limits)
    ver = _array(m, "ver", _I32, where, limits)
    mask = _array(m, "mask", _U8, where, limits)
    if not (len(ids) == len(lp) == len(ver) == len(mask)):
        raise DecodeError(
            f"{where}: length mismatch ids={len(ids)} lp={len(lp)} ver={len(ver)} "
            f"mask={len(mask)}"
        )
    if len(ver) and ver.min() < 0:
        raise DecodeError(f"{where}.ver: negative version")
    if len(mask) and mask.max() > 1:
        raise DecodeError(f"{where}.mask: values must be 0 or 1")
    if len(lp) and lp.max() > 1e-3:
        raise DecodeError(f"{where}.lp: a log-probability above 0")
    cand, ncand = _candidates(m, ids, where, limits)
    top, toplp = _top_logprobs(m, len(ids), where, limits)
    return {"completion_ids": ids, "logprobs": lp, "versions": ver, "mask": mask,
            "candidate_ids": cand, "candidate_counts": ncand, "top_ids": top,
            "top_logprobs": toplp}


def _top_logprobs(m: dict[str, Any], n_tokens: int, where: str,
                  limits: Limits) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Optional sampler top logprobs: ``k`` ids per token (-1 = none) and their logprobs,
    as ``[T, k]`` int32 / float32."""
    keys = {"topk", "top", "toplp"} & m.keys()
    if not keys:
        return None, None
    if len(keys) != 3:
        raise DecodeError(f"{where}: top logprobs need topk, top and toplp together")
    k = _get(m, "topk", int, where)
    if not 1 <= k <= MAX_TOP_LOGPROBS:
        raise DecodeError(f"{where}.topk: {k} outside [1, {MAX_TOP_LOGPROBS}]")
    ids = _array(m, "top", _I32, where, limits)
    lps = _array(m, "toplp", _F16, where, limits)
    if len(ids) != n_tokens * k or len(lps) != n_tokens * k:
        raise DecodeError(f"{where}.top: {len(ids)} ids and {len(lps)} logprobs for "
                          f"{n_tokens} tokens x {k}")
    if len(ids) and (ids.min() < -1 or ids.max() >= limits.vocab_size):
        raise DecodeError(f"{where}.top: token id outside [-1, {limits.vocab_size})")
    if len(lps) and lps.max() > 1e-3:
        raise DecodeError(f"{where}.toplp: a log-probability above 0")
    return ids.reshape(n_tokens, k), lps.astype(np.float32).reshape(n_tokens, k)


def _decode_rollout(m: Any, where: str, limits: Limits) -> Rollout:
    arrays = _decode_tokens(m, where, limits)
    messages = env = None
    if "msgs" in m:
        messages = m["msgs"]
        check_prompt_value(messages, f"{where}.msgs")
        if not isinstance(messages, list) or not all(
                isinstance(x, dict) and isinstance(x.get("role"), str) for x in messages):
            raise DecodeError(f"{where}.msgs: expected a list of messages with a role")
    if "env" in m:
        env_raw = _get(m, "env", dict, where)
        env = {}
        for k, v in env_raw.items():
            if not isinstance(k, str) or type(v) not in (int, float):
                raise DecodeError(f"{where}.env: expected str -> number")
            env[k] = _finite(float(v), f"{where}.env.{k}")
    return Rollout(finish_reason=_get(m, "fin", str, where), text=_get(m, "text", str, where),
                   messages=messages, env_reward=env, **arrays)


def _candidates(m: dict[str, Any], ids: np.ndarray, where: str,
                limits: Limits) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Optional per-token candidate sets; each known set must contain its sampled id."""
    if "cand" not in m and "ncand" not in m:
        return None, None
    cand = _token_ids(m, "cand", where, limits)
    ncand = _array(m, "ncand", _I32, where, limits)
    if len(ncand) != len(ids):
        raise DecodeError(f"{where}.ncand: {len(ncand)} counts for {len(ids)} tokens")
    if len(ncand) and ncand.min() < 0:
        raise DecodeError(f"{where}.ncand: negative count")
    if int(ncand.sum()) != len(cand):
        raise DecodeError(f"{where}.cand: {len(cand)} ids but counts sum to {int(ncand.sum())}")
    for t, s in enumerate(split_candidates(cand, ncand)):
        if len(s) and ids[t] not in s:
            raise DecodeError(f"{where}.cand: token {t} (id {ids[t]}) is not in its candidate set")
    return cand, ncand


def _group_head(m: dict[str, Any], limits: Limits) -> tuple[str, str, list[Any], np.ndarray]:
    """What both group messages start with: (gid, where, raw rollouts, prompt ids)."""
    gid = _get(m, "gid", str, "group")
    where = f"group {gid}"
    ro_raw = _get(m, "ro", list, where)
    if not ro_raw:
        raise DecodeError(f"{where}: no rollouts")
    if len(ro_raw) > limits.max_rollouts:
        raise DecodeError(f"{where}: {len(ro_raw)} rollouts exceeds limit {limits.max_rollouts}")
    pids = _token_ids(m, "pids", where, limits)
    if not len(pids):  # the first completion token must be predicted from some context
        raise DecodeError(f"{where}.pids: empty prompt")
    return gid, where, ro_raw, pids


def _decode_group(m: dict[str, Any], limits: Limits) -> RolloutGroup:
    gid, where, ro_raw, pids = _group_head(m, limits)
    pidx = _get(m, "pidx", int, where)
    epoch = _get(m, "epoch", int, where)
    if pidx < 0 or epoch < 0:
        raise DecodeError(f"{where}: negative prompt index or epoch")
    return RolloutGroup(
        group_id=gid,
        prompt_index=pidx,
        epoch=epoch,
        prompt=decode_prompt(_get(m, "prompt", dict, where), where),
        prompt_ids=pids,
        generator=_get(m, "gen", str, where),
        t_admit=_finite(_get(m, "t_admit", (int, float), where), f"{where}.t_admit"),
        t_done=_finite(_get(m, "t_done", (int, float), where), f"{where}.t_done"),
        rollouts=[_decode_rollout(r, f"{where}.ro[{i}]", limits) for i, r in enumerate(ro_raw)],
    )


def _per_rollout(m: dict[str, Any], key: str, n: int, where: str, limits: Limits) -> np.ndarray:
    a = _array(m, key, _F32, where, limits)
    if len(a) != n:
        raise DecodeError(f"{where}.{key}: {len(a)} values for {n} rollouts")
    return a


def _decode_scored(m: dict[str, Any], limits: Limits) -> ScoredGroup:
    gid, where, ro_raw, pids = _group_head(m, limits)
    n = len(ro_raw)
    clip = _array(m, "clip", _U8, where, limits)
    if len(clip) != n or (n and clip.max() > 1):
        raise DecodeError(f"{where}.clip: expected {n} values of 0 or 1")
    g = TrainGroup(gid, pids, [
        TrainRollout(clipped=bool(c), **_decode_tokens(r, f"{where}.ro[{i}]", limits))
        for i, (r, c) in enumerate(zip(ro_raw, clip, strict=True))])
    parts_raw = _get(m, "parts", dict, where)
    parts: dict[str, np.ndarray] = {}
    for k, v in parts_raw.items():
        if not isinstance(k, str) or not isinstance(v, bytes):
            raise DecodeError(f"{where}.parts: expected str -> bytes")
        if len(v) != 4 * n:
            raise DecodeError(f"{where}.parts.{k}: {len(v)} bytes for {n} rollouts")
        part = np.frombuffer(v, dtype=_F32).astype(np.float32)  # NaN = fn gave None
        if np.isinf(part).any():  # NaN has a meaning here, inf none: no reward is infinite
            raise DecodeError(f"{where}.parts.{k}: contains inf")
        parts[k] = part
    tadv = None
    if "tadv" in m:
        raw = _get(m, "tadv", list, where)
        if len(raw) != n:
            raise DecodeError(f"{where}.tadv: {len(raw)} rows for {n} rollouts")
        tadv = []
        for i, (a, r) in enumerate(zip(raw, g.rollouts, strict=True)):
            arr = _array({"a": a}, "a", _F32, f"{where}.tadv[{i}]", limits)
            if len(arr) != len(r.completion_ids):
                raise DecodeError(f"{where}.tadv[{i}]: {len(arr)} values for "
                                  f"{len(r.completion_ids)} tokens")
            tadv.append(arr)
    return ScoredGroup(
        group=g,
        rewards=_per_rollout(m, "rew", n, where, limits),
        reward_parts=parts,
        advantages=_per_rollout(m, "adv", n, where, limits),
        scorer=_get(m, "scorer", str, where),
        t_scored=_finite(_get(m, "t_scored", (int, float), where), f"{where}.t_scored"),
        token_advantages=tadv,
    )


def _decode_weights(m: dict[str, Any]) -> WeightsPublished:
    w = "weights"
    version = _get(m, "version", int, w)
    if version < 0:
        raise DecodeError("weights.version: negative")
    sha = _get(m, "sha256", str, w)
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise DecodeError("weights.sha256: not a hex sha256")
    fmt = _get(m, "format", str, w)
    if fmt not in ("safetensors", "lora", "nccl", "delta"):
        raise DecodeError(f"weights.format: unknown format {fmt!r}")
    base = _get(m, "base", int, w) if "base" in m else -1
    state = _get(m, "state", str, w) if "state" in m else ""
    if state and (len(state) != 64 or any(c not in "0123456789abcdef" for c in state)):
        raise DecodeError("weights.state: not a hex sha256")
    if fmt == "delta" and not (0 <= base < version and state):
        raise DecodeError("weights: a delta needs base (an older version) and state")
    if fmt != "delta" and base != -1:
        raise DecodeError(f"weights.base: only a delta has a base (format {fmt!r})")
    return WeightsPublished(
        version=version,
        step=_get(m, "step", int, w),
        uri=_get(m, "uri", str, w),
        format=fmt,
        sha256=sha,
        nbytes=_get(m, "nbytes", int, w),
        t=_finite(_get(m, "t", (int, float), w), "weights.t"),
        base=base,
        state=state,
    )


def decode(data: bytes, limits: Limits | None = None, expect: type | None = None) -> Message:
    """Decode and validate one message; raises `DecodeError` with the reason."""
    limits = limits or Limits()
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"payload is {type(data).__name__}, not bytes")
    if len(data) > limits.max_message_bytes:
        raise DecodeError(f"payload of {len(data)} bytes exceeds {limits.max_message_bytes}")
    try:
        m = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise DecodeError(f"malformed msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(m, dict):
        raise DecodeError(f"message is {type(m).__name__}, not a map")
    schema = m.get("schema")
    # exactly the int: 1.0 or True compare equal to 1 but are not this schema's encoding
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise DecodeError(f"unknown schema version {schema!r} (expected {SCHEMA_VERSION})")
    kind = m.get("type")
    msg: Message
    if kind == "rollout":
        msg = _decode_group(m, limits)
    elif kind == "scored":
        msg = _decode_scored(m, limits)
    elif kind == "weights":
        msg = _decode_weights(m)
    elif kind == "finished":
        t = _finite(_get(m, "t", (int, float), "finished"), "finished.t") if "t" in m else 0.0
        msg = RunFinished(reason=_get(m, "reason", str, "finished"), t=t)
    else:
        raise DecodeError(f"unknown message type {kind!r}")
    if expect is not None and not isinstance(msg, expect):
        raise DecodeError(f"expected a {expect.__name__} message, got {type(msg).__name__}")
    return msg


def decode_entry(fields: dict[bytes, bytes], limits: Limits | None = None,
                 expect: type | None = None) -> Message:
    """Decode a stream entry's field map (one field, ``m``)."""
    if FIELD not in fields:
        raise DecodeError(f"stream entry has no {FIELD!r} field (fields: {sorted(fields)[:5]})")
    return decode(fields[FIELD], limits, expect)


def peek_group_id(fields: dict[bytes, bytes] | None) -> str | None:
    """The group id a possibly invalid entry claims, if one can be read. A claim only:
    for an entry that does not decode it is whatever its writer put there, so it names
    the entry in logs and the ledger (``claimed``) and is never a reason to retire a
    group (`pipeline.bus.inbound`)."""
    try:
        m = msgpack.unpackb((fields or {}).get(FIELD, b""), raw=False)
    except Exception:
        return None
    gid = m.get("gid") if isinstance(m, dict) else None
    return gid if isinstance(gid, str) else None
