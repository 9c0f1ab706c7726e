"""Prompt datasets as plain records, and the deterministic per-epoch order (the same seed
gives the same order on any replica, after any restart).

A record is what the buffer stores per prompt in Redis:
    {"prompt": str, "messages": [{"role", "content"}], "label": str, "metadata": dict}
`prompt` is the text the engine sees (chat-templated when the dataset asks for it);
`messages` keeps a chat prompt as given. Tool definitions go to metadata["tools"].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from rlmesh.buffer.sources import DataFiles, needs_tokenizer, read_rows
from rlmesh.common.errors import InvalidArgument
from rlmesh.common.run_config import DatasetConfig
from rlmesh.common.sample import Sample, Status


@dataclass
class LoadedDataset:
    records: list[dict]
    skipped: int  # longer than max_prompt_length


def load_dataset(opts: DatasetConfig, files: DataFiles) -> LoadedDataset:
    """The dataset's records; its files are read only under files.roots (see rlmesh.buffer.sources)."""
    columns = [c for c in (opts.prompt_key, opts.label_key, opts.metadata_key, opts.tools_key) if c]
    rows = read_rows(opts.name, opts.path, columns, opts.split, files)
    records = [_record(opts, i, row) for i, row in enumerate(rows, 1)]
    if not records:
        raise InvalidArgument(f"dataset {opts.name!r}: {opts.path} has no records")
    tokenizer = None
    if needs_tokenizer(opts):
        tokenizer = load_tokenizer(
            str(files.tokenizer_dir(opts.tokenizer_path, f"dataset {opts.name!r}: tokenizer_path"))
        )
    if opts.apply_chat_template:
        if tokenizer is None:
            raise InvalidArgument(f"dataset {opts.name!r}: apply_chat_template needs a tokenizer_path")
        for r in records:
            _template(opts.name, tokenizer, r)
    kept = records
    if opts.max_prompt_length > 0:
        lengths = prompt_lengths(tokenizer, records)
        kept = [r for r, n in zip(records, lengths) if n <= opts.max_prompt_length]
        if not kept:
            raise InvalidArgument(
                f"dataset {opts.name!r}: all {len(records)} prompts are longer than max_prompt_length "
                f"{opts.max_prompt_length} ({'tokens' if tokenizer else 'characters'})"
            )
    return LoadedDataset(kept, len(records) - len(kept))


def _record(opts: DatasetConfig, where: int, row: dict) -> dict:
    def bad(why: str) -> InvalidArgument:
        return InvalidArgument(f"dataset {opts.name!r}: {opts.path} record {where}: {why}")

    if opts.prompt_key not in row or row[opts.prompt_key] is None:
        raise bad(f"no {opts.prompt_key!r} key (prompt_key); it has {sorted(row)}")
    prompt = row[opts.prompt_key]
    messages: list[dict[str, str]] = []
    if isinstance(prompt, list):
        messages = [_message(m, bad) for m in prompt]
        prompt = ""
    elif not isinstance(prompt, str):
        raise bad("the prompt must be text or a list of chat messages")
    label = row.get(opts.label_key, "")
    metadata = row.get(opts.metadata_key) if opts.metadata_key else None
    if isinstance(metadata, str):  # columnar datasets often keep metadata as JSON text
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            pass
    metadata = {} if metadata is None else metadata if isinstance(metadata, dict) else {"value": metadata}
    if opts.tools_key and row.get(opts.tools_key) is not None:
        tools = row[opts.tools_key]
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError:
                raise bad(f"{opts.tools_key!r} (tools_key) is not valid JSON") from None
        if not isinstance(tools, list):
            raise bad(f"{opts.tools_key!r} (tools_key) must be a list of tool definitions")
        metadata = {**metadata, "tools": tools}
    return {
        "prompt": prompt,
        "messages": messages,
        "label": label if isinstance(label, str) else json.dumps(label),
        "metadata": metadata,
    }


def _message(m: Any, bad) -> dict[str, Any]:
    if not isinstance(m, dict) or "role" not in m:
        raise bad("chat messages must be objects with 'role' and 'content'")
    content = m.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    message: dict[str, Any] = {"role": str(m["role"]), "content": "" if content is None else str(content)}
    if m.get("tool_calls"):  # an earlier assistant turn's calls, in OpenAI's form
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and c["function"].get("name") for c in calls
        ):
            raise bad("tool_calls must be a list of {'id', 'type': 'function', 'function': {'name', 'arguments'}}")
        message["tool_calls"] = calls
    for key in ("tool_call_id", "name"):  # a tool turn: which call it answers
        if m.get(key):
            message[key] = str(m[key])
    return message


@lru_cache(maxsize=8)
def load_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)  # never a download
    except Exception as e:
        # (the message names the setting, not this machine's directory)
        reason = str(e).replace(path, "<tokenizer_path>")[:300]
        raise InvalidArgument(f"cannot load a tokenizer from tokenizer_path: {type(e).__name__}: {reason}") from None


def _chat(record: dict) -> list[dict[str, str]]:
    return record["messages"] or [{"role": "user", "content": record["prompt"]}]


def _template(name: str, tokenizer, record: dict) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument(f"dataset {name!r}: apply_chat_template is set but the tokenizer has no chat template")
    record["prompt"] = tokenizer.apply_chat_template(
        _chat(record), tools=record["metadata"].get("tools"), tokenize=False, add_generation_prompt=True
    )
    record["metadata"]["chat_template_applied"] = True


def prompt_lengths(tokenizer, records: list[dict]) -> list[int]:
    """Tokens the engine will see (with a tokenizer), else characters."""
    if tokenizer is None:
        return [
            len(r["prompt"]) if not r["messages"] else sum(len(m["content"]) for m in r["messages"]) for r in records
        ]
    texts = []
    for r in records:
        templated = r["metadata"].get("chat_template_applied")
        if r["messages"] and not templated and getattr(tokenizer, "chat_template", None):
            texts.append(tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True))
        else:
            texts.append(r["prompt"] or "".join(m["content"] for m in r["messages"]))
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


@lru_cache(maxsize=64)
def epoch_order(size: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(size)
    return np.random.default_rng([seed, epoch]).permutation(size)


def record_to_samples(record: dict, group_index: int, n_samples: int, dataset: str) -> list[Sample]:
    prompt = record["prompt"]
    messages = record.get("messages") or (prompt if isinstance(prompt, list) else [])
    metadata = {**record["metadata"], "dataset": dataset}
    return [
        Sample(
            index=group_index * n_samples + i,
            group_index=group_index,
            prompt=prompt if isinstance(prompt, str) else "",
            messages=[{"role": m["role"], "content": m["content"]} for m in messages],
            label=record["label"],
            status=Status.PENDING,
            metadata=dict(metadata),
        )
        for i in range(n_samples)
    ]
