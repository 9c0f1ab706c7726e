"""Prompt data sources of the buffer: JSONL, Parquet and saved Hugging Face datasets,
chat templates, tools, the prompt length limit, weighted mixing, and a cursor that
continues exactly where it was after a restart."""

from __future__ import annotations

import json
import time

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import redis

from rlmesh.buffer import prompt_scripts
from rlmesh.buffer.config import Settings
from rlmesh.buffer.keys import RunKeys
from rlmesh.buffer.server import start
from rlmesh.common.grpc_server import sync_channel
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from tests.helpers.buffer import code_of, create, prompts, stats

ROWS = [
    {
        "question": "What is 1+1?",
        "answer": 2,
        "info": json.dumps({"source": "a"}),
        "tools": [{"type": "function", "function": {"name": "calc"}}],
    },
    {"question": "Name a color.", "answer": 7, "info": json.dumps({"source": "b"}), "tools": None},
]
CHAT_ROWS = [
    {
        "question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
        "answer": "red",
    },
    {"question": [{"role": "user", "content": "Hi"}], "answer": "hello"},
]


def run_with(stub, *datasets, run_id="r1", n=1, **run):
    return stub.CreateRun(
        buffer_pb2.CreateRunRequest(run_id=run_id, n_samples_per_prompt=n, datasets=list(datasets), **run)
    )


def spec(path, **kw) -> buffer_pb2.DatasetSpec:
    return buffer_pb2.DatasetSpec(
        **{
            "name": "train",
            "path": str(path),
            "prompt_key": "question",
            "label_key": "answer",
            "metadata_key": "info",
            "tools_key": "tools",
            **kw,
        }
    )


def check_rows(groups) -> None:
    first, second = (g.samples[0] for g in groups)
    assert (first.prompt, first.label, second.label) == ("What is 1+1?", "2", "7")
    assert json.loads(first.metadata_json) == {"source": "a", "tools": ROWS[0]["tools"], "dataset": "train"}
    assert json.loads(second.metadata_json) == {"source": "b", "dataset": "train"}
    assert not first.messages


def check_chat_rows(groups) -> None:
    first, second = (g.samples[0] for g in groups)
    assert [(m.role, m.content) for m in first.messages] == [("system", "Be brief."), ("user", "Name a color.")]
    assert (first.prompt, first.label, second.label) == ("", "red", "hello")


def write_saved_dataset(directory, rows) -> None:
    """What `datasets.Dataset.save_to_disk` writes: Arrow stream files and state.json."""
    directory.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (directory / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "x", "_split": None})
    )
    (directory / "dataset_info.json").write_text("{}")


def test_jsonl_parquet_and_saved_datasets_read_the_same(buffer, tmp_path):
    stub = buffer()
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    write_saved_dataset(tmp_path / "saved", ROWS)
    splits = tmp_path / "saved_dict"
    write_saved_dataset(splits / "train", ROWS)
    write_saved_dataset(splits / "test", ROWS[:1])
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS), hub / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), hub / "test-00000-of-00001.parquet")

    for i, (path, extra) in enumerate(
        [(jsonl, {}), (parquet, {}), (tmp_path / "saved", {}), (splits, {}), (tmp_path / "hub", {"split": "train"})]
    ):
        run_with(stub, spec(path, **extra), run_id=f"r{i}")
        check_rows(prompts(stub, 2, run_id=f"r{i}"))
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(CHAT_ROWS), chat)
    chat_jsonl = tmp_path / "chat.jsonl"
    chat_jsonl.write_text("".join(json.dumps(r) + "\n" for r in CHAT_ROWS))
    for path in (chat, chat_jsonl):
        run_with(stub, spec(path, metadata_key="", tools_key=""), run_id=path.name)
        check_chat_rows(prompts(stub, 2, run_id=path.name))
    run_with(stub, spec(splits, split="test"), run_id="test-split")
    assert (
        stats(stub, "test-split").offset == 0
        and prompts(stub, 2, run_id="test-split")[1].samples[0].prompt == "What is 1+1?"
    )

    code, details = code_of(lambda: run_with(stub, spec(splits, split="dev"), run_id="x"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "['train', 'test']" in details
    (tmp_path / "notes.txt").write_text("hi")
    code, details = code_of(lambda: run_with(stub, spec(tmp_path / "notes.txt"), run_id="x"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "is not a dataset rlmesh reads" in details
    (tmp_path / "empty").mkdir()
    code, details = code_of(lambda: run_with(stub, spec(tmp_path / "empty"), run_id="x"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "Parquet" in details
    jsonl.write_text('{"question": "ok"}\n{broken\n')
    code, details = code_of(lambda: run_with(stub, spec(jsonl), run_id="x"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "rows.jsonl:2" in details


def test_chat_template_through_the_models_tokenizer(buffer, tmp_path, tiny_model_dir):
    stub = buffer()
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(CHAT_ROWS[0]) + "\n")
    run_with(stub, spec(path, apply_chat_template=True), tokenizer_path=str(tiny_model_dir))
    first, second = (g.samples[0] for g in prompts(stub, 2))
    # the tiny model's template: "<Role initial>: <content>\n" per message, then "A: "
    assert first.prompt == "U: What is 1+1?\nA: "
    assert second.prompt == "S: Be brief.\nU: Name a color.\nA: "
    assert [m.content for m in second.messages] == ["Be brief.", "Name a color."]  # kept
    meta = json.loads(first.metadata_json)
    assert meta["chat_template_applied"] is True and meta["tools"] == ROWS[0]["tools"]

    code, details = code_of(lambda: run_with(stub, spec(path, apply_chat_template=True), run_id="x"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tokenizer_path" in details
    code, details = code_of(
        lambda: run_with(stub, spec(path), run_id="y", tokenizer_path=str(tmp_path / "nope"), max_prompt_length=5)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tokenizer" in details


def test_prompts_longer_than_the_limit_are_skipped_and_counted(buffer, tmp_path, tiny_model_dir):
    stub = buffer()
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["short", "x" * 40, "tiny", "y" * 20]))
    # characters without a tokenizer
    run_with(stub, buffer_pb2.DatasetSpec(name="train", path=str(path), max_prompt_length=20))
    assert [g.samples[0].prompt for g in prompts(stub, 4)] == ["short", "tiny", "y" * 20, "short"]
    s = stats(stub)
    assert (s.prompts_skipped, dict(s.prompts_skipped_by_dataset)) == (1, {"train": 1})
    # tokens of the templated prompt with one ("U: " + prompt + "\nA: " is 7 characters more)
    run_with(
        stub,
        buffer_pb2.DatasetSpec(name="train", path=str(path), apply_chat_template=True),
        run_id="r2",
        tokenizer_path=str(tiny_model_dir),
        max_prompt_length=20,
    )
    assert [g.samples[0].prompt for g in prompts(stub, 2, run_id="r2")] == ["U: short\nA: ", "U: tiny\nA: "]
    assert stats(stub, "r2").prompts_skipped == 2
    code, details = code_of(
        lambda: run_with(stub, buffer_pb2.DatasetSpec(name="train", path=str(path), max_prompt_length=2), run_id="r3")
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "longer than max_prompt_length" in details


def test_training_datasets_are_mixed_by_weight(buffer, tmp_path):
    stub = buffer()
    for name in "ab":
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{name}{i}"}) + "\n" for i in range(10)))
    run_with(
        stub,
        buffer_pb2.DatasetSpec(name="a", path=str(tmp_path / "a.jsonl"), weight=3),
        buffer_pb2.DatasetSpec(name="b", path=str(tmp_path / "b.jsonl"), weight=1),
        buffer_pb2.DatasetSpec(name="held_out", path=str(tmp_path / "b.jsonl"), weight=100, eval=True),
    )
    groups = prompts(stub, 8)
    assert [g.dataset for g in groups] == list("aaabaaab")
    assert [g.samples[0].prompt for g in groups] == ["a0", "a1", "a2", "b0", "a3", "a4", "a5", "b1"]
    assert [g.group_index for g in groups] == list(range(8))


def test_a_restarted_buffer_continues_the_prompt_order_exactly(redis_url, start_in_loop, loop_thread, dataset):
    def server():
        srv, port = start_in_loop(lambda: start(Settings(redis_url=redis_url, port=0)))
        return srv, buffer_pb2_grpc.BufferStub(sync_channel(f"127.0.0.1:{port}"))

    first, stub = server()
    create(stub, dataset, run_id="resumed", shuffle=True)
    create(stub, dataset, run_id="straight", shuffle=True)
    order = [g.samples[0].prompt for g in prompts(stub, 3, run_id="resumed")]
    loop_thread.run(first.stop(0))  # mid-epoch

    _, stub = server()
    order += [g.samples[0].prompt for g in prompts(stub, 9, run_id="resumed")]  # into epoch 2
    straight = [g.samples[0].prompt for g in prompts(stub, 12, run_id="straight")]
    assert order == straight
    assert sorted(order[:5]) == sorted(order[5:10]) == [f"question {i}" for i in range(5)]
    assert order[:5] != order[5:10]  # each epoch its own shuffle


def test_a_prompt_drawn_by_a_replica_that_died_before_building_it_is_built_later(redis_url, buffer, dataset):
    stub = buffer()
    create(stub, dataset, n=3)
    # a replica's first step only: draw g0 from the cursor (leased as a reference), then die
    k = RunKeys("rlmesh:run:r1:")
    draw = redis.Redis.from_url(redis_url).register_script(prompt_scripts.GET_PROMPTS)
    out = draw(
        keys=[k.spec, k.cursor, k.prompt_leases, k.prompts, k.partial, k.partial_groups, k.stats, k.closed],
        args=[0.05, 1],  # (leased for 0.05 s)
    )
    assert out[1:] == [b"g0", b'ref:{"d":"train","p":0,"i":0}'] or out[2].startswith(b"ref:")
    time.sleep(0.1)
    reissued = prompts(stub, 2)
    assert [g.group_id for g in reissued] == ["g0", "g1"]
    assert [s.index for s in reissued[0].samples] == [0, 1, 2] and reissued[0].samples[0].prompt == "question 0"
