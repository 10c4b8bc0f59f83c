-- A file leaves what its key keeps (deleted, or its upload failed). KEYS: as kept.lua. ARGV: now (ms),
-- file id.
-- include: kept.lua
-- include: forget.lua
forget(ARGV[2])
return 0
