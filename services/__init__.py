"""rlmesh: RL post-training for language models as independently deployed gRPC services.

Installed as `rlmesh`: rlmesh.buffer, rlmesh.rollout, rlmesh.reward, rlmesh.trainer and
rlmesh.coordinator are the five services, rlmesh.engine the CPU reference engine,
rlmesh.common what they share, rlmesh.cli the `rlmesh` command and its local tooling,
rlmesh.v1 the generated protobuf code."""
