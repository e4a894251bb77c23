"""A box-wide KV tier: full KV blocks that outlive the worker that computed them.

`digest` keys a block by its lineage (the model, and every token up to the block's end),
`store` keeps blocks as files in shared memory (and on disk below it), bounded in bytes with
least-recently-used eviction, published only when complete and verified on every read.
`pool_file` lets a CPU worker's whole KV pool live in the tier's folder, so that its blocks
are published as small entries pointing into it, without a copy.
`connector` (torch) copies blocks between a worker's KV pool and the store: write-through
after a step (or, with the pool in the tier, an entry per block), load on admission. The
block manager and scheduler see only `TierHook`.
"""
