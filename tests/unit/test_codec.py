"""pipeline.bus.codec: exact round trips, and every malformed input rejected with DecodeError.

Each rejection test starts from a valid encoding (unpacked to a dict), changes exactly one
thing, re-packs it and expects `DecodeError` with a reason naming what is wrong. The helper
first checks that the unchanged re-packed dict decodes, so the mutation is the only cause.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.bus.codec import DecodeError, decode, decode_entry, encode, peek_group_id
from pipeline.bus.schema import (
    SCHEMA_VERSION,
    Limits,
    Rollout,
    RolloutGroup,
    RunFinished,
    ScoredGroup,
    WeightsPublished,
)
from tests.helpers import key_paths, value_at

VOCAB = 76
SHA = "0123456789abcdef" * 4


# ---------------------------------------------------------------- fixtures / helpers


def _rollout(ids: list[int], *, v0: int = 3, fin: str = "length", text: str = "x") -> Rollout:
    n = len(ids)
    return Rollout(
        completion_ids=np.asarray(ids, dtype=np.int32),
        logprobs=-np.linspace(0.25, 2.5, n, dtype=np.float32) if n else np.zeros(0, np.float32),
        versions=np.arange(v0, v0 + n, dtype=np.int32),
        mask=np.asarray([i % 2 == 0 for i in range(n)], dtype=np.uint8),
        finish_reason=fin,
        text=text,
    )


def make_group() -> RolloutGroup:
    return RolloutGroup(
        group_id="2:17",
        prompt_index=17,
        epoch=2,
        prompt={"text": "copy: 1234", "answer": "1234", "n": 4, "w": 0.5, "hard": False},
        prompt_ids=np.asarray([5, 6, 7, 8, 75], dtype=np.int32),
        generator="generator-host-1",
        t_admit=1700000000.25,
        t_done=1700000001.5,
        rollouts=[
            _rollout([10, 11, 12, 1], fin="stop", text="ab\u00e9"),  # non-ASCII text survives
            _rollout([20, 21, 22, 23, 24]),
            _rollout([30], v0=0),
        ],
    )


def make_scored() -> ScoredGroup:
    return ScoredGroup(
        group=make_group().for_training(),
        rewards=np.asarray([1.0, -0.5, 0.0], dtype=np.float32),
        reward_parts={
            "copy_reward": np.asarray([1.0, -0.5, 0.0], dtype=np.float32),
            "exact_match": np.asarray([1.0, np.nan, 0.0], dtype=np.float32),  # NaN = None
        },
        advantages=np.asarray([1.2, -1.0, -0.2], dtype=np.float32),
        scorer="scorer-1",
        t_scored=1700000002.0,
    )


def make_weights() -> WeightsPublished:
    return WeightsPublished(
        version=7, step=14, uri="file:///runs/x/weights/v00000007", format="safetensors",
        sha256=SHA, nbytes=123456, t=1700000003.125,
    )


def make_finished() -> RunFinished:
    return RunFinished(reason="max_steps", t=1700000004.5)


MAKERS: dict[str, Callable[[], Any]] = {
    "rollout": make_group,
    "scored": make_scored,
    "weights": make_weights,
    "finished": make_finished,
}


def assert_same(a: Any, b: Any, path: str = "msg") -> None:
    """Field-by-field equality; arrays must match in dtype, shape and values (NaN == NaN)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{path}: {a} != {b}"
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def raw(msg: Any) -> dict[str, Any]:
    """A valid message as the plain dict its encoding unpacks to."""
    return msgpack.unpackb(encode(msg), raw=False)


def pack(d: Any) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


def i32(*xs: int) -> bytes:
    return np.asarray(xs, dtype="<i4").tobytes()


def f32(*xs: float) -> bytes:
    return np.asarray(xs, dtype="<f4").tobytes()


def u8(*xs: int) -> bytes:
    return np.asarray(xs, dtype="u1").tobytes()


def reject(
    kind: str,
    mutate: Callable[[dict[str, Any]], None],
    match: str,
    limits: Limits | None = None,
) -> DecodeError:
    """Mutate one key of a valid ``kind`` message; decoding must raise DecodeError(match)."""
    d = raw(MAKERS[kind]())
    decode(pack(d), limits)  # control: the unmutated re-pack is valid under these limits
    mutate(d)
    with pytest.raises(DecodeError, match=match) as ei:
        decode(pack(d), limits)
    return ei.value


def put(*path: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def f(d: dict[str, Any]) -> None:
        node = d
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return f


def drop(*path: Any) -> Callable[[dict[str, Any]], None]:
    def f(d: dict[str, Any]) -> None:
        node = d
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]

    return f


def edit_array(*path: Any, dtype: str, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[
    [dict[str, Any]], None
]:
    """Decode the raw array at ``path``, transform it, store the new bytes back."""

    def f(d: dict[str, Any]) -> None:
        node = d
        for p in path[:-1]:
            node = node[p]
        a = np.frombuffer(node[path[-1]], dtype=dtype).copy()
        node[path[-1]] = np.ascontiguousarray(fn(a), dtype=dtype).tobytes()

    return f


def set_at(i: int, value: float) -> Callable[[np.ndarray], np.ndarray]:
    def f(a: np.ndarray) -> np.ndarray:
        a[i] = value
        return a

    return f


# ---------------------------------------------------------------- round trips


def test_conversational_prompt_and_nested_columns_round_trip() -> None:
    """A TRL conversational prompt and list/map/None columns travel unchanged."""
    g = make_group()
    g.prompt = {"text": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}],
                "solution": "4", "tags": ["math", None], "meta": {"level": 2, "ok": True}}
    out = decode(encode(g), Limits(vocab_size=VOCAB))
    assert isinstance(out, RolloutGroup) and out.prompt == g.prompt


def test_prompt_nested_too_deep_is_rejected() -> None:
    deep: Any = "x"
    for _ in range(20):
        deep = [deep]
    reject("rollout", put("prompt", "n", value=deep), r"prompt\.n.*nested deeper than 16")


@pytest.mark.parametrize("kind", list(MAKERS))
def test_decode_of_encode_equals_original_field_by_field(kind: str) -> None:
    msg = MAKERS[kind]()
    out = decode(encode(msg), Limits(vocab_size=VOCAB))
    assert_same(out, msg)


def test_scored_carries_only_what_the_trainer_reads() -> None:
    """No prompt dict, texts, finish-reason strings or generator metadata on ``scored``
    (docs/wire-format.md); clipping travels as a flag per completion, candidate sets stay."""
    g = make_group()
    g.rollouts[0].candidate_ids = np.asarray([10, 11, 12], dtype=np.int32)
    g.rollouts[0].candidate_counts = np.asarray([1, 2, 0, 0], dtype=np.int32)
    sg = dataclasses.replace(make_scored(), group=g.for_training())
    d = raw(sg)
    assert set(d) == {"schema", "type", "gid", "pids", "ro", "clip", "rew", "parts", "adv",
                      "scorer", "t_scored"}
    assert [set(r) for r in d["ro"]] == [{"ids", "lp", "ver", "mask", "cand", "ncand"},
                                         {"ids", "lp", "ver", "mask"},
                                         {"ids", "lp", "ver", "mask"}]
    assert d["clip"] == bytes(r.finish_reason == "length" for r in g.rollouts)
    out = decode(encode(sg), Limits(vocab_size=VOCAB))
    assert isinstance(out, ScoredGroup)
    assert_same(out.group, g.for_training())
    assert [r.clipped for r in out.group.rollouts] == [False, True, True]
    assert len(encode(sg)) < len(encode(g))


@pytest.mark.parametrize(("value", "match"), [
    (bytes([1, 0]), r"clip: expected 3 values of 0 or 1"),
    (bytes([1, 2, 0]), r"clip: expected 3 values of 0 or 1"),
    ([1, 0, 1], r"clip: expected bytes, got list"),
])
def test_scored_clip_flags_are_validated(value: Any, match: str) -> None:
    reject("scored", put("clip", value=value), match)


def test_scored_without_clip_flags_is_rejected() -> None:
    reject("scored", drop("clip"), "missing field 'clip'")


def test_round_trip_arrays_are_native_writable_copies_with_fixed_dtypes() -> None:
    sg = decode(encode(make_scored()))
    assert isinstance(sg, ScoredGroup)
    r = sg.group.rollouts[0]
    assert r.completion_ids.dtype == np.int32 and r.versions.dtype == np.int32
    assert r.logprobs.dtype == np.float32 and r.mask.dtype == np.uint8
    assert sg.group.prompt_ids.dtype == np.int32
    assert sg.rewards.dtype == sg.advantages.dtype == np.float32
    assert all(v.dtype == np.float32 for v in sg.reward_parts.values())
    assert r.completion_ids.flags.writeable and sg.rewards.flags.writeable
    assert np.isnan(sg.reward_parts["exact_match"][1])  # None survives as NaN


def test_encode_casts_wider_input_dtypes_to_the_wire_dtypes() -> None:
    g = make_group()
    r = g.rollouts[1]
    g.rollouts[1] = dataclasses.replace(
        r, completion_ids=r.completion_ids.astype(np.int64), logprobs=r.logprobs.astype(np.float64),
        versions=r.versions.astype(np.int64), mask=r.mask.astype(np.int64))
    out = decode(encode(g))
    assert isinstance(out, RolloutGroup)
    assert_same(out.rollouts[1], make_group().rollouts[1])


def test_empty_completion_round_trips() -> None:
    g = make_group()
    g.rollouts[2] = _rollout([])
    assert_same(decode(encode(g)), g)


def test_decode_accepts_bytearray_and_memoryview() -> None:
    data = encode(make_weights())
    assert_same(decode(bytearray(data)), make_weights())
    assert_same(decode(memoryview(data)), make_weights())


def test_decode_entry_reads_the_m_field() -> None:
    assert_same(decode_entry({b"m": encode(make_finished())}), make_finished())


def test_encode_rejects_a_non_message() -> None:
    with pytest.raises(TypeError, match="cannot encode dict"):
        encode({"type": "rollout"})  # type: ignore[arg-type]


# ---------------------------------------------------------------- rejections: envelope


@pytest.mark.parametrize(
    "data",
    [b"\xc1", b"\x92\x01", encode(make_group())[:-5], b"\xa3ab\xff"],
    ids=["reserved-byte", "truncated-array", "truncated-message", "bad-utf8"],
)
def test_malformed_msgpack_is_rejected(data: bytes) -> None:
    with pytest.raises(DecodeError, match="malformed msgpack"):
        decode(data)


def test_trailing_bytes_after_a_valid_message_are_rejected() -> None:
    with pytest.raises(DecodeError, match="malformed msgpack"):
        decode(encode(make_finished()) + b"\x00")


@pytest.mark.parametrize("obj", [[1, 2], "rollout", 7, None], ids=["list", "str", "int", "nil"])
def test_non_map_payload_is_rejected(obj: Any) -> None:
    with pytest.raises(DecodeError, match="not a map"):
        decode(pack(obj))


def test_non_bytes_payload_is_rejected() -> None:
    with pytest.raises(DecodeError, match="payload is str, not bytes"):
        decode("abc")  # type: ignore[arg-type]


def test_map_with_integer_keys_is_rejected() -> None:
    with pytest.raises(DecodeError, match="malformed msgpack"):
        decode(pack({1: "x", "schema": SCHEMA_VERSION}))


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("schema", [SCHEMA_VERSION + 1, 0, "1", True, None,
                                    float(SCHEMA_VERSION)],
                         ids=["next", "zero", "str", "true", "nil", "float"])
def test_unknown_schema_version_is_rejected(kind: str, schema: Any) -> None:
    reject(kind, put("schema", value=schema),
           rf"unknown schema version .* \(expected {SCHEMA_VERSION}\)")


@pytest.mark.parametrize("kind", list(MAKERS))
def test_missing_schema_version_is_rejected(kind: str) -> None:
    reject(kind, drop("schema"), "unknown schema version None")


@pytest.mark.parametrize("value", ["bogus", None, 3, "Rollout"])
def test_unknown_message_type_is_rejected(value: Any) -> None:
    reject("rollout", put("type", value=value), "unknown message type")


def test_scored_type_on_a_plain_group_is_rejected_as_missing_fields() -> None:
    reject("rollout", put("type", value="scored"), "missing field")


def test_payload_above_max_message_bytes_is_rejected() -> None:
    data = encode(make_group())
    decode(data, Limits(max_message_bytes=len(data)))  # exactly at the limit is fine
    with pytest.raises(DecodeError, match=f"payload of {len(data)} bytes exceeds {len(data) - 1}"):
        decode(data, Limits(max_message_bytes=len(data) - 1))


def test_expect_type_mismatch_is_rejected() -> None:
    with pytest.raises(DecodeError, match="expected a ScoredGroup message, got RolloutGroup"):
        decode(encode(make_group()), expect=ScoredGroup)
    with pytest.raises(DecodeError, match="expected a RolloutGroup message, got WeightsPublished"):
        decode_entry({b"m": encode(make_weights())}, expect=RolloutGroup)
    assert isinstance(decode(encode(make_scored()), expect=ScoredGroup), ScoredGroup)


def test_decode_entry_without_m_field_is_rejected() -> None:
    with pytest.raises(DecodeError, match=r"no b'm' field .*b'x'"):
        decode_entry({b"x": encode(make_group())})
    with pytest.raises(DecodeError, match="no b'm' field"):
        decode_entry({})


# ---------------------------------------------------------------- rejections: fields


@pytest.mark.parametrize(
    ("kind", "path", "match"),
    [
        ("rollout", ("gid",), "group: missing field 'gid'"),
        ("rollout", ("pidx",), "group 2:17: missing field 'pidx'"),
        ("rollout", ("epoch",), "missing field 'epoch'"),
        ("rollout", ("prompt",), "missing field 'prompt'"),
        ("rollout", ("pids",), "missing field 'pids'"),
        ("rollout", ("gen",), "missing field 'gen'"),
        ("rollout", ("t_admit",), "missing field 't_admit'"),
        ("rollout", ("t_done",), "missing field 't_done'"),
        ("rollout", ("ro",), "missing field 'ro'"),
        ("rollout", ("ro", 1, "ids"), r"group 2:17\.ro\[1\]: missing field 'ids'"),
        ("rollout", ("ro", 0, "lp"), "missing field 'lp'"),
        ("rollout", ("ro", 0, "ver"), "missing field 'ver'"),
        ("rollout", ("ro", 0, "mask"), "missing field 'mask'"),
        ("rollout", ("ro", 0, "fin"), "missing field 'fin'"),
        ("rollout", ("ro", 2, "text"), r"ro\[2\]: missing field 'text'"),
        ("scored", ("rew",), "missing field 'rew'"),
        ("scored", ("adv",), "missing field 'adv'"),
        ("scored", ("parts",), "missing field 'parts'"),
        ("scored", ("scorer",), "missing field 'scorer'"),
        ("scored", ("t_scored",), "missing field 't_scored'"),
        ("weights", ("version",), "weights: missing field 'version'"),
        ("weights", ("step",), "missing field 'step'"),
        ("weights", ("uri",), "missing field 'uri'"),
        ("weights", ("format",), "missing field 'format'"),
        ("weights", ("sha256",), "missing field 'sha256'"),
        ("weights", ("nbytes",), "missing field 'nbytes'"),
        ("weights", ("t",), "missing field 't'"),
        ("finished", ("reason",), "finished: missing field 'reason'"),
    ],
    ids=lambda x: ".".join(map(str, x)) if isinstance(x, tuple) else None,
)
def test_missing_field_is_rejected_and_named(kind: str, path: tuple[Any, ...], match: str) -> None:
    reject(kind, drop(*path), match)


@pytest.mark.parametrize(
    ("kind", "path", "value", "match"),
    [
        ("rollout", ("pidx",), "17", r"pidx: expected int, got str"),
        ("rollout", ("pidx",), True, r"pidx: expected .*, got bool"),
        ("rollout", ("epoch",), False, r"epoch: expected .*, got bool"),
        ("rollout", ("pidx",), 17.0, r"pidx: expected int, got float"),
        ("rollout", ("gid",), 17, r"gid: expected str, got int"),
        ("rollout", ("gen",), b"g", r"gen: expected str, got bytes"),
        ("rollout", ("t_admit",), "now", r"t_admit: expected int\|float, got str"),
        ("rollout", ("t_done",), True, r"t_done: expected .*, got bool"),
        ("rollout", ("ro",), {"0": 1}, r"ro: expected list, got dict"),
        ("rollout", ("ro", 0), [1, 2], r"ro\[0\]: expected a map"),
        ("rollout", ("ro", 0, "ids"), [10, 11, 12, 1], r"ids: expected bytes, got list"),
        ("rollout", ("ro", 0, "fin"), 1, r"fin: expected str, got int"),
        ("rollout", ("prompt",), ["copy"], r"prompt: expected dict, got list"),
        ("rollout", ("prompt", "text"), [1], r"prompt\.text\[0\]: a message needs a str role"),
        ("rollout", ("prompt", "text"), [{"role": "user"}], r"prompt\.text\[0\]: a message"),
        ("rollout", ("prompt", "text"), [{"role": 1, "content": "x"}], r"text\[0\]: a message"),
        ("rollout", ("prompt", "text"), [], r"prompt\.text: empty conversation"),
        ("rollout", ("prompt", "text"), 5, r"prompt\.text: expected a string or a list"),
        ("rollout", ("prompt", "n"), b"raw", r"prompt\.n: bytes is not a prompt value"),
        ("rollout", ("prompt", "n"), {"a": [float("nan")]}, r"prompt\.n\.a\[0\]: not finite"),
        ("rollout", ("prompt", "w"), float("inf"), r"prompt\.w: not finite"),
        ("scored", ("scorer",), 1, r"scorer: expected str, got int"),
        ("scored", ("parts",), [], r"parts: expected dict, got list"),
        ("scored", ("parts", "exact_match"), "1", r"parts: expected str -> bytes"),
        ("weights", ("version",), "7", r"weights\.version: expected int, got str"),
        ("weights", ("version",), True, r"weights\.version: expected .*, got bool"),
        ("weights", ("step",), 1.5, r"weights\.step: expected int, got float"),
        ("weights", ("nbytes",), None, r"weights\.nbytes: expected int, got NoneType"),
        ("weights", ("uri",), b"file:///x", r"weights\.uri: expected str, got bytes"),
        ("weights", ("t",), float("nan"), r"weights\.t: not finite"),
        ("finished", ("reason",), 3, r"finished\.reason: expected str, got int"),
        ("finished", ("t",), "soon", r"finished\.t: expected int\|float, got str"),
        ("finished", ("t",), True, r"finished\.t: expected .*, got bool"),
        ("finished", ("t",), float("nan"), r"finished\.t: not finite"),
        ("finished", ("t",), [1.0], r"finished\.t: expected int\|float, got list"),
    ],
    ids=lambda x: ".".join(map(str, x)) if isinstance(x, tuple) else None,
)
def test_wrong_field_type_is_rejected_and_named(
    kind: str, path: tuple[Any, ...], value: Any, match: str
) -> None:
    reject(kind, put(*path, value=value), match)


@pytest.mark.parametrize(("key", "value"), [("pidx", -1), ("epoch", -3)])
def test_negative_prompt_index_or_epoch_is_rejected(key: str, value: int) -> None:
    reject("rollout", put(key, value=value), "negative prompt index or epoch")


def test_run_finished_without_t_decodes_with_t_zero() -> None:
    d = raw(make_finished())
    del d["t"]
    assert_same(decode(pack(d)), RunFinished(reason="max_steps", t=0.0))


def test_non_finite_timestamp_is_rejected() -> None:
    reject("rollout", put("t_admit", value=float("inf")), r"t_admit: not finite")
    reject("scored", put("t_scored", value=float("nan")), r"t_scored: not finite")


# ---------------------------------------------------------------- rejections: arrays


@pytest.mark.parametrize("key", ["ids", "lp", "ver"])
def test_array_bytes_not_a_multiple_of_itemsize_is_rejected(key: str) -> None:
    def f(d: dict[str, Any]) -> None:
        d["ro"][0][key] = d["ro"][0][key][:-1]

    reject("rollout", f, rf"ro\[0\]\.{key}: 15 bytes is not a multiple of 4")


def test_prompt_ids_bytes_not_a_multiple_of_itemsize_is_rejected() -> None:
    reject("rollout", put("pids", value=b"\x05\x00\x00\x00\x06"),
           r"pids: 5 bytes is not a multiple of 4")


def test_reward_bytes_not_a_multiple_of_itemsize_is_rejected() -> None:
    reject("scored", put("rew", value=f32(1, 2, 3)[:-2]), r"rew: 10 bytes is not a multiple")


@pytest.mark.parametrize("key", ["ids", "lp", "ver", "mask"])
def test_ragged_rollout_arrays_are_rejected(key: str) -> None:
    dtype = {"ids": "<i4", "lp": "<f4", "ver": "<i4", "mask": "u1"}[key]
    err = reject("rollout", edit_array("ro", 1, key, dtype=dtype, fn=lambda a: a[:-1]),
                 r"ro\[1\]: length mismatch")
    lens = {k: 4 if k == key else 5 for k in ("ids", "lp", "ver", "mask")}
    assert "ids={ids} lp={lp} ver={ver} mask={mask}".format(**lens) in str(err)


def test_array_longer_than_max_tokens_is_rejected() -> None:
    # one 4-token rollout and 4 prompt ids fit a limit of 4; a 5-token completion does not
    g = make_group()
    g.rollouts = g.rollouts[:1]  # 4 tokens
    g.prompt_ids = g.prompt_ids[:4]
    decode(encode(g), Limits(max_tokens=4))
    g.rollouts[0] = _rollout([10, 11, 12, 13, 1])
    with pytest.raises(DecodeError, match=r"ro\[0\]\.ids: 5 elements exceeds limit 4"):
        decode(encode(g), Limits(max_tokens=4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")],
                         ids=["nan", "inf", "-inf"])
def test_non_finite_logprob_is_rejected(bad: float) -> None:
    reject("rollout", edit_array("ro", 0, "lp", dtype="<f4", fn=set_at(2, bad)),
           r"ro\[0\]\.lp: contains NaN or inf")


@pytest.mark.parametrize("key", ["rew", "adv"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_reward_or_advantage_is_rejected(key: str, bad: float) -> None:
    reject("scored", edit_array(key, dtype="<f4", fn=set_at(1, bad)),
           rf"{key}: contains NaN or inf")


def test_positive_logprob_is_rejected() -> None:
    reject("rollout", edit_array("ro", 0, "lp", dtype="<f4", fn=set_at(0, 0.5)),
           r"ro\[0\]\.lp: a log-probability above 0")


def test_logprob_of_exactly_zero_is_accepted() -> None:
    g = make_group()
    g.rollouts[0].logprobs[:] = 0.0
    assert_same(decode(encode(g)), g)


def test_mask_value_two_is_rejected() -> None:
    reject("rollout", edit_array("ro", 0, "mask", dtype="u1", fn=set_at(3, 2)),
           r"ro\[0\]\.mask: values must be 0 or 1")


def test_negative_version_is_rejected() -> None:
    reject("rollout", edit_array("ro", 2, "ver", dtype="<i4", fn=set_at(0, -1)),
           r"ro\[2\]\.ver: negative version")


@pytest.mark.parametrize("key", ["ids", "pids"])
@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -1], ids=["vocab", "far", "negative"])
def test_token_id_outside_vocab_is_rejected(key: str, bad: int) -> None:
    path = ("ro", 1, key) if key == "ids" else (key,)
    reject("rollout", edit_array(*path, dtype="<i4", fn=set_at(0, bad)),
           rf"{key}: token id outside \[0, {VOCAB}\)", limits=Limits(vocab_size=VOCAB))


def test_token_id_vocab_minus_one_is_accepted() -> None:
    g = make_group()
    g.rollouts[0].completion_ids[0] = VOCAB - 1
    decode(encode(g), Limits(vocab_size=VOCAB))
    with pytest.raises(DecodeError, match="token id outside"):
        decode(encode(g), Limits(vocab_size=VOCAB - 1))


# ---------------------------------------------------------------- rejections: structure


def test_empty_rollouts_are_rejected() -> None:
    reject("rollout", put("ro", value=[]), "group 2:17: no rollouts")


def test_more_rollouts_than_max_rollouts_is_rejected() -> None:
    data = encode(make_group())
    decode(data, Limits(max_rollouts=3))
    with pytest.raises(DecodeError, match="3 rollouts exceeds limit 2"):
        decode(data, Limits(max_rollouts=2))


@pytest.mark.parametrize("key", ["rew", "adv"])
@pytest.mark.parametrize("n", [2, 4])
def test_scored_per_rollout_length_mismatch_is_rejected(key: str, n: int) -> None:
    reject("scored", put(key, value=f32(*([0.0] * n))), rf"{key}: {n} values for 3 rollouts")


@pytest.mark.parametrize("n", [2, 4])
def test_scored_reward_part_length_mismatch_is_rejected(n: int) -> None:
    reject("scored", put("parts", "exact_match", value=f32(*([0.0] * n))),
           rf"parts\.exact_match: {4 * n} bytes for 3 rollouts")


def test_scored_reward_part_may_be_nan_but_rewards_may_not() -> None:
    d = raw(make_scored())
    d["parts"]["copy_reward"] = f32(np.nan, np.nan, np.nan)
    sg = decode(pack(d))
    assert isinstance(sg, ScoredGroup) and np.isnan(sg.reward_parts["copy_reward"]).all()


@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_scored_reward_part_may_not_be_infinite(bad: float) -> None:
    reject("scored", put("parts", "copy_reward", value=f32(1.0, bad, 0.0)),
           r"parts\.copy_reward: contains inf")


@pytest.mark.parametrize("kind", ["rollout", "scored"])
def test_empty_prompt_is_rejected(kind: str) -> None:
    """The trainer predicts a completion's first token from the prompt's last one."""
    reject(kind, put("pids", value=b""), r"group 2:17\.pids: empty prompt")


@pytest.mark.parametrize(
    "sha",
    ["", "abc", SHA[:-1], SHA + "0", SHA.upper(), "g" * 64, SHA[:-1] + " "],
    ids=["empty", "short", "63", "65", "upper", "non-hex", "space"],
)
def test_bad_sha256_is_rejected(sha: str) -> None:
    reject("weights", put("sha256", value=sha), "weights.sha256: not a hex sha256")


@pytest.mark.parametrize("fmt", ["pickle", "", "SAFETENSORS", "pt"])
def test_unknown_weight_format_is_rejected(fmt: str) -> None:
    reject("weights", put("format", value=fmt), f"weights.format: unknown format {fmt!r}")


@pytest.mark.parametrize("fmt", ["safetensors", "lora", "nccl"])
def test_known_weight_formats_are_accepted(fmt: str) -> None:
    w = dataclasses.replace(make_weights(), format=fmt)
    assert_same(decode(encode(w)), w)


def test_negative_weight_version_is_rejected() -> None:
    reject("weights", put("version", value=-1), "weights.version: negative")


# ---------------------------------------------------------------- peek_group_id


@pytest.mark.parametrize(
    "fields",
    [None, {}, {b"m": b""}, {b"m": b"\xc1\xc1"}, {b"m": pack([1, 2])}, {b"x": encode(make_group())},
     {b"m": "not bytes"}],
    ids=["none", "empty", "empty-m", "garbage", "list", "no-m", "str-m"],
)
def test_peek_group_id_of_garbage_is_none(fields: Any) -> None:
    assert peek_group_id(fields) is None


def test_peek_group_id_of_map_without_gid_is_none() -> None:
    assert peek_group_id({b"m": encode(make_weights())}) is None
    assert peek_group_id({b"m": encode(make_finished())}) is None


def test_peek_group_id_of_non_str_gid_is_none() -> None:
    d = raw(make_group())
    d["gid"] = 17
    assert peek_group_id({b"m": pack(d)}) is None


def test_peek_group_id_of_valid_and_of_invalid_groups() -> None:
    assert peek_group_id({b"m": encode(make_group())}) == "2:17"
    assert peek_group_id({b"m": encode(make_scored())}) == "2:17"
    d = raw(make_scored())
    d["schema"] = 99  # undecodable, but still an admitted group that must be retired
    assert peek_group_id({b"m": pack(d)}) == "2:17"


# ---------------------------------------------------------------- fuzzing

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=24)
    | st.lists(st.floats(width=32), max_size=6).map(lambda xs: f32(*xs))
    | st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6).map(lambda xs: i32(*xs))
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6,
)


def _check_decodes_or_rejects(data: bytes, limits: Limits) -> None:
    try:
        msg = decode(data, limits)
    except DecodeError as e:
        assert str(e)  # a reason for the dead-letter stream
        return
    assert isinstance(msg, RolloutGroup | ScoredGroup | WeightsPublished | RunFinished)
    # anything accepted is a valid message: it re-encodes and decodes to itself
    assert_same(decode(encode(msg), limits), msg)


@FUZZ
@given(data=st.binary(max_size=600))
def test_random_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    _check_decodes_or_rejects(data, Limits(vocab_size=VOCAB))


@FUZZ
@given(kind=st.sampled_from(list(MAKERS)), data=st.data())
def test_mutated_valid_messages_decode_or_raise_decode_error(kind: str, data: st.DataObject
                                                            ) -> None:
    limits = Limits(vocab_size=VOCAB, max_rollouts=4, max_tokens=64)
    d = raw(MAKERS[kind]())
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = key_paths(d)
        op = data.draw(st.sampled_from(["replace", "delete", "add"]), label="op")
        if op == "add" or not paths:
            parent = data.draw(st.sampled_from([()] + [p for p in paths if isinstance(
                value_at(d, p), dict)]), label="parent")
            value_at(d, parent)[data.draw(st.text(max_size=6), label="key")] = data.draw(VALUES)
            continue
        path = data.draw(st.sampled_from(paths), label="path")
        parent = value_at(d, path[:-1])
        if op == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(VALUES, label="value")
    _check_decodes_or_rejects(pack(d), limits)


@FUZZ
@given(kind=st.sampled_from(list(MAKERS)), data=st.data())
def test_byte_mutated_encodings_decode_or_raise_decode_error(kind: str, data: st.DataObject
                                                            ) -> None:
    buf = bytearray(encode(MAKERS[kind]()))
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        i = data.draw(st.integers(0, max(len(buf) - 1, 0)), label="at")
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if not buf:
            break
        if op == "flip":
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            buf[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[i]
        else:
            del buf[i:]
    _check_decodes_or_rejects(bytes(buf), Limits(vocab_size=VOCAB))
