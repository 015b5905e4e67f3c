"""config/*.options.json list every option of each program, made by its --print-config, so that they
cannot drift from the option tables: each file equals the program's output, loads back as the
defaults, and names every option its --help shows (one for the command line only in a comment)."""
import json
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import SOURCE, program  # noqa: E402

PROGRAMS = ["gateway", "shard", "finetune"]
CLI_ONLY = {"config", "help", "print-config"}


def print_config(name, *extra):
    res = subprocess.run([program(name), *extra, "--print-config"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize("name", PROGRAMS)
def test_options_file_is_generated(name):
    path = os.path.join(SOURCE, "config", f"{name}.options.json")
    with open(path) as f:
        shipped = f.read()
    assert print_config(name) == shipped, f"regenerate it: build/fusion-{name} --print-config > config/{name}.options.json"
    assert print_config(name, "--config", path) == shipped  # it loads back as the defaults
    help_text = subprocess.run([program(name), "--help"], capture_output=True, text=True, timeout=30).stdout
    flags = set(re.findall(r"^\s+(?:-\w, )?--([a-z0-9-]+)", help_text, re.M)) - CLI_ONLY
    keys = {k.lstrip("_").replace("_", "-") for k in json.loads(shipped)}  # comment-only: command line only
    assert flags <= keys, flags - keys
