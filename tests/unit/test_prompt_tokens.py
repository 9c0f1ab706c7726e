"""The rollout service tokenizes a group's shared prompt once: every sample still gets its
own token list, and prompts with messages or tools are tokenized as before, each time."""

from __future__ import annotations

from rlmesh.common.sample import Sample
from rlmesh.rollout.generation import prompt_ids


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        self.calls += 1
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, tools=None, **_) -> list[int]:
        self.calls += 1
        return [0, *[ord(c) for m in messages for c in m["content"]], 1 if tools else 2]


def test_a_groups_prompt_is_tokenized_once_and_each_sample_owns_its_tokens():
    tokenizer = CountingTokenizer()
    group = [Sample(index=i, prompt="abc") for i in range(8)]
    tokens = [prompt_ids(tokenizer, s, apply_chat_template=True) for s in group]
    assert tokens[0] == [0, 97, 98, 99, 2] and all(t == tokens[0] for t in tokens)
    assert tokenizer.calls == 1
    tokens[0].append(5)
    assert prompt_ids(tokenizer, group[1], apply_chat_template=True) == [0, 97, 98, 99, 2]
    # Templated by the buffer already, or no chat template: the text's own tokens.
    templated = Sample(index=0, prompt="abc", metadata={"chat_template_applied": True})
    assert prompt_ids(tokenizer, templated, True) == [97, 98, 99]
    assert prompt_ids(tokenizer, Sample(index=0, prompt="abc"), False) == [97, 98, 99]


def test_prompts_with_messages_or_tools_are_tokenized_each_time():
    tokenizer = CountingTokenizer()
    with_tools = Sample(index=0, prompt="ab", metadata={"tools": [{"name": "t"}]})
    with_messages = Sample(index=0, prompt="ab", messages=[{"role": "user", "content": "xy"}])
    for _ in range(2):
        assert prompt_ids(tokenizer, with_tools, True) == [0, 97, 98, 1]
        assert prompt_ids(tokenizer, with_messages, True) == [0, 120, 121, 2]
    assert tokenizer.calls == 4
