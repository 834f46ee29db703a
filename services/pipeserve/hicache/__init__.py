"""HiCache: the KV tiers below a stage's device pool (L1). L3 is Redis, shared by every group
of one model and layer split: `page` (the key and the bytes of one stage's part of one block),
`redis_tier` (the client: store, presence for every stage in one round trip, load with checks),
`writer` (a stage's asynchronous stores through a bounded queue),
a private redis-server for one machine is `pipeserve.local.redis_server`."""
