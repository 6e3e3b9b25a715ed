"""tools/ are thin (issue 13): each tool parses ``key=value`` words with the package's one parser and calls the
package; checkpoint I/O, atomic writes and argument parsing live in the package, never in a tool. The scripts of
benchmarks/ own their logic (issue 60: the timing harnesses stand beside the package, as timm's benchmark.py), so no
size or content rule holds them; they take the same ``key=value`` words, ``--help`` and one-line errors as the tools."""
import ast
import functools
import re

import pytest

import helpers
from helpers import REPO
from moh_vision.cli import Option, integer, list_of, parse_options, yaml_value
from moh_vision.errors import ConfigError

load_tool = functools.lru_cache(maxsize=None)(helpers.load_tool)  # each tool imported once for this file
TOOLS = sorted(p.stem for p in (REPO / "tools").glob("*.py"))
BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("bench_*.py"))  # the scripts; the rest: their modules
SCRIPTS = [("tools", name) for name in TOOLS] + [("benchmarks", name) for name in BENCHMARKS]
MAX_LINES = 80
# what a tool must not do itself: the package's checkpoints module reads and writes, cli parses
FORBIDDEN = {
    "sys.path": re.compile(r"\bsys\.path\b"),
    "torch.load": re.compile(r"\btorch\.load\b"),
    "torch.save": re.compile(r"\btorch\.save\b"),
    "tempfile": re.compile(r"\btempfile\b"),
    "argparse": re.compile(r"\bargparse\b"),
    "os.replace": re.compile(r"\bos\.replace\b"),
}


def test_every_tool_is_listed():
    assert TOOLS == ["analyze_routing", "compare_samplers", "convert_checkpoint", "convert_dense_to_moh",
                     "evaluate_samples", "extract_latents", "flops", "sample", "sweep_report"]
    assert BENCHMARKS == ["bench_backbones", "bench_checkpoint", "bench_data", "bench_index", "bench_kernels",
                          "bench_models"]


@pytest.mark.parametrize("name", TOOLS)
def test_tool_holds_no_logic_of_its_own(name):
    source = (REPO / "tools" / f"{name}.py").read_text()
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    found = [what for what, pattern in FORBIDDEN.items() if pattern.search(code)]
    assert not found, f"tools/{name}.py uses {found}: that belongs in moh_vision (checkpoints, cli)"
    assert len(source.splitlines()) <= MAX_LINES, f"tools/{name}.py has {len(source.splitlines())} lines"
    tree = ast.parse(source)
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert "main" in functions and len(functions) <= 2, f"tools/{name}.py defines {functions}: main and one call"
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "moh_vision.cli" in imported, f"tools/{name}.py does not parse with moh_vision.cli"


@pytest.mark.parametrize("folder,name", SCRIPTS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_option(folder, name, flag, capsys):
    tool = load_tool(name, folder)
    with pytest.raises(SystemExit) as exited:
        tool.main([flag])
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert "options (key=value words):" in printed
    for option in tool.OPTIONS:
        assert f"\n  {option.name[:-2] + '.<key>' if option.is_group else option.name}" in printed, option.name


@pytest.mark.parametrize("folder,name", SCRIPTS)
def test_unknown_key_exits_2_with_one_line(folder, name, capsys):
    with pytest.raises(SystemExit) as exited:
        load_tool(name, folder).main(["no_such_option=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1
    assert err[0].startswith("error: unknown option 'no_such_option' (no_such_option=1); options: ")


def test_parser_types_defaults_groups_and_passthrough():
    options = (Option("n", 3, integer, minimum=1), Option("sizes", [1], list_of(integer)),
               Option("mode", "a", choices=("a", "b")), Option("model.*", type=yaml_value), Option("path"))
    opts, overrides = parse_options(["sizes=[2,3]", "model.depth=4", "model.name=x", "data=digits", "+data.root=/d"],
                                    options, passthrough=("data",))
    assert opts == {"n": 3, "sizes": [2, 3], "mode": "a", "model_options": {"depth": 4, "name": "x"}, "path": None}
    assert opts.sizes == [2, 3] and overrides == ["data=digits", "+data.root=/d"]
    for argv, message in ((["n=0"], "n=0: must be at least 1"), (["n=two"], "n=two: expected int"),
                          (["mode=c"], "mode=c: use one of a, b"), (["n=1", "n=2"], "n is given twice"),
                          (["data=digits"], "unknown option 'data'"), (["loose"], "key=value")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_options(argv, options)
    with pytest.raises(ConfigError, match="path= is required"):
        parse_options([], (Option("path", required=True),))
