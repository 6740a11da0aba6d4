"""The options' readers (``renate_events.cli._options``): a ``--config`` file or a flag's value
nested far deeper than any option needs is one line, exit 2, whatever the Python version.

The TOML and JSON readers stop at the interpreter's recursion limit, which differs between
Python versions (3.12 reads JSON 1,000 arrays deep, 3.11 does not), and TOML's dotted keys nest
tables without brackets; the depth is the options' own count (64 levels)."""

from __future__ import annotations

import pytest

from renate_events.cli import UsageError
from renate_events.cli._options import parse_value, read_toml
from tests.helpers import one_line_cli_error

_DEEP = {
    "arrays": "v = " + "[" * 100_000 + "]" * 100_000,
    "arrays-500": "v = " + "[" * 500 + "]" * 500,
    "inline tables": "v = " + "{a = " * 2_000 + "1" + "}" * 2_000,
    "dotted keys": "v = {" + ".".join(["a"] * 2_000) + " = 1}",
    "table header": "[" + ".".join(["a"] * 2_000) + "]\nx = 1",
}


@pytest.mark.hostile
@pytest.mark.parametrize("case", sorted(_DEEP))
def test_a_config_file_nested_too_deeply_is_one_line(tmp_path, capsys, case):
    path = tmp_path / "deep.toml"
    path.write_text(_DEEP[case] + "\n")
    with pytest.raises(UsageError, match="nest deeper than 64 levels"):
        read_toml(str(path))
    one_line_cli_error(
        capsys,
        ["run", "--config", str(path), "--output-dir", str(tmp_path / "out")],
        f"{path}: its tables or arrays nest deeper than 64 levels",
    )
    assert not (tmp_path / "out").exists()


def test_a_config_file_64_levels_deep_is_read(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text("v = " + "[" * 63 + "]" * 63 + "\n")  # the table and 63 arrays: 64 levels
    value = read_toml(str(path))["v"]
    for _ in range(62):
        value = value[0]
    assert value == []


@pytest.mark.hostile
@pytest.mark.parametrize(
    "text",
    ["[" * 100_000 + "]" * 100_000, "{" + ".".join(["a"] * 2_000) + " = 1}"],
    ids=["arrays", "dotted keys"],
)
def test_a_flag_value_nested_too_deeply_stays_text_for_its_check(capsys, tmp_path, text):
    assert parse_value(text) == text
    out = str(tmp_path / "out")
    one_line_cli_error(capsys, ["run", "--alpha", text, "--output-dir", out], "--alpha must be")
    one_line_cli_error(
        capsys, ["run", "--model-args", text, "--output-dir", out], "--model-args must be a table"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.hostile
def test_model_args_in_json_nested_too_deeply_is_one_line(capsys, tmp_path):
    text = '{"a": ' * 100_000 + "1" + "}" * 100_000
    one_line_cli_error(
        capsys,
        ["run", "--model-args", text, "--output-dir", str(tmp_path / "out")],
        "--model-args must be a table",
    )


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("argv", "word"),
    [
        (["run", "--scenario", "x" * 10_000], "unknown --scenario 'xxx"),
        (["run", "--model-args", "{a = " + "[" * 60 + "1, " * 99 + "1" + "]" * 60 + "}"], "{'a'"),
        (["run", "--model-args={" + ",".join(f"a{i} = {i}" for i in range(2_000)) + "}"], "a0"),
        (["run", "--epochs", "9" * 3_000 + "x"], "invalid int value"),
        (["evaluate", "--state", "s" * 5_000, "--scenario", "split-digits"], "not a state"),
    ],
    ids=["string", "nested table", "wide table", "argparse", "path"],
)
def test_an_over_long_value_is_cut_in_its_one_line_error(capsys, tmp_path, argv, word):
    err = one_line_cli_error(capsys, [*argv, "--output-dir", str(tmp_path / "out")][:-2], word)
    assert len(err) < 1_000 and "... (" in err and " characters)" in err, err
    assert not (tmp_path / "out").exists()


PYTHON_CONFIG = "import torch\n\n\ndef model_fn():\n    return torch.nn.Linear(4, 2)\n"


@pytest.mark.parametrize(
    ("name", "text", "hint"),
    [
        ("my_config.py", PYTHON_CONFIG, True),
        ("my_config.toml", PYTHON_CONFIG, True),  # parses as Python, defines a function
        ("typo.py", "epochs = [\n", True),  # named .py
        ("typo.toml", "epochs = x\n", False),  # parses as Python, a TOML mistake all the same
        ("typo.toml", "epochs = [\n", False),
    ],
)
def test_a_python_file_given_to_config_says_where_it_goes(tmp_path, capsys, name, text, hint):
    path = tmp_path / name
    path.write_text(text)
    argv = ["run", "--config", str(path), "--output-dir", str(tmp_path / "out")]
    err = one_line_cli_error(capsys, argv, f"{path} is not valid TOML: ")
    assert err.endswith("; a Python config file goes to --config-file") == hint
    assert not (tmp_path / "out").exists()
