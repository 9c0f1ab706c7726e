"""The megatron backend (backend 'megatron'): MegatronBackend (backend.py), the model from
a Hugging Face config (layout.py), weight conversion between HF names and megatron's
layout (conversion.py), process groups (parallel.py) and the shims megatron-core needs
on CPU (cpu_shims.py). Nothing is imported here: ranks.backend_class imports
backend.py only for a megatron run, and megatron-core itself is imported inside the
functions that use it."""
