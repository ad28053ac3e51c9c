"""The Lua scripts of the delivery protocol: each is one atomic step on the bus; and
`pipelined`, which sends a batch of one script's calls in one round trip.

Used only by `pipeline.bus.client.Bus`. All keys a script touches are passed in KEYS (they share
the run's hash tag, so each script runs on one Redis Cluster slot), and every command a
script calls is checked against the caller's ACL user like a direct call.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import RedisCluster
from redis.exceptions import NoScriptError

OP_TTL_S = 600
"""How long a mutating script remembers its result under its op key. A call retried after
a lost reply (within this time) gets the first call's result instead of acting twice, so
each role's ledger records what really happened. After an outage longer than this the
gates below still hold (XACK and lease checks), only the retried call's answer is lost."""


def _idempotent(body: str) -> str:
    """Wrap a script body so its result is stored under the op key (the last KEYS entry)
    and a repeated call with the same op key returns that result without acting again.
    The body must return a table, number, string or false (never nil)."""
    return f"""
local op = KEYS[#KEYS]
local done = redis.call('GET', op)
if done then return cjson.decode(done) end
local function body()
{body}
end
local r = body()
redis.call('SET', op, cjson.encode(r), 'EX', {OP_TTL_S})
return r
"""


_NOW_MS = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

RETIRE = _idempotent("""
-- KEYS: stream, state, op; ARGV: group, reason, id... Returns the ids this call retired.
local done = {}
for i = 3, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then done[#done + 1] = ARGV[i] end
end
if #done > 0 then
  redis.call('HINCRBY', KEYS[2], 'retired', #done)
  redis.call('HINCRBY', KEYS[2], 'retired:' .. ARGV[2], #done)
end
return done
""")

HANDOFF = _idempotent("""
-- KEYS: src stream, dst stream, op; ARGV: group, id, field, payload
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  return redis.call('XADD', KEYS[2], '*', ARGV[3], ARGV[4])
end
return false
""")

DEAD_LETTER = _idempotent("""
-- KEYS: src stream, state, dlq, op; ARGV: group, id, retire(0|1), field/value pairs...
-- The pairs are the bounded summary of `pipeline.bus.dlq.record` (a few dozen values:
-- `unpack` fails past ~8,000). retire 1: a decoded group, retired `dead`; 0: an entry
-- that did not decode, counted `undecodable` and never as a retirement.
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  local fields = {}
  for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('XADD', KEYS[3], '*', unpack(fields))
  if ARGV[3] == '1' then
    redis.call('HINCRBY', KEYS[2], 'retired', 1)
    redis.call('HINCRBY', KEYS[2], 'retired:dead', 1)
  else
    redis.call('HINCRBY', KEYS[2], 'undecodable', 1)
  end
  return 1
end
return 0
""")

ADMIT = """
-- KEYS: state, leases, op; ARGV: window, owner, lease_ms, count. Admits up to `count`
-- cursors while fewer than `window` groups are in flight (`count` 0 admits none), each
-- leased to `owner` until now + lease_ms. Returns {state.version, cursor...}: the weight
-- version announced when these groups were admitted (0 before any), which the generator
-- applies before decoding them, in the same reply (no second read that could race).
-- Idempotent per op like `_idempotent`, but a call that admitted nothing stores nothing
-- (a generator polls a closed gate often; repeating such a call acts at most once).
local done = redis.call('GET', KEYS[3])
if done then return cjson.decode(done) end
local cursor = tonumber(redis.call('HGET', KEYS[1], 'cursor') or '0')
local retired = tonumber(redis.call('HGET', KEYS[1], 'retired') or '0')
local out = {tonumber(redis.call('HGET', KEYS[1], 'version') or '0')}
local n = math.min(tonumber(ARGV[4]), tonumber(ARGV[1]) - (cursor - retired))
if n > 0 then
""" + _NOW_MS + """
  local lease = ARGV[2] .. '|' .. (now_ms + tonumber(ARGV[3]))
  for i = 0, n - 1 do
    redis.call('HSET', KEYS[2], cursor + i, lease)
    out[#out + 1] = cursor + i
  end
  redis.call('HSET', KEYS[1], 'cursor', cursor + n)
  redis.call('HINCRBY', KEYS[1], 'generating', n)
  redis.call('SET', KEYS[3], cjson.encode(out), 'EX', """ + str(OP_TTL_S) + """)
end
return out
"""

# A lease value is "<owner>|<deadline_ms>"; this Lua test is "owned by ARGV[k]".
_OWNS = "(v and string.sub(v, 1, #{o} + 1) == {o} .. '|')"

EMIT = _idempotent("""
-- KEYS: rollouts, state, leases, op; ARGV: cursor, owner, field, payload. Appends the group
-- only while `owner` holds the cursor's lease, and in the same step releases the lease and
-- counts the group out of `generating`: one append per admitted group, ever.
local v = redis.call('HGET', KEYS[3], ARGV[1])
if not """ + _OWNS.format(o="ARGV[2]") + """ then return false end
redis.call('HDEL', KEYS[3], ARGV[1])
local id = redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[4])
redis.call('HINCRBY', KEYS[2], 'generating', -1)
return id
""")

ABANDON = _idempotent("""
-- KEYS: state, dlq, leases, op; ARGV: cursor, owner, field/value pairs. An admitted group
-- that could not be generated retires `dead` with its dlq record, if `owner` holds it.
local v = redis.call('HGET', KEYS[3], ARGV[1])
if not """ + _OWNS.format(o="ARGV[2]") + """ then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('HINCRBY', KEYS[1], 'generating', -1)
redis.call('HINCRBY', KEYS[1], 'retired', 1)
redis.call('HINCRBY', KEYS[1], 'retired:dead', 1)
return 1
""")

SKIP = _idempotent("""
-- KEYS: state, leases, skipped, op; ARGV: cursor, owner, epoch. An admitted group its
-- generator skips (the prompt filter said no) retires `filtered`, if `owner` holds its
-- lease, and counts in `skipped[epoch]`: once per cursor, like the retirement.
local v = redis.call('HGET', KEYS[2], ARGV[1])
if not """ + _OWNS.format(o="ARGV[2]") + """ then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[1], 'generating', -1)
redis.call('HINCRBY', KEYS[1], 'retired', 1)
redis.call('HINCRBY', KEYS[1], 'retired:filtered', 1)
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
return 1
""")

RENEW = """
-- KEYS: leases; ARGV: owner, lease_ms, cursor... Extends the leases `owner` still holds;
-- returns the cursors another owner holds now (taken over after it missed renewals). A
-- cursor with no lease at all was released — appended or abandoned, most often by the
-- caller itself between reading its lease set and this call — and is not reported.
""" + _NOW_MS + """
local lost = {}
for i = 3, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if """ + _OWNS.format(o="ARGV[1]") + """ then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[1] .. '|' .. (now_ms + tonumber(ARGV[2])))
  elseif v then
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

TAKEOVER = """
-- KEYS: leases; ARGV: owner, lease_ms, max. Leases whose deadline passed (their owner
-- died or lost Redis for longer than a lease) move to `owner`; returns their cursors.
-- The hash holds at most `window` fields (one per admitted, unappended group).
""" + _NOW_MS + """
local got = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if #got >= tonumber(ARGV[3]) then break end
  local deadline = tonumber(string.match(all[i + 1], '|(%d+)$') or '0')
  if deadline < now_ms then
    redis.call('HSET', KEYS[1], all[i], ARGV[1] .. '|' .. (now_ms + tonumber(ARGV[2])))
    got[#got + 1] = all[i]
  end
end
return got
"""

TRIM_ACKED = """
-- KEYS: stream; ARGV: keep_ms. Deletes the entries EVERY consumer group of the stream has
-- acknowledged (below the group's oldest pending entry, and below its last-delivered id)
-- that are also older than keep_ms by their id's time (a short acknowledged tail stays
-- for `sluice tail`); returns how many. Never removes a pending or undelivered entry, and
-- nothing from a stream without groups. By id only: XINFO GROUPS and the XPENDING
-- summary answer ids and counts, and XTRIM MINID drops whole entries without reading
-- them, so no payload is ever copied into Lua (a stream of 1 MB groups costs what a
-- stream of small ones does on the single Redis thread).
local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
if groups.err then
  if string.find(groups.err, 'no such key', 1, true) then return 0 end
  return redis.error_reply(groups.err)
end
if #groups == 0 then return 0 end
local function before(a, b)  -- stream id a < stream id b
  local a1, a2 = string.match(a, '^(%d+)-(%d+)$')
  local b1, b2 = string.match(b, '^(%d+)-(%d+)$')
  a1, a2, b1, b2 = tonumber(a1), tonumber(a2), tonumber(b1), tonumber(b2)
  return a1 < b1 or (a1 == b1 and a2 < b2)
end
""" + _NOW_MS + """
local minid = nil  -- keep_ms = 0: no time bound, only the groups'
if tonumber(ARGV[1]) > 0 then
  minid = string.format('%d-0', math.max(0, now_ms - tonumber(ARGV[1])))
end
for _, g in ipairs(groups) do
  local name, bound, pending = nil, '0-0', 0
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1]
    elseif g[i] == 'last-delivered-id' then bound = g[i + 1]
    elseif g[i] == 'pending' then pending = tonumber(g[i + 1]) end
  end
  if pending > 0 then bound = redis.call('XPENDING', KEYS[1], name)[2] end
  if minid == nil or before(bound, minid) then minid = bound end
end
if minid == '0-0' then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', minid)
"""

RETIRE_CONSUMER = """
-- KEYS: stream; ARGV: group, consumer. Removes the consumer from the group only if it
-- has no pending entries (checked and done atomically, so none can be claimed to it
-- in between); returns 1 if removed.
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

PRUNE_CONSUMERS = """
-- KEYS: stream; ARGV: group, idle_ms. Removes consumers with nothing pending that have
-- been idle longer than idle_ms (crashed processes whose work was reclaimed).
local n = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local name, pending, idle = nil, 0, 0
  for i = 1, #c, 2 do
    if c[i] == 'name' then name = c[i + 1]
    elseif c[i] == 'pending' then pending = tonumber(c[i + 1])
    elseif c[i] == 'idle' then idle = tonumber(c[i + 1]) end
  end
  if pending == 0 and idle > tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
    n = n + 1
  end
end
return n
"""

SET_VERSION = """
-- KEYS: state; ARGV: version. state.version only moves forward.
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
if tonumber(ARGV[1]) > v then
  redis.call('HSET', KEYS[1], 'version', ARGV[1])
  return 1
end
return 0
"""

FENCE_FIELD = "fence"
"""The ``state`` field holding the trainer lock's generation (the fencing token of the
newest holder): in the global ``state`` (incremented by `TRAINER_LOCK`) and copied into each
lane's ``state`` by the holder on acquisition (`RAISE_FENCE`), because a lane script on a
Redis Cluster can only read keys of its own slot."""


def fenced(script: str) -> str:
    """``script`` guarded by the trainer's fencing token: the caller prepends one key (a
    ``state`` hash in the script's slot) to KEYS and one argument (its token, or ``""``
    for a caller that is not the trainer) to ARGV; both are removed before ``script``
    runs, so its own KEYS/ARGV numbering is unchanged. A token lower than that hash's
    ``fence`` is refused with the error ``FENCED <fence>`` before anything (the op key
    too) is read or written: a trainer that lost its lock to a newer holder acts on
    nothing, and a refused call stores no result, so the audit reads it as never run."""
    return """
local fence_state = table.remove(KEYS, 1)
local token = table.remove(ARGV, 1)
if token ~= '' then
  local fence = tonumber(redis.call('HGET', fence_state, '""" + FENCE_FIELD + """') or '0')
  if tonumber(token) < fence then return redis.error_reply('FENCED ' .. fence) end
end
""" + script


ACK = """
-- KEYS: stream; ARGV: group, id... XACK as a script, so that it can be `fenced`.
return redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
"""

ANNOUNCE = """
-- KEYS: control, state; ARGV: maxlen, version, field, payload. Appends the announcement
-- and moves state.version forward in one step (`fenced`: a trainer that lost its lock
-- announces nothing, not even an entry without its version). Returns the entry id.
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', ARGV[3], ARGV[4])
local v = tonumber(redis.call('HGET', KEYS[2], 'version') or '-1')
if tonumber(ARGV[2]) > v then redis.call('HSET', KEYS[2], 'version', ARGV[2]) end
return id
"""

TRAINER_LOCK = """
-- KEYS: lock, state; ARGV: holder, ttl_ms, token (the generation the caller holds, ''
-- to acquire). Returns {holder after the call ('' if none), generation, 1 if this call
-- SET the lock else 0}. The generation is state.fence: the newest holder's fencing
-- token; every trainer write (`fenced`) is refused once a newer one exists.
-- Acquire (token ''): a lock that is free or already the caller's (a job restarted
-- under the same id) is taken with a NEW generation (HINCRBY), so that no process of
-- an earlier holder, even one with the same id, can write any more.
-- Refresh (token set): a newer generation exists -> the caller lost; nothing is
-- touched (a lost holder never takes the lock or a generation back, which would fence
-- out the live holder). Else the caller's own lock is extended, or, expired (a stall or
-- an outage longer than the TTL) and not taken since, set again with the SAME
-- generation. A fence below the token (Redis lost its data) is moved back up to it:
-- the fence only moves forward.
local fence = tonumber(redis.call('HGET', KEYS[2], '""" + FENCE_FIELD + """') or '0')
local cur = redis.call('GET', KEYS[1])
if ARGV[3] == '' then
  if cur and cur ~= ARGV[1] then return {cur, fence, 0} end
  fence = redis.call('HINCRBY', KEYS[2], '""" + FENCE_FIELD + """', 1)
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {ARGV[1], fence, 1}
end
local token = tonumber(ARGV[3])
if token < fence or (cur and cur ~= ARGV[1]) then return {cur or '', fence, 0} end
if token > fence then redis.call('HSET', KEYS[2], '""" + FENCE_FIELD + """', ARGV[3]) end
if cur then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {ARGV[1], token, 0}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {ARGV[1], token, 1}
"""

RAISE_FENCE = """
-- KEYS: state; ARGV: generation. A lane's copy of the fence only moves forward.
local f = tonumber(redis.call('HGET', KEYS[1], '""" + FENCE_FIELD + """') or '0')
if tonumber(ARGV[1]) > f then redis.call('HSET', KEYS[1], '""" + FENCE_FIELD + """', ARGV[1]) end
return math.max(f, tonumber(ARGV[1]))
"""

RELEASE_LOCK = """
-- KEYS: lock; ARGV: holder. Deletes the lock only if `holder` has it (compare and
-- delete in one step: a GET then DEL could delete the lock another job took between).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


async def pipelined(client: Any, script: Any, calls: list[tuple[list[str], list[Any]]]
                    ) -> list[Any]:
    """``script`` once per ``(keys, args)``, all in one non-transactional pipeline:
    one round trip for a batch instead of one per call. Each call is still one atomic,
    idempotent script (its op key), so the batch needs no MULTI, and a batch retried
    after a lost reply acts once per call. A NOSCRIPT reply (Redis restarted and lost
    its script cache) loads the script (SCRIPT LOAD) and resends the calls it
    refused; any other error reply is raised after the whole batch ran."""
    if isinstance(client, RedisCluster):  # cluster pipelines refuse EVALSHA: send the
        # calls concurrently instead (one round trip in time; each to its lane's master)
        return list(await asyncio.gather(*(script(keys=k, args=a) for k, a in calls)))
    out: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for _attempt in range(3):
        async with client.pipeline(transaction=False) as pipe:
            for i in todo:
                keys, args = calls[i]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        refused = []
        for i, reply in zip(todo, replies, strict=True):
            if isinstance(reply, NoScriptError):
                refused.append(i)
            elif isinstance(reply, Exception):
                raise reply
            else:
                out[i] = reply
        if not refused:
            return out
        script.sha = await client.script_load(script.script)
        todo = refused
    raise NoScriptError(f"script {script.sha} still unknown after SCRIPT LOAD")
