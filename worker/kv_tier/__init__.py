"""A box-wide KV tier: full KV blocks that outlive the worker that computed them.

`digest` keys a block by its lineage (the model, and every token up to the block's end),
`store` keeps blocks as files in shared memory (and on disk below it), bounded in bytes with
least-recently-used eviction, published only when complete and verified on every read.
`connector` (torch) copies blocks between a worker's KV pool and the store: write-through
after a step, load on admission. The block manager and scheduler see only `TierHook`.
"""
