"""The stream log's Lua scripts (atomic in Redis; issue 12 items 2, 3; SPEC P1, P2, L2, L5, L6).

An **entry** of ``log:{rid}`` holds a run of consecutive events ``a..b`` of one request: entry
id ``0-(b+1)`` (ids must be above ``0-0``; the id names the run's *last* seq, so ``XRANGE``
from ``0-(s+2)`` and ``XREAD`` after ``0-(s+1)`` return exactly the entries holding a seq above
``s``), field ``a`` = its first seq, field ``v2`` = the events in codec v2, concatenated
(:func:`coda.durable.codec.pack_event`), field ``m`` = the run's merge key (a decimal integer,
strictly increasing over the runs one writer appends: the order in which the n > 1 merge reads
them, :func:`coda.reader.merge_order`; P3). Entries written before v2 have one event each in
field ``e`` (JSON), entries written before merge keys have no ``m``; readers take all of them.

``APPEND`` takes every run of one flush (any number of requests) in one call. Per run, against
the request's meta hash (``last`` = last seq written, ``term``, ``fence``), in order:

1. the writer's fencing token is not the request's → ``-1`` (Fenced), nothing written;
2. a terminal exists → ``0``, nothing written (nothing after the terminal, P2);
3. ``a > last + 1`` → ``-2`` (a gap: refused whole);
4. ``b <= last`` → ``1``, nothing written (a retried run: every seq a duplicate);
5. otherwise the events ``last+1..b`` are written as one entry — when ``a <= last`` (a retried
   run that partly overlaps) the duplicated prefix is cut off at the byte offset of event
   ``last+1 - a`` (argument ``offsets``: little-endian uint32 offsets of events 1..n-1), so
   each seq is stored exactly once — and ``last`` becomes ``b``; a run ending in the terminal
   also sets ``term``, leaves ``open`` and starts the retention TTLs (exactly once: step 2).

It returns ``"code:last_before,..."`` per run (one bulk string: cheaper to parse than an array).
"""

from __future__ import annotations

# The terminal's bookkeeping, shared by both scripts: mark it, leave the owner's live set, and
# start the retention clock on the stream, its meta hash and (if any) its API record — the one
# named, else the one the meta hash links (``rec``, set by PUT_RECORD, which may run before or
# after the terminal: scripts are atomic, so one of the two starts the record's clock) — once
# every request of the record has its terminal (``record_ended``: a meta hash without ``term``
# is a request still running; an expired one ended long ago).
_RECORD_ENDED = """
local function record_ended(record, prefix)
  local desc = cjson.decode(redis.call('GET', record))
  for _, rid in ipairs(desc['handles'] or {}) do
    local meta = prefix .. 'meta:{' .. rid .. '}'
    if redis.call('EXISTS', meta) == 1 and redis.call('HEXISTS', meta, 'term') == 0 then
      return false
    end
  end
  return true
end
"""

_END_REQUEST = _RECORD_ENDED + """
local function end_request(stream, meta, live, record, term, owner, ms)
  redis.call('HSET', meta, 'last', term, 'term', term)
  redis.call('SREM', live, owner)
  redis.call('PEXPIRE', stream, ms)
  redis.call('PEXPIRE', meta, ms)
  local prefix = string.sub(live, 1, #live - 4)
  if record == '' then
    local linked = redis.call('HGET', meta, 'rec')
    if linked and linked ~= '' then
      record = prefix .. 'rec:{' .. linked .. '}'
    end
  end
  if record ~= '' and redis.call('EXISTS', record) == 1 and record_ended(record, prefix) then
    redis.call('PEXPIRE', record, ms)
  end
end
"""

# KEYS: open, then per run: log, meta, record ('' if none)
# ARGV: retention_ms, fence, then per run: request_id, first, n, is_terminal, blob, offsets,
# merge key (a string: never read as a Lua number, whose doubles would round it)
APPEND = _END_REQUEST + """
local ms, fence_arg = ARGV[1], ARGV[2]
local out = {}
for r = 0, (#KEYS - 1) / 3 - 1 do
  local stream, meta, record = KEYS[2 + 3 * r], KEYS[3 + 3 * r], KEYS[4 + 3 * r]
  local p = 3 + 7 * r
  local m = redis.call('HMGET', meta, 'fence', 'term', 'last')
  local last = tonumber(m[3] or '-1')
  local code = 1
  if m[1] and fence_arg ~= '' and m[1] ~= fence_arg then
    code = -1
  elseif m[2] then
    code = 0
  else
    local first, n = tonumber(ARGV[p + 1]), tonumber(ARGV[p + 2])
    local b = first + n - 1
    if first > last + 1 then
      code = -2
    elseif b > last then
      local body, a = ARGV[p + 4], first
      if first <= last then
        local skip = last + 1 - first
        body = string.sub(body, struct.unpack('<I4', ARGV[p + 5], 4 * (skip - 1) + 1) + 1)
        a = last + 1
      end
      redis.call('XADD', stream, '0-' .. (b + 1), 'a', a, 'v2', body, 'm', ARGV[p + 6])
      if ARGV[p + 3] == '1' then
        end_request(stream, meta, KEYS[1], record, b, ARGV[p], ms)
      else
        redis.call('HSET', meta, 'last', b)
      end
    end
  end
  out[#out + 1] = code .. ':' .. last
end
return table.concat(out, ',')
"""

# KEYS: log, meta, open, the owner's lease, record ('' if none)
# ARGV: the terminal's seq, the run ending in it in v2 (the terminal; with the start event
# first when the log had none), the run's first seq, retention_ms, new fence, request_id, and
# what the terminal was chosen from: the owner's fencing token and ``detach`` ('1' or '') as
# the reaper read them, then the run's merge key. Either changed since (a replica claimed the
# request, the route marked it ``continue``) → -3, nothing written: the next round decides
# again on what is there now.
REAP = _END_REQUEST + """
local meta = KEYS[2]
if redis.call('HEXISTS', meta, 'term') == 1 then return 0 end
if redis.call('EXISTS', KEYS[4]) == 1 then return -1 end
if (redis.call('HGET', meta, 'fence') or '') ~= ARGV[7] then return -3 end
if (redis.call('HGET', meta, 'detach') or '') ~= ARGV[8] then return -3 end
local last = tonumber(redis.call('HGET', meta, 'last') or '-1')
local a, b = tonumber(ARGV[3]), tonumber(ARGV[1])
if last ~= a - 1 then return -2 end
redis.call('HSET', meta, 'fence', ARGV[5])
redis.call('XADD', KEYS[1], '0-' .. (b + 1), 'a', a, 'v2', ARGV[2], 'm', ARGV[9])
end_request(KEYS[1], meta, KEYS[3], KEYS[5], b, ARGV[6], ARGV[4])
return 1
"""

# Ownership moves by compare-and-set on the fencing token (issue 12 item 3): a replica claims a
# request the ingress opened (expecting the ingress's token); the ingress takes back a request
# whose replica call failed (expecting the replica's token). The previous owner is kept in
# ``via``; a request with a terminal is never taken.
TAKE = """
local meta = KEYS[1]
local last = tonumber(redis.call('HGET', meta, 'last') or '-1')
if redis.call('HEXISTS', meta, 'term') == 1 then return {0, last} end
if redis.call('HGET', meta, 'fence') ~= ARGV[1] then return {-1, last} end
redis.call('HSET', meta, 'via', redis.call('HGET', meta, 'owner'), 'owner', ARGV[2],
           'fence', ARGV[3])
return {1, last}
"""

# An API record's descriptor, linked to its requests (issue 22 step 3): the record is stored
# when the route stores it, after its requests were submitted, so a request may already have
# its terminal; then the record's retention clock starts here (else at the last terminal).
# KEYS: the record, then each request's meta hash; ARGV: descriptor, record id, retention_ms
PUT_RECORD = """
redis.call('SET', KEYS[1], ARGV[1])
local ended = true
for i = 2, #KEYS do
  if redis.call('HEXISTS', KEYS[i], 'term') == 0 then ended = false end
  redis.call('HSET', KEYS[i], 'rec', ARGV[2])
end
if ended then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
"""

# The first delivery's network send time of one request (P3, P5): the first front end to render
# its terminal writes it (HSETNX), every other (a replay after a restart, another ingress) reads
# that one; an expired meta hash (the log is gone) is not recreated. KEYS: meta; ARGV: seconds.
KEEP_SEND_S = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSETNX', KEYS[1], 'send_s', ARGV[1])
return redis.call('HGET', KEYS[1], 'send_s')
"""

# A detached request whose ingress died before any replica claimed it is adopted by a surviving
# front end (:mod:`coda.durable.orphans`), which becomes its ingress and submits it to a replica;
# fenced as REAP is: written only if there is no terminal, the owner's lease is still gone, and
# the fencing token and ``detach`` are as the adopter read them (a replica's claim, a reaper or
# another adopter in between wins). The dead ingress is kept in ``via`` and ``adopted``; the
# grace clock (``orphan_ms``) restarts should the adopter die in turn.
# KEYS: meta, the owner's lease; ARGV: the owner's fencing token as read, new owner, new fence
ADOPT = """
local meta = KEYS[1]
if redis.call('HEXISTS', meta, 'term') == 1 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
if (redis.call('HGET', meta, 'fence') or '') ~= ARGV[1] then return -3 end
if (redis.call('HGET', meta, 'detach') or '') == '' then return -3 end
local owner = redis.call('HGET', meta, 'owner')
if (redis.call('HGET', meta, 'ingress') or '') ~= owner then return -3 end
redis.call('HSET', meta, 'via', owner, 'adopted', owner, 'owner', ARGV[2], 'ingress', ARGV[2],
           'fence', ARGV[3])
redis.call('HDEL', meta, 'orphan_ms')
return 1
"""
