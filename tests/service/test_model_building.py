"""Models loaded at the same time in one process (a trainer loading its next run's model while
the last run's final model is loaded beside it, as CI's end-to-end tests did) each load whole,
and so does every model after. Two transformers loads at once used to leave weight tying off
for good: every later load failed with "Cannot copy out of meta tensor"."""

from __future__ import annotations

import threading

import torch

from rlmesh.trainer.loading import load_model

LOADS_PER_THREAD = 8


def _assert_whole(model) -> None:
    assert model.lm_head.weight.device.type == "cpu"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as saved


def test_models_loaded_at_the_same_time_each_load_whole_and_so_do_later_ones(tiny_model_dir):
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def load_repeatedly() -> None:
        start.wait()
        try:
            for _ in range(LOADS_PER_THREAD):
                _assert_whole(load_model(str(tiny_model_dir), torch.device("cpu")))
        except BaseException as e:  # (reported below, from the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=load_repeatedly) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    _assert_whole(load_model(str(tiny_model_dir), torch.device("cpu")))
