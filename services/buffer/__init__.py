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
(rlmesh.cli.embedded_redis) and the compose Redis run with `appendonly yes` and
`appendfsync everysec`: Redis appends each write to the file with write(2) before it
sends the reply, and a background thread fsyncs the file once a second. So a killed
Redis process (SIGKILL, OOM kill, crash) loses nothing it acknowledged (the data is in
the kernel's page cache; tests/test_buffer_durability.py kills it and checks), while a
power cut or kernel crash can lose about the last second. One exception, on a disk too
slow to fsync within a second: Redis then holds back write(2) for up to two more seconds
while still replying, and a process crash in that window loses those writes too.
`appendfsync always` closes both windows (replies only after write and fsync) at a large
cost in write throughput.
"""
