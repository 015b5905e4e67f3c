"""The layering rules: no file includes a header of a layer above its own.

Checked twice: by check_layers.py on the sources (against the layer table the
build writes), and by the compiler itself, which must refuse a higher layer's
header with the include directories a library is built with.
"""
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check_layers  # noqa: E402

SRC = os.environ.get("FUSION_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
BUILD = os.environ.get("FUSION_BUILD_DIR", os.path.join(SRC, "build"))
LAYERS = os.path.join(BUILD, "layers.txt")
TREE_DIRS = ["base", "kernels", "formats", "model", "text", "net", "router", "shard-server", "gateway",
             "tools", "bench"]


def test_tree_is_layered():
    problems = check_layers.check(LAYERS, SRC)
    assert problems == [], "\n".join(problems)


def test_every_library_is_recorded():
    libs = check_layers.read_layers(LAYERS)
    for name in ["fusion_base", "fusion_kernels", "fusion_formats", "fusion_model", "fusion_text",
                 "fusion_net", "fusion_router", "fusion_shard", "fusion_gateway"]:
        assert name in libs, f"{name} missing from {LAYERS}"
    # the bottom of the house links nothing of ours, the kernels only base
    assert libs["fusion_base"][2] == []
    assert libs["fusion_kernels"][2] == ["fusion_base"]
    assert libs["fusion_router"][2] == ["fusion_base"]


@pytest.fixture
def tree_copy(tmp_path):
    """A copy of the layer folders, with a layer table that points into it."""
    for d in TREE_DIRS:
        shutil.copytree(os.path.join(SRC, d), tmp_path / d)
    copied = [os.path.realpath(os.path.join(SRC, d)) for d in TREE_DIRS]

    def moved(path):  # a folder of the copied tree, in the copy; others (the build's) as they are
        real = os.path.realpath(path)
        for d in copied:
            if real == d or real.startswith(d + os.sep):
                return str(tmp_path) + real[len(os.path.realpath(SRC)):]
        return path

    lines = []
    for line in open(LAYERS):
        parts = line.rstrip("\n").split("|")
        for i in (1, 2):
            dirs = [x for x in parts[i].split(",") if x] if len(parts) > i else []
            parts[i] = ",".join(moved(x) for x in dirs)
        lines.append("|".join(parts))
    (tmp_path / "layers.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def plant(root, rel, line):
    path = root / rel
    text = path.read_text()
    path.write_text(line + "\n" + text)


def violations(root):
    return check_layers.check(str(root / "layers.txt"), str(root))


def test_copy_is_clean(tree_copy):
    assert violations(tree_copy) == []


def test_upward_include_is_caught(tree_copy):
    plant(tree_copy, "kernels/ops.c", '#include "engine.h"')
    plant(tree_copy, "net/rpc.c", '#include "gw.h"')
    plant(tree_copy, "router/rt-flow.c", '#include "model.h"')
    plant(tree_copy, "text/template/tpl-lex.c", '#include "sampler.h"')
    found = violations(tree_copy)
    assert len(found) == 4, found
    assert all(": upward: " in p for p in found), found
    assert any(p.startswith("kernels/ops.c:1: upward: fusion_kernels") and "engine.h" in p for p in found)
    assert any(p.startswith("net/rpc.c:1: upward: fusion_net") and "fusion_gateway" in p for p in found)
    assert any(p.startswith("router/rt-flow.c:1:") for p in found)
    assert any(p.startswith("text/template/tpl-lex.c:1:") for p in found)


def test_downward_and_sideways_includes_pass(tree_copy):
    plant(tree_copy, "gateway/gw-util.c", '#include "engine.h"')  # gateway > net > model
    plant(tree_copy, "model/sampler.c", '#include "ops.h"')       # model > formats > kernels
    assert violations(tree_copy) == []


def test_internal_header_from_another_folder_is_caught(tree_copy):
    plant(tree_copy, "gateway/gw-util.c", '#include "tok-impl.h"')
    found = violations(tree_copy)
    assert len(found) == 1 and ": internal: " in found[0] and "text/" in found[0], found


def test_wire_outside_net_is_caught(tree_copy):
    plant(tree_copy, "router/rt-flow.c", "#include <grpc/grpc.h>")
    plant(tree_copy, "model/engine.c", '#include "fusion.pb-c.h"')
    found = violations(tree_copy)
    kinds = sorted(p.split(": ")[1] for p in found)
    assert kinds == ["wire", "wire"], found


def test_unknown_header_is_caught(tree_copy):
    plant(tree_copy, "base/log.c", '#include "no-such-header.h"')
    found = violations(tree_copy)
    assert len(found) == 1 and ": unknown: " in found[0], found


def compile_entry(source):
    """The compile command CMake uses for `source` in the plain (not _san) library."""
    path = os.path.join(BUILD, "compile_commands.json")
    if not os.path.exists(path):
        pytest.skip("the build tree has no compile_commands.json")
    want = os.path.realpath(os.path.join(SRC, source))
    for e in json.load(open(path)):
        if os.path.realpath(e["file"]) == want and "_san" not in e.get("output", e["command"]):
            return e
    pytest.fail(f"{source} is not in compile_commands.json")


def try_compile(source, forced_header):
    """Compiles `source` as its library does, with forced_header included first."""
    e = compile_entry(source)
    args = shlex.split(e["command"]) if "command" in e else list(e["arguments"])
    out = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if a == "-c":
            continue
        out.append(a)
    out += ["-fsyntax-only", "-include", forced_header]
    return subprocess.run(out, cwd=e["directory"], capture_output=True, text=True)


@pytest.mark.parametrize("source,higher", [
    ("kernels/ops.c", "engine.h"),        # kernels cannot see model
    ("base/log.c", "ops.h"),              # base sees nothing of ours
    ("formats/gguf.c", "tokenizer.h"),    # formats cannot see text
    ("model/engine.c", "rpc.h"),          # model cannot see net
    ("router/rt-flow.c", "model.h"),      # router sees base only
    ("net/chain.c", "gw.h"),              # net cannot see the gateway
    ("shard-server/shard-core.c", "gw-swarm.h"),  # components cannot see each other
    ("gateway/gw-swarm.c", "fusion.pb-c.h"),      # generated code stays inside net
    ("shard-server/shard-rpc.c", "fusion.pb-c.h"),
])
def test_compiler_refuses_a_higher_layer(source, higher):
    r = try_compile(source, higher)
    assert r.returncode != 0, f"{source} compiled with {higher} included"
    assert higher in r.stderr and "No such file" in r.stderr, r.stderr


@pytest.mark.parametrize("source,lower", [
    ("kernels/ops.c", "status.h"),
    ("net/chain.c", "fusion.pb-c.h"),
    ("model/engine.c", "gguf.h"),
    ("gateway/gw-util.c", "router.h"),
])
def test_compiler_accepts_a_lower_layer(source, lower):
    r = try_compile(source, lower)
    assert r.returncode == 0, r.stderr
