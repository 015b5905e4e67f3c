"""The `fusion` command on the real default model (SmolLM2-135M-Instruct Q4_1, 30 blocks).

`fusion serve --shards 2` starts a gateway and two shards on a free port and prints the URL and the API
key; `fusion status` shows both shards active with their spans; `fusion chat`, driven in tmux, streams an
answer to a question, and `/reset` and `/exit` work; a Ctrl-C (SIGINT to serve's process group, as a
terminal sends it) stops serve with status 0 and leaves none of its children running. Also: serve on a port
in use and serve of a missing model fail with one line and status 1; `fusion ls` lists the default model;
`fusion --help` and every subcommand's --help work.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import BUILD, default_model, wait_for  # noqa: E402

FUSION = os.path.join(BUILD, "fusion")
COMMANDS = ["serve", "join", "chat", "pull", "ls", "status"]


def fusion(*args, timeout=60, env=None):
    return subprocess.run([FUSION] + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env or os.environ)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid):
    """The pids of pid's children (from /proc)."""
    out = set()
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir):
        with open(f"{task_dir}/{tid}/children") as f:
            out.update(int(x) for x in f.read().split())
    return out


def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_help():
    res = fusion("--help")
    assert res.returncode == 0 and all(c in res.stdout for c in COMMANDS), res.stdout
    for c in COMMANDS:
        res = fusion(c, "--help")
        assert res.returncode == 0 and f"usage: fusion {c}" in res.stdout and "Exit status" in res.stdout, (c, res)
    res = fusion("frobnicate")
    assert res.returncode == 2 and "unknown command 'frobnicate'" in res.stderr, res


def test_ls_lists_the_default_model():
    model = default_model()
    res = fusion("ls")
    assert res.returncode == 0, res.stderr
    names = {line.split()[0]: line for line in res.stdout.splitlines()[1:]}
    assert "SmolLM2-135M-Instruct.Q4_1" in names and model in names["SmolLM2-135M-Instruct.Q4_1"], res.stdout
    assert re.search(r"\d+(\.\d+)? MiB", names["SmolLM2-135M-Instruct.Q4_1"]), res.stdout


def test_serve_errors_are_one_line():
    default_model()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = fusion("serve", "--port", str(port), timeout=30)
    assert res.returncode == 1, res
    assert res.stderr.strip() == f"fusion serve: port {port} is in use: pass --port", res.stderr
    res = fusion("serve", "--port", str(free_port()), "/no/such/model.gguf", timeout=30)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "model '/no/such/model.gguf' not found" in res.stderr, res.stderr


class Tmux:
    """A tmux server of its own running one command in a detached session."""

    def __init__(self, command, env):
        self.sock = f"fusion-test-{os.getpid()}"
        self.env = env
        self.run("new-session", "-d", "-s", "chat", "-x", "160", "-y", "50", command)

    def run(self, *args):
        return subprocess.run(["tmux", "-L", self.sock] + list(args), capture_output=True, text=True, env=self.env,
                              timeout=10)

    def screen(self):
        return self.run("capture-pane", "-p", "-J", "-t", "chat").stdout

    def alive(self):
        return self.run("has-session", "-t", "chat").returncode == 0

    def type(self, text):
        self.run("send-keys", "-t", "chat", "-l", text)
        self.run("send-keys", "-t", "chat", "Enter")

    def close(self):
        self.run("kill-server")


def start_serve(tmp):
    port = free_port()
    out = open(os.path.join(tmp, "serve.out"), "w+")
    proc = subprocess.Popen([FUSION, "serve", "--shards", "2", "--threads", "1", "--port", str(port)],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def banner():
        out.seek(0)
        text = out.read()
        assert proc.poll() is None, f"fusion serve exited {proc.returncode}: {text}"
        return "Press Ctrl-C to stop." in text

    wait_for(banner, "fusion serve's banner", timeout=90)
    out.seek(0)
    return proc, out, port, out.read()


def check_status(url, key):
    res = fusion("status", "--url", url, "--api-key", key)
    assert res.returncode == 0, res
    assert "health: ok" in res.stdout, res.stdout
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith("127.0.0.1:")]
    assert sorted((r[1], r[2]) for r in rows) == [("0:15", "active"), ("15:30", "active")], res.stdout
    assert re.search(r"gateway\s+-> 127\.0\.0\.1:\d+", res.stdout), res.stdout
    assert re.search(r"planned [0-9.]+ decode tokens/s for \d+-token prompts", res.stdout), res.stdout


def check_chat(url, key, tmp):
    env = dict(os.environ, FUSION_API_KEY=key, TMUX_TMPDIR=tmp)
    chat = Tmux(f"{FUSION} chat --url {url} --max-tokens 24 --temperature 0; echo chat-status=$?; sleep 30", env)
    try:
        wait_for(lambda: ">>> " in chat.screen(), "the chat prompt", timeout=30)
        chat.type("What is the capital of France?")
        wait_for(lambda: chat.screen().count(">>> ") >= 2, "an answer and the next prompt", timeout=60)
        screen = chat.screen()
        answer = screen.split("What is the capital of France?", 1)[1].split(">>> ", 1)[0].strip()
        assert answer and "fusion chat:" not in screen, screen
        chat.type("/reset")
        wait_for(lambda: "(the conversation is forgotten)" in chat.screen(), "/reset's answer", timeout=10)
        chat.type("/exit")
        wait_for(lambda: "chat-status=0" in chat.screen(), "chat to leave with status 0", timeout=10)
    finally:
        chat.close()


def test_serve_status_chat_and_ctrl_c():
    default_model()
    tmp = tempfile.mkdtemp(prefix="fusion-cli-")
    proc, out, port, text = start_serve(tmp)
    try:
        kids = children(proc.pid)
        assert len(kids) == 3, (kids, text)  # the gateway and two shards
        key = re.search(r"API key: (\S+)", text).group(1)
        url = f"http://127.0.0.1:{port}"
        assert f"URL:     {url}/v1" in text and f"Swarm:   {url}/" in text, text
        check_status(url, key)
        check_chat(url, key, tmp)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert proc.wait(45) == 0, out.read()
        left = [k for k in kids if running(k)]
        assert not left, f"children still running after Ctrl-C: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for k in children(proc.pid) if running(proc.pid) else []:
            os.kill(k, signal.SIGKILL)
