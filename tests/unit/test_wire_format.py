"""docs/wire-format.md is the codec's contract: a fresh interpreter that imports only
msgpack and numpy decodes every field of a real `scored` entry from the doc's table, and
the entry carries exactly the keys the table marks as on `scored` (``S``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.bus.codec import encode
from pipeline.bus.schema import ScoredGroup
from tests.helpers import ROOT, make_group

DECODER = r"""
import json, sys
import msgpack, numpy as np
table = json.loads(sys.argv[1])      # key -> dtype ("" for non-arrays), from the doc
m = msgpack.unpackb(open(sys.argv[2], "rb").read(), raw=False)

def conv(key, v):
    dt = table.get(key)
    assert dt is not None, f"key {key!r} is not in docs/wire-format.md"
    if dt and isinstance(v, list):  # an array of arrays (one per completion)
        return [np.frombuffer(x, dtype=np.dtype(dt)).tolist() for x in v]
    return np.frombuffer(v, dtype=np.dtype(dt)).tolist() if dt else v

out = {}
for k, v in m.items():
    if k == "ro":
        out[k] = [{rk: conv("ro[]." + rk, rv) for rk, rv in r.items()} for r in v]
    elif k == "parts":
        out[k] = {fk: conv("parts.<fn>", fv) for fk, fv in v.items()}
    else:
        out[k] = conv(k, v)
assert not any(n.split(".")[0] in ("pipeline", "workers", "trainer") for n in sys.modules)
print(json.dumps(out))
"""


def doc_rows() -> dict[str, tuple[str, str]]:
    """key -> (dtype, on) of every row of docs/wire-format.md's table."""
    rows = {}
    for line in (ROOT / "docs" / "wire-format.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[2].strip("`"), cells[3])
    return rows


def doc_table(on: str = "S") -> dict[str, str]:
    """key -> dtype of the rows whose "on" column names ``on`` (or ``all``)."""
    return {k: dt for k, (dt, where) in doc_rows().items()
            if on in where.split() or where == "all"}


def test_a_scored_entry_decodes_with_msgpack_and_numpy_alone(tmp_path: Path) -> None:
    g = make_group(texts=("123", "12"))
    g.rollouts[1].finish_reason = "length"
    g.rollouts[0].candidate_ids = np.array([5, 6, 7, 1], dtype=np.int32)
    g.rollouts[0].candidate_counts = np.array([1, 1, 1, 1], dtype=np.int32)
    g.rollouts[1].top_ids = np.array([[5, 6], [7, -1], [1, 2]], dtype=np.int32)
    g.rollouts[1].top_logprobs = np.array([[-0.25, -2.0], [-0.5, 0.0], [-1.0, -1.5]],
                                          dtype=np.float32)
    sg = ScoredGroup(group=g.for_training(), rewards=np.array([1.0, 0.5], np.float32),
                     reward_parts={"copy_reward": np.array([1.0, 0.5], np.float32),
                                   "judge": np.array([np.nan, 0.25], np.float32)},
                     advantages=np.array([0.7, -0.7], np.float32), scorer="scorer/s",
                     t_scored=time.time(),
                     token_advantages=[np.array([0.5, 1.0, 0.25, 0.0], np.float32),
                                       np.array([-1.0, 0.5, 0.0], np.float32)])
    (tmp_path / "m.bin").write_bytes(encode(sg))
    p = subprocess.run([sys.executable, "-I", "-c", DECODER, json.dumps(doc_table()),
                        str(tmp_path / "m.bin")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout.replace("NaN", "null"))
    assert m["type"] == "scored" and m["schema"] == 3 and m["gid"] == g.group_id
    assert m["pids"] == g.prompt_ids.tolist()
    for got, r in zip(m["ro"], g.rollouts, strict=True):
        assert got["ids"] == r.completion_ids.tolist() and got["mask"] == r.mask.tolist()
        assert got["ver"] == r.versions.tolist() and np.allclose(got["lp"], r.logprobs)
    assert m["clip"] == [int(r.finish_reason == "length") for r in g.rollouts]
    # exactly the table's S keys: nothing the trainer does not read (no prompt, no text)
    on_scored = doc_table("S")
    assert set(m) == {k for k in on_scored if "." not in k}
    assert {f"ro[].{k}" for r in m["ro"] for k in r} == {k for k in on_scored
                                                         if k.startswith("ro[].")}
    assert m["ro"][0]["cand"] == [5, 6, 7, 1] and m["ro"][0]["ncand"] == [1, 1, 1, 1]
    assert m["ro"][1]["topk"] == 2 and m["ro"][1]["top"] == [5, 6, 7, -1, 1, 2]
    assert m["ro"][1]["toplp"] == [-0.25, -2.0, -0.5, 0.0, -1.0, -1.5]  # exact in float16
    assert np.allclose(m["rew"], [1.0, 0.5]) and np.allclose(m["adv"], [0.7, -0.7])
    assert m["tadv"] == [[0.5, 1.0, 0.25, 0.0], [-1.0, 0.5, 0.0]]
    assert m["parts"]["copy_reward"] == [1.0, 0.5] and m["parts"]["judge"][0] is None
    assert m["scorer"] == "scorer/s" and m["t_scored"] == sg.t_scored
