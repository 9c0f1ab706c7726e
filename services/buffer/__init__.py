"""The buffer service: the prompt data source and every sample between generation and
training. Redis is its only state, so any number of replicas can serve one Redis and
any of them can be killed at any time.

- Prompts come from local JSONL / Parquet files or saved Hugging Face datasets
  (rlmesh.buffer.sources), optionally chat-templated through the model's tokenizer
  and filtered by length (rlmesh.buffer.datasets), shuffled per epoch with a seed, mixed
  by weight across training datasets, with the cursor in Redis (rlmesh.buffer.prompts).
- Every move of a group between states is one Lua script (rlmesh.buffer.scripts):
  prompts leased to rollout workers, partial groups waiting to resume, completed groups
  queued, training batches leased and acknowledged, stale groups dropped. The key
  scheme is in rlmesh.buffer.store.
- Groups stay the bytes their writer serialized, all the way to the trainer
  (rlmesh.buffer.wire); a bounded in-process cache of recent writes lets a lease skip
  reading them back from Redis (rlmesh.buffer.cache).

Durability comes from Redis's append-only file. The embedded Redis
(rlmesh.cli.embedded_redis) and the deployed ones run with `appendonly yes` and
`appendfsync always`: Redis answers a write only after it is written and fsynced, so
neither a killed Redis nor a power cut loses what it acknowledged
(tests/e2e/test_crashes.py kills it and checks). `appendfsync everysec` (opt-in) can lose
the last second or so; what that does and what it costs: docs/fault-tolerance.md.
"""
