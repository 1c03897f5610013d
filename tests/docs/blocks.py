"""The docs' command blocks and how a test runs them (tests/docs/test_doc_blocks.py says how each is checked)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>bash|sh|shell|console|python)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M
)
# a block that goes on in another terminal (a server keeps the first): "# in a second terminal, ..."
TERMINAL = re.compile(r"^# in (?:a|another) (?:second |third )?terminal\b.*$", re.M)
MARKER = re.compile(r"<!-- doc-test: (?P<how>.+?) -->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    how: str | None  # the marker's text, None when the block has none
    body: str
    lang: str = "bash"

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def command_blocks(path: Path) -> list[Block]:
    """The shell blocks of a markdown file, each with the marker on the line before it (if any)."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        line = text.count("\n", 0, m.start()) + 1
        how = marker["how"].strip() if marker else None
        found.append(Block(path, line, how, m["body"], m["lang"]))
    return found


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in command_blocks(path)]


def all_marked(test: str) -> list[Block]:
    """The blocks whose marker names test function `test` (of any test file), in the docs' order."""
    return [b for b in all_blocks() if (b.how or "").endswith(f"::{test}")]


def marked(test: str) -> Block:
    """The one block that test function `test` runs; a block repeated in two docs must be the same in both."""
    blocks = all_marked(test)
    assert blocks and all(b.body == blocks[0].body for b in blocks), [b.where() for b in blocks]
    return blocks[0]


def terminals(block: Block) -> list[str]:
    """The block's commands per terminal: a `# in a second terminal` line starts the next one."""
    return [part.strip("\n") + "\n" for part in TERMINAL.split(block.body)]


def marker_problem(block: Block) -> str | None:
    """Why a block's marker does not say how it is run; None when it does: a test that takes this block
    by its own name (marked / all_marked) and runs it, or a skip with its reason."""
    if block.how is None:
        return "no <!-- doc-test: ... --> marker on the line before it"
    if block.how.startswith("skip:"):
        return None if block.how[5:].strip() else "a skip marker without its reason"
    file, _, test = block.how.partition("::")
    if not (ROOT / file).is_file():
        return f"it names {file}, which does not exist"
    source = (ROOT / file).read_text()
    if not test or f"def {test}(" not in source:
        return f"it names {block.how}, which is not a test of that file"
    if f'marked("{test}")' not in source:
        return f"{block.how} does not take its block (marked or all_marked with its own name)"
    return None


def as_script(block: Block | str, **placeholders: str) -> str:
    """The block (or some of its lines) with each `<name>` placeholder replaced (`your_dir` fills
    `<your-dir>`); every placeholder it has must be given."""
    body = block if isinstance(block, str) else block.body
    for name, value in placeholders.items():
        body = body.replace(f"<{name.replace('_', '-')}>", value)
    left = re.findall(r"<[a-z][a-z-]*>", body)
    assert not left, f"no value for {left} in {body}"
    return "set -euo pipefail\n" + body


def user_env(home: Path | None = None) -> dict[str, str]:
    """A user's shell: HOME (this one's, or `home`: a new user's, whose ~/.prefect, ~/.ray and DVC cache
    start empty), PATH without the venv, the locale; none of the variables the test session set."""
    keep = ("HOME", "USER", "LANG", "LC_ALL", "TMPDIR")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", **{k: os.environ[k] for k in keep if k in os.environ}}
    return env | ({"HOME": str(home)} if home else {})


def run_block(
    script: str, timeout_s: int, cwd: Path = ROOT, home: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=user_env(home), capture_output=True, text=True, timeout=timeout_s
    )


class Terminal:
    """Commands that keep a terminal (a server), run in the background from `cwd`; what they print goes to
    `log`."""

    def __init__(self, script: str, cwd: Path, log: Path, home: Path | None = None):
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", script],
                cwd=cwd,
                env=user_env(home),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def said(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """Ctrl-C, as a user stops it; then the rest of its process group (a non-interactive shell's `&` jobs
        ignore Ctrl-C), killed if it outlives 30 s."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                self.proc.poll()  # the shell reaped, else its zombie keeps the group alive
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    self.proc.wait()
                    return
                time.sleep(0.5)
        self.proc.wait(10)
