-- Pairs of ARGV from `at`, as many as ARGV[at - 1] says, for HSET/XADD (common/lua.py's flat_fields
-- writes them).
local function pairs_at(at)
  local out = {}
  for i = at, at - 1 + 2 * tonumber(ARGV[at - 1]) do out[#out + 1] = ARGV[i] end
  return out, at + 2 * tonumber(ARGV[at - 1])
end
