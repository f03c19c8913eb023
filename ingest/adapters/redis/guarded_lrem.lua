-- LREM of one ack intent's copies, at most once per copy.
--
-- LREM is not idempotent: run twice (an acker that died between LREM and its
-- commit, then a retry) it would remove a later copy that is not stored yet.
-- So each intent's copies are removed once, guarded by a marker named after
-- its inbox row that records how many copies are already removed. A retry
-- removes only what was added since: a store may merge more copies into the
-- row (ack_copies grows) between the failed attempt and the retry, and those
-- must go too, or recovery would deliver them again. Recovery counts an
-- intent's copies minus its marker.
--
-- KEYS[1] processing list, KEYS[2] the row's removed-marker
-- ARGV[1] copies the intent holds, ARGV[2] the body, ARGV[3] marker TTL (ms)
-- Returns the copies LREM removed, or -1 when all were removed already.
local removed = tonumber(redis.call('GET', KEYS[2]) or '0')
local copies = tonumber(ARGV[1])
if copies <= removed then
  return -1
end
redis.call('SET', KEYS[2], copies, 'PX', ARGV[3])
return redis.call('LREM', KEYS[1], copies - removed, ARGV[2])
