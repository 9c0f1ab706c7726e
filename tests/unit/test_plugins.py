"""One plug-in door: every plug-in setting (buffer filter, generate function, reward
functions) takes `module:attr`, is imported when the settings are built, and says what is wrong."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.filters import fifo, load_filter
from rlmesh.common.plugins import PluginError, load_plugin
from rlmesh.reward.config import Settings as RewardSettings
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.generation import default_generate


class Holder:
    @staticmethod
    def method() -> int:
        return 7


NOT_CALLABLE = 3


def test_the_loader_resolves_module_and_dotted_attributes():
    assert load_plugin("rlmesh.rollout.generation:default_generate") is default_generate
    assert load_plugin(f"{__name__}:Holder.method")() == 7


@pytest.mark.parametrize(
    "path, message",
    [
        ("rlmesh.buffer.filters.fifo", "is not an import path"),  # one syntax: module:attr
        ("os.system('x')", "is not an import path"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("rlmesh.buffer.filters:nope", "has no attribute 'nope'"),
        (f"{__name__}:NOT_CALLABLE", "is not callable"),
    ],
)
def test_bad_paths_say_what_is_wrong(path, message):
    with pytest.raises(PluginError, match=message):
        load_plugin(path)


def test_built_in_defaults_are_import_paths_through_the_same_door():
    assert load_plugin(BufferSettings().buffer_filter) is fifo
    assert load_filter(BufferSettings().buffer_filter) is None  # FIFO keeps its fast path
    assert load_plugin(RolloutSettings().generate_function) is default_generate


@pytest.mark.parametrize(
    "build",
    [
        lambda p: BufferSettings(buffer_filter=p),
        lambda p: RolloutSettings(generate_function=p),
        lambda p: RewardSettings(custom_functions={"mine": p}),
        lambda p: RewardSettings(group_functions={"mine": p}),
    ],
)
def test_every_plug_in_setting_is_checked_when_settings_are_built(build):
    with pytest.raises(ValidationError, match="cannot import module 'no_such_module_xyz'"):
        build("no_such_module_xyz:fn")
    with pytest.raises(ValidationError, match="is not an import path"):
        build("no_such_module_xyz.fn")
