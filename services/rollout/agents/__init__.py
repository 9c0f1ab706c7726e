"""The rollout service's agent code: generate functions whose samples are multi-turn
episodes, chosen by name in a run (`rollout.generate.name`).

- `loop`: the built-in agent loop ('agent'), with `tools` (what it may call) and
  `tool_parsers` (reading the calls out of a turn).
- `openai_*`: the OpenAI-compatible endpoint for agents written against an OpenAI client,
  and the 'openai_agent' generate function that turns their calls into samples.
"""
