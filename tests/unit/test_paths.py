"""Paths from requests stay under the configured roots; run ids are safe as key parts and
directory names (rlmesh.common.paths)."""

from __future__ import annotations

import pytest

from rlmesh.common.errors import InvalidArgument
from rlmesh.common.paths import resolve_roots, resolve_under, validate_run_id


@pytest.fixture
def roots(tmp_path):
    (tmp_path / "a" / "sub").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.json").write_text('{"password": "hunter2"}')
    return resolve_roots([tmp_path / "a", tmp_path / "b"])


def under(path, roots):
    return resolve_under(path, roots, "path", "data_roots")


def test_relative_paths_are_taken_under_the_first_root_and_absolute_ones_under_any(roots):
    a, b = roots
    assert under("sub/x.jsonl", roots) == a / "sub" / "x.jsonl"
    assert under(str(b / "y.jsonl"), roots) == b / "y.jsonl"
    assert under("sub/../x.jsonl", roots) == a / "x.jsonl"  # '..' that stays inside is fine
    assert under(a, roots) == a


@pytest.mark.parametrize(
    "path",
    [
        "../outside/secret.json",
        "sub/../../outside/secret.json",
        "/etc/passwd",
        "/",
        "{a}/../outside/secret.json",
        "{a}/../outside/missing.json",
    ],
)
def test_paths_outside_every_root_are_refused_naming_the_setting_not_the_roots(roots, path):
    path = path.format(a=roots[0])
    with pytest.raises(InvalidArgument) as e:
        under(path, roots)
    message = str(e.value).replace(repr(path), "<path>")
    # The setting to change, never the server's own directories (only the caller's own text).
    assert "data_roots" in message and str(roots[0]) not in message and str(roots[1]) not in message
    assert "hunter2" not in message and "password" not in message


def test_the_refusal_is_the_same_whether_or_not_the_file_exists(roots):
    def refusal(path: str) -> str:
        with pytest.raises(InvalidArgument) as e:
            under(path, roots)
        return str(e.value).replace(path, "<path>")

    assert refusal("../outside/secret.json") == refusal("../outside/missing.json")


def test_symlinks_out_of_a_root_are_refused(roots, tmp_path):
    a, _ = roots
    (a / "link.json").symlink_to(tmp_path / "outside" / "secret.json")
    (a / "linkdir").symlink_to(tmp_path / "outside")
    (a / "dangling.json").symlink_to(tmp_path / "outside" / "not-yet.json")
    (a / "loop").symlink_to(a / "loop")
    for path in ("link.json", "linkdir/secret.json", "linkdir", "dangling.json", "loop"):
        with pytest.raises(InvalidArgument, match="not under data_roots"):
            under(path, roots)
    (a / "inner.json").symlink_to(a / "sub")  # a link that stays inside is followed
    assert under("inner.json", roots) == a / "sub"


def test_an_empty_path_or_no_roots_is_refused(roots):
    with pytest.raises(InvalidArgument, match="path is required"):
        under("", roots)
    with pytest.raises(InvalidArgument, match="data_roots names no directory"):
        under("x.jsonl", ())
    for bad in ("bad\0name", "a\nb", "tab\there"):
        with pytest.raises(InvalidArgument, match="control character"):
            under(bad, roots)


@pytest.mark.parametrize("run_id", ["r1", "a", "run-2024.01_x", "0" * 64, "3f2a9c1b7d4e"])
def test_good_run_ids(run_id):
    assert validate_run_id(run_id) == run_id


@pytest.mark.parametrize(
    "run_id",
    ["", ".", "..", "../../x", "a/b", "a\\b", ".hidden", "-flag", "_x", "a:b", "a*", "a b", "0" * 65, "r\n", "é"],
)
def test_bad_run_ids(run_id):
    with pytest.raises(InvalidArgument, match="run_id must be"):
        validate_run_id(run_id)


def test_relative_paths_are_found_under_the_root_that_holds_them(roots):
    a, b = roots
    (b / "only-in-b").mkdir()
    assert under("only-in-b", roots) == b / "only-in-b"  # (a model_path a trainer listed under work_dir)
    assert under("nowhere/x", roots) == a / "nowhere" / "x"  # none holds it: the first


@pytest.mark.parametrize("path", ["n" * 256, "/".join(["é"] * 1400)])
def test_paths_no_file_system_takes_are_refused_as_too_long_without_repeating_them(roots, path):
    with pytest.raises(InvalidArgument, match="too long") as e:
        under(path, roots)
    assert len(str(e.value)) < 400  # (the caller's text cut short, not repeated whole)


def test_an_unexpected_os_error_reaches_a_caller_without_its_file_names(tmp_path):
    """What a gRPC or HTTP caller reads of an error nobody foresaw (INTERNAL, 500): its kind
    and reason, never this machine's directories (the service's log has them)."""
    from rlmesh.common.errors import unexpected

    try:
        (tmp_path / ("n" * 300)).mkdir()
    except OSError as e:
        described = unexpected(e)
    assert described == "OSError: File name too long (errno 36)" and str(tmp_path) not in described
    assert unexpected(RuntimeError("overflow")) == "RuntimeError: overflow"


def test_a_status_message_quoting_a_long_value_is_cut_to_fit_grpcs_header():
    """gRPC carries a status message in a header capped at 16 KiB: a longer one would reach the
    caller as RESOURCE_EXHAUSTED instead of the status the service meant."""
    from rlmesh.common.grpc_server import status_details

    message = status_details("unknown mode " + "m" * 100_000)
    assert len(message) < 4100 and message.endswith("(100013 characters in all)")
    assert status_details("short") == "short"
