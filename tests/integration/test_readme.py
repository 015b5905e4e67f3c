"""README.md's command blocks, run as written against a real local setup.

Every fenced ```sh / ```bash / ```console / ```python block of README.md runs, in order within its
`## ` section, each section in one bash session (so a block may use what an earlier one of its section
set, e.g. a file id), from a directory where `build/` is the build tree and `tests/`, `config/`,
`scripts/`, ... are the source tree's. The setup is what the README's "Serve and chat" says:
`fusion serve` on the default model (two shards, one thread each) with a known API key and swarm secret
in FUSION_API_KEY / FUSION_SECRET and the gateway's URL in FUSION_URL. The README's fixed addresses are
made local: localhost:8080 becomes the gateway's free port, the shards' 127.0.0.1:7001/7002 free ports.
In a block whose lines start with `$ ` (a transcript), only those lines (and their continuations) run.

A block that cannot run here is marked right before it with
`<!-- readme-test: skip (REASON) -->`; every such block is listed with its reason. The opening section
is another document's (its two commands are what CI runs), so its block is listed here instead.
Each block must exit 0; curl blocks must print JSON without an "error", and the blocks that talk to the
API print what they are expected to (a completion, a file, a job, a fine-tuned model's name).
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import BUILD, SOURCE, default_model, wait_for  # noqa: E402

README = os.path.join(SOURCE, "README.md")
LANGS = {"sh", "bash", "console", "python"}
SKIP_RE = re.compile(r"<!--\s*readme-test:\s*skip\s*\((.+)\)\s*-->\s*$")
# The opening section belongs to another document; its commands are the ones CI runs.
OPENING_SKIP = "scripts/run.sh and scripts/test.sh: CI runs both"
KEY = "sk-readme-test-0123456789"
SECRET = "readme-test-secret-0123456789"
SECTION_TIMEOUT = 150


class Block:
    def __init__(self, section, line, lang, text, skip):
        self.section, self.line, self.lang, self.text, self.skip = section, line, lang, text, skip

    def __repr__(self):
        return f"README.md:{self.line} ({self.section})"


def parse(path=README):
    """The README's command blocks in order, each with its `## ` section and skip reason (or None)."""
    blocks, section, prev = [], "", ""
    lines = open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence:
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            lang = fence.group(1)
            if lang in LANGS:
                m = SKIP_RE.match(prev.strip())
                skip = m.group(1) if m else (OPENING_SKIP if section == "" else None)
                blocks.append(Block(section, start, lang, "\n".join(body) + "\n", skip))
            prev = ""
        else:
            if line.startswith("## "):
                section = line[3:].strip()
            if line.strip():
                prev = line
        i += 1
    return blocks


def commands(block):
    """The shell text of a block: a transcript's `$ ` lines and their continuations, else all of it."""
    if block.lang == "python":
        return block.text
    lines = block.text.splitlines()
    if not any(line.startswith("$ ") for line in lines):
        return block.text
    out, cont = [], False
    for line in lines:
        if line.startswith("$ ") or cont:
            out.append(line[2:] if line.startswith("$ ") and not cont else line)
            cont = line.endswith("\\")
    return "\n".join(out) + "\n"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_blocks_are_parsed_and_skips_have_reasons():
    blocks = parse()
    assert len(blocks) >= 10, blocks
    for b in blocks:
        assert b.skip is None or b.skip.strip(), b
        assert b.text.strip(), b
    runnable = [b for b in blocks if not b.skip]
    assert any("/v1/chat/completions" in b.text for b in runnable), "no chat completion block runs"
    print("\nskipped README blocks:")
    for b in blocks:
        if b.skip:
            print(f"  {b!r}: {b.skip}")


@pytest.fixture(scope="module")
def setup():
    model = default_model()
    work = tempfile.mkdtemp(prefix="readme-")
    # the README's relative paths: build/ is the build tree, the rest the source tree
    os.symlink(os.path.abspath(BUILD), os.path.join(work, "build"))
    for name in ("tests", "config", "scripts", "deploy", "bench", "docs"):
        os.symlink(os.path.abspath(os.path.join(SOURCE, name)), os.path.join(work, name))
    port = free_port()
    # a fresh data directory: the jobs of earlier runs would be served again and fill --max-loras
    env = dict(os.environ, FUSION_API_KEY=KEY, FUSION_SECRET=SECRET, FUSION_URL=f"http://localhost:{port}",
               XDG_DATA_HOME=os.path.join(work, "data"))
    env.pop("OPENAI_API_KEY", None)
    log = open(os.path.join(work, "serve.log"), "w+")
    serve = subprocess.Popen([os.path.join(BUILD, "fusion"), "serve", "--shards", "2", "--threads", "1",
                              "--port", str(port), "--log-dir", os.path.join(work, "serve-logs")],
                             stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)

    def banner():
        log.seek(0)
        assert serve.poll() is None, f"fusion serve exited {serve.returncode}: {log.read()}"
        return "Press Ctrl-C to stop." in log.read()

    try:
        wait_for(banner, "fusion serve's banner", timeout=120)
        subs = [("localhost:8080", f"localhost:{port}"), ("127.0.0.1:7001", f"127.0.0.1:{free_port()}"),
                ("127.0.0.1:7002", f"127.0.0.1:{free_port()}")]
        home_model = os.path.expanduser("~/.cache/fusion/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.realpath(home_model) != os.path.realpath(model):
            subs.append(("~/.cache/fusion/models/SmolLM2-135M-Instruct.Q4_1.gguf", model))
        yield {"work": work, "env": env, "subs": subs, "port": port}
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGINT)
            try:
                serve.wait(45)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
        shutil.rmtree(work, ignore_errors=True)


def json_values(text):
    """The JSON values printed one after another in text (other lines are skipped)."""
    out, dec, i = [], json.JSONDecoder(), 0
    while i < len(text):
        j = text.find("{", i)
        if j < 0:
            break
        try:
            v, i = dec.raw_decode(text, j)
            out.append(v)
        except ValueError:
            i = j + 1
    return out


def check_output(block, out):
    """What a block's output must show beyond its exit status."""
    text = block.text
    if "curl" in text:
        values = json_values(out)
        assert values, f"{block!r} printed no JSON:\n{out}"
        for v in values:
            assert not v.get("error"), f"{block!r} got an error:\n{out}"
        if "/v1/chat/completions" in text:
            chats = [v for v in values if v.get("object") == "chat.completion"]
            assert chats and chats[0]["choices"][0]["message"]["content"], out
        if "/v1/models" in text:
            assert any(v.get("object") == "list" for v in values), out
        if "-F purpose=fine-tune" in text and "FILE=$(" not in text:
            assert any(str(v.get("id", "")).startswith("file-") for v in values), out
        if "/v1/fine_tuning/jobs" in text and "-d" in text:
            assert any(v.get("object") == "fine_tuning.job" for v in values), out
        if "/events" in text:
            assert any(v.get("object") == "list" and v.get("data") for v in values), out
    if "fusion-finetune" in text and "$ " in text:
        last = out.strip().splitlines()[-1]
        expected = block.text.strip().splitlines()[-1]
        assert re.fullmatch(re.escape(expected.rsplit(":", 1)[0]) + r":ftjob-[0-9a-f]+", last), (expected, out)
    if block.lang == "python" and "chat.completions.create" in text:
        assert out.strip(), f"{block!r} printed no answer"


def sections():
    order = []
    for b in parse():
        if b.section not in order:
            order.append(b.section)
    return order


@pytest.mark.parametrize("section", [s for s in sections() if any(not b.skip for b in parse() if b.section == s)])
def test_section_runs(setup, section):
    blocks = [b for b in parse() if b.section == section]
    work = setup["work"]
    script = ["set -eo pipefail", f'cd "{work}"']
    for n, b in enumerate(blocks):
        if b.skip:
            continue
        body = commands(b)
        for old, new in setup["subs"]:
            body = body.replace(old, new)
        if b.lang == "python":
            body = f'"{sys.executable}" - <<\'README_PYTHON_EOF\'\n{body}README_PYTHON_EOF\n'
        script += [f"printf '\\n@@readme-block {n} start\\n'", body.rstrip("\n"),
                   f"printf '\\n@@readme-block {n} end\\n'"]
    path = os.path.join(work, "section.sh")
    with open(path, "w") as f:
        f.write("\n".join(script) + "\n")
    out_path = os.path.join(work, "section.out")
    with open(out_path, "w") as out:
        proc = subprocess.Popen(["bash", path], stdout=out, stderr=subprocess.STDOUT, env=setup["env"], cwd=work,
                                start_new_session=True)
        try:
            rc = proc.wait(SECTION_TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            try:  # what the section started in the background (shards) goes with it
                os.killpg(proc.pid, signal.SIGTERM)
                time.sleep(0.5)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    text = open(out_path, errors="replace").read()
    parts = re.split(r"^@@readme-block (\d+) (start|end)\n", text, flags=re.M)
    outputs, ended = {}, set()
    for i in range(1, len(parts) - 1, 3):
        n, what, after = int(parts[i]), parts[i + 1], parts[i + 2]
        if what == "start":
            outputs[n] = after
        else:
            ended.add(n)
    for n, b in enumerate(blocks):
        if b.skip:
            continue
        assert n in ended, f"{b!r} failed (status {rc}):\n{b.text}\n--- output:\n{outputs.get(n, text)[-4000:]}"
        check_output(b, outputs[n])
    assert rc == 0, f"section {section!r} exited {rc}:\n{text[-3000:]}"
