"""The home cluster of deploy/ (Dockerfile + docker-compose.yml), checked without Docker.

1. The compose file's own command lines run as local processes: the `certs` service's script
   makes the CA, certificate, swarm secret and API key; the gateway and the three shards start
   with exactly the compose arguments, except that host names become localhost, ports become
   free loopback ports and /models, /certs become local paths. The shards join over TLS, two
   get spans covering every block, the third waits as the spare, and a chat completion with
   the generated API key answers.
2. The runtime image installs a package for every shared library the built programs need.
"""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import SOURCE, default_model, program  # noqa: E402

DEPLOY = os.path.join(SOURCE, "deploy")


def compose():
    with open(os.path.join(DEPLOY, "docker-compose.yml")) as f:
        return yaml.safe_load(f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_args(command, names, ports, model, certs):
    """The compose command with host names, ports and paths made local."""
    out = []
    for arg in command[1:]:
        arg = arg.replace("/models/SmolLM2-135M-Instruct.Q4_1.gguf", model).replace("/certs", certs)
        arg = re.sub(r"0\.0\.0\.0:(\d+)", lambda m: f"127.0.0.1:{ports[('*', m.group(1))]}", arg)
        for name in names:
            arg = re.sub(rf"\b{name}:(\d+)", lambda m, n=name: f"localhost:{ports[(n, m.group(1))]}", arg)
        out.append(arg)
    return out


def get(url, key, timeout=10):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_compose_cluster_runs_locally():
    model = default_model()
    spec = compose()
    services = spec["services"]
    shards = [n for n, s in services.items() if s.get("command") and s["command"][0] == "fusion-shard"]
    assert services["gateway"]["command"][0] == "fusion-gateway"
    assert len(shards) >= 3

    work = tempfile.mkdtemp(prefix="deploy-")
    certs = os.path.join(work, "certs")
    # the certs service: its entrypoint names the script and the hosts
    entry = services["certs"]["entrypoint"][-1]
    hosts = re.search(r"fusion-make-certs /certs ([\w\- ]+?) &&", entry).group(1).split()
    assert set(hosts) >= {"gateway", *shards}
    subprocess.run(["sh", os.path.join(DEPLOY, "make-certs.sh"), certs, *hosts], check=True, capture_output=True)
    key = open(os.path.join(certs, "api-keys.txt")).read().split()[0]

    # every service listens on 0.0.0.0:PORT in its own container: give each its own loopback port
    http_port = free_port()
    ports = {}
    procs = []
    try:
        gw_cmd = services["gateway"]["command"]
        gw_ports = {("*", m) for a in gw_cmd for m in re.findall(r"0\.0\.0\.0:(\d+)", a)}
        swarm_port = re.search(r"--swarm-listen=0\.0\.0\.0:(\d+)", " ".join(gw_cmd)).group(1)
        for p in gw_ports:
            ports[p] = free_port()
        ports[("*", "8080")] = http_port
        ports[("gateway", swarm_port)] = ports[("*", swarm_port)]
        for name in shards:
            cmd = " ".join(services[name]["command"])
            listen = re.search(r"--listen=0\.0\.0\.0:(\d+)", cmd).group(1)
            ports[(name, listen)] = free_port()

        def start(name, argv):
            log = open(os.path.join(work, name + ".log"), "w+")
            procs.append((name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))

        start("gateway", [program("gateway")] + local_args(gw_cmd, [], ports, model, certs))
        for name in shards:
            own = dict(ports)
            listen = re.search(r"--listen=0\.0\.0\.0:(\d+)", " ".join(services[name]["command"])).group(1)
            own[("*", listen)] = ports[(name, listen)]
            argv = [program("shard")] + local_args(services[name]["command"], ["gateway", *shards], own, model,
                                                    certs) + ["--threads", "1"]
            start(name, argv)
            time.sleep(0.3)  # join in the compose file's order

        url = f"http://127.0.0.1:{http_port}"
        deadline = time.time() + 60
        swarm = None
        while time.time() < deadline:
            for name, p, _ in procs:
                assert p.poll() is None, f"{name} exited: " + open(os.path.join(work, name + ".log")).read()[-2000:]
            try:
                swarm = get(url + "/v1/swarm", key)
                states = [s.get("state") for s in swarm.get("servers", [])]
                if states.count("active") >= 2 and states.count("spare") >= 1 and not swarm.get("uncovered"):
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the cluster did not form: " + json.dumps(swarm))

        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.loads(r.read())
        assert "Paris" in reply["choices"][0]["message"]["content"]
        with pytest.raises(urllib.error.HTTPError) as e:
            get(url + "/v1/models", "sk-wrong")
        assert e.value.code == 401
    finally:
        for _, p, _ in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for _, p, log in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()


def runtime_packages():
    text = open(os.path.join(DEPLOY, "Dockerfile")).read()
    final = text[text.rindex("\nFROM "):]
    install = re.search(r"apt-get install[^\n]*\\\n(.*?)&& rm", final, re.S).group(1)
    return set(re.findall(r"[a-z0-9][a-z0-9.+\-]+", install.replace("\\", " "))) - {"y", "qq"}


def package_of(path):
    for p in (path, "/usr" + path if not path.startswith("/usr") else path[4:]):
        out = subprocess.run(["dpkg", "-S", p], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.split(":")[0]
    return None


def test_runtime_image_has_every_library():
    # in debian:12-slim already
    base = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"}
    have = runtime_packages() | base
    for name in ("shard", "gateway"):
        exe = program(name)
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]",
                            subprocess.run(["readelf", "-d", exe], capture_output=True, text=True).stdout)
        ldd = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
        paths = dict(re.findall(r"^\s*(\S+) => (\S+)", ldd, re.M))
        # the dynamic loader, NEEDED where the CUDA runtime is linked in, is listed by its path alone
        paths.update((os.path.basename(p), p) for p in re.findall(r"^\s*(/\S+) \(", ldd, re.M))
        for lib in needed:
            if re.search(r"cuda|cublas|nvrtc", lib):  # the image builds with FUSION_CUDA=OFF
                continue
            pkg = package_of(os.path.realpath(paths[lib])) if lib in paths else None
            assert pkg, f"{exe}: no Debian package provides {lib}"
            assert pkg.split(":")[0] in have, f"deploy/Dockerfile's runtime stage lacks {pkg} (for {lib} of {exe})"
