"""The docs are executed, so they cannot drift from the code (issue 35).

What runs, for README.md and every page of docs/:

- **Python snippets.** Every ```` ```python ```` block runs, in order, one namespace per page, in a
  temporary working directory, through Sybil's Markdown parsers. A block the reader cannot run here
  (released weights, a GPU) is preceded by Sybil's ``<!-- skip: next -->``.
- **Shell blocks marked runnable.** A ```` ```bash ```` block directly preceded by
  ``<!-- run: writes=a,b/c -->`` runs command by command, each with the tiny overrides of ``TINY``
  below (one epoch of a few steps, a few samples), in this process (the entry points' ``main``) with a
  temporary working directory (where runs land in ``outputs/...`` as they would for a user), and
  must exit 0; then every file named in ``writes=`` (globs allowed) must exist in the directory of the
  last run of the page, or, written ``./<path>``, in the working directory. ``<run>`` (and
  ``outputs/train/<date>/<time>``) stand for that directory, so later blocks of a page use the run of
  an earlier one; ``multirun/train/<date>/<time>`` stands for the page's last multirun. ``pip install -r requirements.txt &&`` and the test-suite command
  are not run (this is the test suite). Blocks that need ImageNet, a GPU or hours stay unmarked.
- **Printed output.** The lines of a ```` ```text ```` block preceded by ``<!-- prints -->`` must each
  match a line that the page's runnable commands printed (``...``, ``<date>``, ``<time>``: anything).
- **Quoted figures.** A number followed by ``<!-- bench: <record> <key> [*scale] -->`` must equal,
  to the decimals it shows, the value at ``<key>`` (dots; list indices are numbers) of the JSON record
  ``docs/bench/<record>``, times the scale.
- **Paths.** Every repository path quoted in backticks (``moh_vision/...``, ``configs/...``,
  ``tools/...``, ``tests/...``, ``docs/...``) exists.

``test_drift_is_caught`` edits copies of the README (a snippet, a command, a promised file, printed
output, a figure, a path) and shows each check fail. ``mkdocs build --strict`` (in ``.ci/run``) checks
the links.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

from helpers import save_untrained_classifier

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BENCH = REPO / "docs" / "bench"

# The tiny overrides a runnable command gets, per entry point (a key the command sets is replaced).
TINY: Dict[str, Sequence[str]] = {
    "train.py": ("trainer.epochs=1", "trainer.max_steps=2", "trainer.batch_size=32", "trainer.progress=false",
                 "trainer.num_workers=0", "trainer.log_every=1"),
    "train.py experiment=diffusion": ("data.img_size=8", "task.sample.per_class=1", "task.sample.eval_per_class=0",
                                      "task.sample.steps=2", "task.sample.every_epochs=0"),
    "eval.py": (),
    "tools/sample.py": ("per_class=1", "steps=2", "progress=false"),  # + an untrained metrics classifier
    "tools/analyze_routing.py": ("num_images=2", "map_images=1"),
    "tools/flops.py": (),
    "tools/sweep_report.py": (),
}
NOT_RUN = (("python", "-m", "pytest"), ("mkdocs",))  # the suite itself; the site is built by .ci/run

RUN_MARK = re.compile(r"<!--\s*run:(?P<args>[^>]*)-->\s*$")
FIGURE = re.compile(r"(?<![\d.])(?P<num>\d+(?:\.\d+)?)<!--\s*bench:\s*(?P<record>\S+)\s+(?P<key>\S+)"
                    r"(?:\s+\*(?P<scale>[-+.\deE]+))?\s*-->")
REPO_PATH = re.compile(r"`((?:moh_vision|configs|tools|benchmarks|tests|docs)/[\w./-]+)`")
OTHER_REPOS = {"tests/test_models.py"}  # timm's own test file (docs/models.md)


def doc_id(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# ------------------------------------------------------------------------------------------------------
# Python snippets
# ------------------------------------------------------------------------------------------------------

PYTHON = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])


def run_python_snippets(doc: Path, workdir: Path) -> int:
    """Run every Python block of ``doc`` in order in ``workdir``; the number run (raises on a failure)."""
    import torch
    document = PYTHON.parse(doc)
    examples = list(document)
    old = Path.cwd()
    os.chdir(workdir)
    try:
        torch.manual_seed(0)
        for example in examples:
            example.evaluate()
    finally:
        os.chdir(old)
    return sum(1 for e in examples if "skip" not in type(e.parsed).__name__.lower())


def docs_with(language: str) -> List[Path]:
    fence = re.compile(rf"^```{language}\s*$", re.M)
    return [d for d in DOCS if fence.search(d.read_text())]


@pytest.mark.parametrize("doc", docs_with("python"), ids=doc_id)
def test_python_snippets_run(doc, tmp_path):
    assert run_python_snippets(doc, tmp_path) > 0


# ------------------------------------------------------------------------------------------------------
# Runnable shell blocks
# ------------------------------------------------------------------------------------------------------

SHELL = Sybil(parsers=[CodeBlockParser(language="bash")])


@dataclass
class Block:
    doc: Path
    line: int
    source: str
    writes: List[str]


def runnable_blocks(doc: Path) -> List[Block]:
    """The ``bash`` blocks of ``doc`` that a ``<!-- run: ... -->`` comment marks runnable."""
    document = SHELL.parse(doc)
    blocks = []
    for example in document:
        mark = RUN_MARK.search(document.text[:example.start])
        if mark is None:
            continue
        args = dict(word.split("=", 1) for word in mark["args"].split())
        writes = [w for w in args.get("writes", "").split(",") if w]
        blocks.append(Block(doc, example.line, str(example.parsed), writes))
    return blocks


def merge(words: Sequence[str], tiny: Sequence[str]) -> List[str]:
    """``words`` with the ``tiny`` overrides: a key both set takes the tiny value."""
    keys = {t.split("=", 1)[0].lstrip("+") for t in tiny}
    kept = [w for w in words if "=" not in w or w.split("=", 1)[0].lstrip("+") not in keys]
    return [*kept, *tiny]


@dataclass
class Runner:
    """Runs a page's runnable commands in this process; remembers the last run directory for ``<run>``."""
    tmp: Path
    run_dir: Optional[Path] = None
    sweep_dir: Optional[Path] = None
    ran: List[str] = field(default_factory=list)

    def substitute(self, word: str) -> str:
        for placeholder, value in (("<run>", self.run_dir), ("outputs/train/<date>/<time>", self.run_dir),
                                   ("multirun/train/<date>/<time>", self.sweep_dir)):
            if placeholder in word:
                assert value is not None, f"{placeholder} before any run (or multirun) on the page"
                word = word.replace(placeholder, str(value))
        return word

    def run_block(self, block: Block) -> None:
        for line in block.source.splitlines():
            line = re.sub(r"^\s*pip install -r requirements\.txt\s*&&\s*", "", line)
            words = shlex.split(line, comments=True)
            if not words or any(tuple(words[:len(skip)]) == skip for skip in NOT_RUN):
                continue
            assert words[0] == "python" and len(words) > 1, f"{block.doc.name}:{block.line}: not runnable: {line}"
            self.run_command(words[1], [self.substitute(w) for w in words[2:]], f"{block.doc.name}:{block.line}")
        missing = [name for name in block.writes if not self.written(name)]
        assert not missing, f"{block.doc.name}:{block.line}: the run did not write {missing} (in {self.run_dir})"

    def untrained_classifier(self) -> Path:
        """The digits metrics' classifier, untrained (training it is not what the docs test)."""
        img_size = int(next(w for w in TINY["train.py experiment=diffusion"] if w.startswith("data.img_size="))[14:])
        return save_untrained_classifier(self.tmp / "untrained_digits_classifier.pt", img_size)

    def written(self, name: str) -> bool:
        """``name`` (a glob) exists in the last run directory, or, as ``./<path>``, in the working directory."""
        base = self.tmp if name.startswith("./") else self.run_dir
        return base is not None and any(base.glob(name[2:] if name.startswith("./") else name))

    def run_command(self, script: str, words: List[str], where: str) -> None:
        assert script in TINY, f"{where}: no tiny overrides for {script}; add them to TINY in tests/test_docs.py"
        tiny = list(TINY[script])
        if script == "train.py" and "experiment=diffusion" in words:
            tiny += TINY["train.py experiment=diffusion"]
        if script == "tools/sample.py":
            tiny.append(f"digits_classifier={self.untrained_classifier()}")
        words = merge(words, tiny)
        before = set(self.tmp.glob("outputs/*/*/*")) | set(self.tmp.glob("multirun/*/*/*"))
        given = [w.split("=", 1)[1] for w in words if w.startswith("hydra.run.dir=")]
        if given:  # a relative directory lands under the page's working directory
            words = [w for w in words if not w.startswith("hydra.run.dir=")] + [f"hydra.run.dir={self.tmp / given[-1]}"]
        code = call_entry(REPO / script, words, tool=script.startswith("tools/"), cwd=self.tmp)
        if script == "train.py" and "-m" in words:  # a multirun: its sweep directory
            self.sweep_dir = max(set(self.tmp.glob("multirun/*/*/*")) - before, default=None)
        elif script == "train.py":
            self.run_dir = self.tmp / given[-1] if given else max(set(self.tmp.glob("outputs/*/*/*")) - before,
                                                                   default=None)
        self.ran.append(" ".join([script, *words]))
        assert code == 0, f"{where}: python {script} {' '.join(words)} exited {code}"


def call_entry(path: Path, words: List[str], tool: bool = False, cwd: Optional[Path] = None) -> int:
    """``python <path> <words>`` in this process: its exit status. Logging handlers that Hydra adds for a
    job are removed afterwards."""
    spec = importlib.util.spec_from_file_location(path.stem, path)  # Hydra names the job after it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = logging.getLogger()
    handlers, level, argv, old = root.handlers[:], root.level, sys.argv, Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        if tool:
            module.main(words)
        else:
            sys.argv = [str(path), *words]
            module.main()
        return 0
    except SystemExit as stop:
        return 0 if stop.code in (None, 0) else stop.code
    finally:
        os.chdir(old)
        sys.argv = argv
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)


def run_page(doc: Path, tmp: Path) -> Runner:
    runner = Runner(tmp)
    for block in runnable_blocks(doc):
        runner.run_block(block)
    return runner


@pytest.fixture(autouse=True)
def _quiet_environment(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("MPLBACKEND", "Agg")


TEXT = Sybil(parsers=[CodeBlockParser(language="text")])
PRINTS_MARK = re.compile(r"<!--\s*prints\s*-->\s*$")


def promised_output(doc: Path) -> List[str]:
    """The lines of the ``text`` blocks marked ``<!-- prints -->``: what the page's commands print."""
    document = TEXT.parse(doc)
    return [line for example in document if PRINTS_MARK.search(document.text[:example.start])
            for line in str(example.parsed).splitlines() if line.strip()]


def unprinted(promised: Sequence[str], printed: str) -> List[str]:
    """The promised lines that match no printed line (``...``, ``<date>`` and ``<time>`` match anything)."""
    def pattern(line: str) -> re.Pattern:
        parts = re.split(r"(\.\.\.|<date>|<time>)", line.strip())
        return re.compile("".join(".*" if p in ("...", "<date>", "<time>") else re.escape(p) for p in parts))
    lines = printed.splitlines()
    return [p for p in promised if not any(pattern(p).fullmatch(line.strip()) for line in lines)]


@pytest.mark.parametrize("doc", [d for d in DOCS if runnable_blocks(d)], ids=doc_id)
def test_runnable_commands_run_and_write_what_they_promise(doc, tmp_path, capsys):
    runner = run_page(doc, tmp_path)
    assert runner.ran, f"{doc_id(doc)}: no command ran"
    captured = capsys.readouterr()
    missing = unprinted(promised_output(doc), captured.out + captured.err)
    assert not missing, f"{doc_id(doc)}: no command printed {missing}"


def test_readme_marks_its_main_commands_runnable():
    assert len(promised_output(REPO / "README.md")) == 2  # the set-up command's last lines
    """The README's set-up command and the one command of each task that runs on a CPU in seconds."""
    sources = "\n".join(b.source for b in runnable_blocks(REPO / "README.md"))
    for command in ("python train.py\n", "python train.py experiment=diffusion", "python tools/sample.py",
                    "python tools/flops.py", "python tools/analyze_routing.py", "hydra.run.dir=outputs/my_run"):
        assert command in sources, command


# ------------------------------------------------------------------------------------------------------
# Quoted figures and paths
# ------------------------------------------------------------------------------------------------------

def record_value(record: str, key: str) -> float:
    value = json.loads((BENCH / record).read_text())
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return float(value)


def figure_mismatches(doc: Path) -> List[str]:
    """Every quoted figure of ``doc`` that differs from its record, as ``'line: quoted != record'``."""
    text, bad = doc.read_text(), []
    quoted_at = {m.end("num") for m in FIGURE.finditer(text)}
    for marker in re.finditer(r"<!--\s*bench:(?!\s*<)", text):  # no number right before it: it quotes nothing
        # (``<!-- bench: <record> ...`` is the syntax described, not a marker)
        if marker.start() not in quoted_at:
            bad.append(f"{doc_id(doc)}:{text.count(chr(10), 0, marker.start()) + 1}: a bench marker without its number")
    for m in FIGURE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        quoted = m["num"]
        decimals = len(quoted.split(".")[1]) if "." in quoted else 0
        try:
            value = record_value(m["record"], m["key"]) * float(m["scale"] or 1)
        except (OSError, KeyError, IndexError, ValueError) as err:
            bad.append(f"{doc_id(doc)}:{line}: {m['record']} {m['key']}: {type(err).__name__}: {err}")
            continue
        if f"{value:.{decimals}f}" != quoted:
            bad.append(f"{doc_id(doc)}:{line}: quoted {quoted}, record {m['record']} {m['key']} = {value!r}")
    return bad


def missing_paths(doc: Path) -> List[str]:
    text = doc.read_text()
    return sorted({p for p in REPO_PATH.findall(text) if p not in OTHER_REPOS and not (REPO / p.rstrip(".")).exists()})


def test_quoted_figures_equal_their_records():
    assert sum(len(FIGURE.findall(d.read_text())) for d in DOCS) >= 10, "figures lost their record markers"
    bad = [line for d in DOCS for line in figure_mismatches(d)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_quoted_repository_paths_exist(doc):
    assert not missing_paths(doc)


def test_readme_is_a_guide():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    first_block = lines[lines.index("```bash") + 1:lines.index("```bash") + 3]
    assert first_block == ['pip install -r requirements.txt && python train.py',
                           'pip install -r requirements.txt && python -m pytest -q -m "not slow and not gpu"']


# ------------------------------------------------------------------------------------------------------
# The checks catch drift: each edits a copy of the README
# ------------------------------------------------------------------------------------------------------

def edited_readme(tmp_path: Path, old: str, new: str) -> Path:
    text = (REPO / "README.md").read_text()
    assert old in text, old
    copy = tmp_path / "README.md"
    copy.write_text(text.replace(old, new, 1))
    return copy


def test_drift_is_caught(tmp_path):
    # a snippet: an attention name the registry does not know
    copy = edited_readme(tmp_path, 'build_attention("moh"', 'build_attention("mho"')
    with pytest.raises(Exception, match="mho"):
        run_python_snippets(copy, tmp_path)

    # a command: an option the tool does not have (it stops before counting anything)
    copy = edited_readme(tmp_path, "python tools/flops.py model=", "python tools/flops.py modle=")
    block = next(b for b in runnable_blocks(copy) if "tools/flops.py" in b.source)
    with pytest.raises(AssertionError, match="exited 2"):
        Runner(tmp_path).run_block(block)

    # a file the text promises: the run exists, the promised name does not
    copy = edited_readme(tmp_path, "writes=routing_analysis/head_load.png", "writes=routing_analysis/head_loads.png")
    block = next(b for b in runnable_blocks(copy) if "head_loads.png" in " ".join(b.writes))
    fake = tmp_path / "run"
    (fake / "routing_analysis").mkdir(parents=True)
    (fake / "routing_analysis" / "head_load.png").write_bytes(b"")
    (fake / "routing_analysis" / "routing_analysis.json").write_text("{}")
    runner = Runner(tmp_path, run_dir=fake)
    runner.run_command = lambda *a: None  # only the promise is checked here; the commands run above
    with pytest.raises(AssertionError, match="head_loads.png"):
        runner.run_block(block)

    # what a command prints
    promised = promised_output(edited_readme(tmp_path, "- done: val/loss=", "- finished: val/loss="))
    printed = "[2026-11-26 03:14:34,276][moh_vision.apps.run][INFO] - done: val/loss=2.264, val/acc1=12.53, " \
              "val/acc5=61.28, val/count=359, best/val/acc1=12.53"
    assert unprinted(promised_output(REPO / "README.md")[:1], printed) == [] and unprinted(promised[:1], printed)

    # a quoted figure that no longer equals its record
    text = (REPO / "README.md").read_text()
    m = FIGURE.search(text)
    wrong = f"{float(m['num']) + 1:.{len(m['num'].split('.')[1]) if '.' in m['num'] else 0}f}"
    copy = edited_readme(tmp_path, m.group(0), wrong + m.group(0)[len(m["num"]):])
    assert figure_mismatches(REPO / "README.md") == [] and len(figure_mismatches(copy)) == 1

    # a file name in the prose
    copy = edited_readme(tmp_path, "`tools/sweep_report.py`", "`tools/sweep_reports.py`")
    assert missing_paths(copy) == ["tools/sweep_reports.py"]
