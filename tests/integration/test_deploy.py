"""The home cluster of deploy/ (Dockerfiles + compose files), checked without Docker.

1. Both compose files (docker-compose.yml, CPU; docker-compose.gpu.yml, NVIDIA GPUs) validate
   against the Compose Specification's JSON schema (tests/data/compose-spec.json), build every
   service from its own `build:` section, keep the model in a cache volume and publish the
   gateway's swarm port.
2. Each compose file's own command lines run as local processes: the `certs` service's script
   makes the CA, certificate, swarm secret and API key; the `model` service's script fills the
   model cache; the shards start with exactly the compose arguments (host names become
   localhost, ports free loopback ports, /certs and the cache local paths, --device=cuda the
   CPU), their healthcheck (fusion-ping, the shard's Health RPC) fails before a shard listens
   or with a wrong secret and passes once it does; then the gateway starts (it depends on the
   shards being healthy), its healthcheck (curl on /health, 503 until a full chain can serve)
   fails before it listens and passes once the shards cover the model, and a chat completion
   with the generated API key answers.
3. The runtime images install a package for every shared library the built programs need (the
   CUDA image computes its list in the build stage).
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import jsonschema
import pytest
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import SOURCE, default_model, program  # noqa: E402

DEPLOY = os.path.join(SOURCE, "deploy")
SCHEMA = os.path.join(SOURCE, "tests", "data", "compose-spec.json")
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.gpu.yml"]
CACHE = "/var/lib/fusion/cache"  # FUSION_CACHE in the images, the `models` volume
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the images' commands and where they are here
IMAGE_SCRIPTS = {"fusion-make-certs": os.path.join(DEPLOY, "make-certs.sh"),
                 "fusion-fetch-default-model": os.path.join(SOURCE, "scripts", "fetch-default-model.sh")}


def compose(name):
    with open(os.path.join(DEPLOY, name)) as f:
        return yaml.safe_load(f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_program(word):
    if word in IMAGE_SCRIPTS:
        return IMAGE_SCRIPTS[word]
    if word.startswith("fusion-"):
        return program(word[len("fusion-"):])
    return shutil.which(word) or pytest.fail(f"{word} is not installed here")


def local_args(command, names, ports, certs, cache):
    """A compose command (or healthcheck) with host names, ports, paths and devices made local."""
    out = [local_program(command[0])]
    for arg in command[1:]:
        arg = arg.replace(CACHE, cache).replace("/certs", certs)
        arg = re.sub(r"^--device=cuda(:\d+)?$", "--device=cpu", arg)
        arg = re.sub(r"(0\.0\.0\.0|localhost):(\d+)", lambda m: f"{'127.0.0.1' if m.group(1)[0] == '0' else 'localhost'}"
                     f":{ports[('*', m.group(2))]}", arg)
        for name in names:
            arg = re.sub(rf"\b{name}:(\d+)", lambda m, n=name: f"localhost:{ports[(n, m.group(1))]}", arg)
        out.append(arg)
    return out


def get(url, key, timeout=10):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def healthcheck(service):
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD", test
    return test[1:]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_is_valid(name):
    with open(SCHEMA) as f:
        schema = json.load(f)
    validator = jsonschema.Draft201909Validator(schema)
    spec = compose(name)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(spec)]
    assert not errors, errors
    # the schema itself catches a wrong key (the check is not vacuous)
    assert list(validator.iter_errors(dict(spec, services={"x": {"healthcheck": {"tset": []}}})))
    services = spec["services"]
    assert "models" in spec["volumes"] and "certs" in spec["volumes"]
    for sname, s in services.items():
        assert "build" in s and "image" not in s, f"{sname}: its own build:, no image of another service"
        assert s["build"]["dockerfile"].startswith("deploy/Dockerfile")
        if s.get("command"):  # the gateway and the shards: the model from the cache volume
            assert any(v.endswith(":" + CACHE) for v in s["volumes"]), sname
            assert f"--model={CACHE}/models/{MODEL_FILE}" in s["command"], sname
            assert "healthcheck" in s, sname
            for dep, cond in s["depends_on"].items():
                want = "service_healthy" if services[dep].get("command") else "service_completed_successfully"
                assert cond["condition"] == want, (sname, dep)
    assert services["model"]["build"]["target"] == "fetch"
    gateway = services["gateway"]
    swarm_port = re.search(r"--swarm-listen=0\.0\.0\.0:(\d+)", " ".join(gateway["command"])).group(1)
    assert f"{swarm_port}:{swarm_port}" in gateway["ports"]
    gpu = [n for n, s in services.items() if "deploy" in s]
    if name == "docker-compose.gpu.yml":
        assert len(gpu) >= 1
        for n in gpu:
            s = services[n]
            assert s["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
            (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
            assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
            assert "count" in dev or "device_ids" in dev
            assert any(re.match(r"--device=cuda", a) for a in s["command"]), n
    else:
        assert not gpu


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_cluster_runs_locally(name):
    model = default_model()
    spec = compose(name)
    services = spec["services"]
    shards = [n for n, s in services.items() if s.get("command") and s["command"][0] == "fusion-shard"]
    assert services["gateway"]["command"][0] == "fusion-gateway"
    assert len(shards) >= 3

    work = tempfile.mkdtemp(prefix="deploy-")
    certs = os.path.join(work, "certs")
    cache = os.path.join(work, "cache")
    # the certs service: its entrypoint names the script and the hosts
    entry = services["certs"]["entrypoint"][-1]
    hosts = re.search(r"fusion-make-certs /certs ([\w\- ]+?) &&", entry).group(1).split()
    assert set(hosts) >= {"gateway", *shards}
    subprocess.run(["sh", IMAGE_SCRIPTS["fusion-make-certs"], certs, *hosts], check=True, capture_output=True)
    key = open(os.path.join(certs, "api-keys.txt")).read().split()[0]
    # the model service fills the cache volume; the model is here already, so it only checks it
    os.makedirs(os.path.join(cache, "models"))
    os.symlink(model, os.path.join(cache, "models", MODEL_FILE))
    out = subprocess.run(local_args(services["model"]["entrypoint"], [], {}, certs, cache), capture_output=True,
                         text=True, env=dict(os.environ, FUSION_CACHE=cache), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == os.path.join(cache, "models", MODEL_FILE)

    # every service listens on 0.0.0.0:PORT in its own container: give each its own loopback port
    ports = {}
    procs = []
    gw_cmd = services["gateway"]["command"]
    for p in {m for a in gw_cmd for m in re.findall(r"0\.0\.0\.0:(\d+)", a)}:
        ports[("gateway", p)] = free_port()
    for n in shards:
        listen = re.search(r"--listen=0\.0\.0\.0:(\d+)", " ".join(services[n]["command"])).group(1)
        ports[(n, listen)] = free_port()

    def own(service):
        """The ports map as `service` sees it: its own 0.0.0.0 and localhost ports."""
        mine = dict(ports)
        mine.update({("*", p): v for (n, p), v in ports.items() if n == service})
        return mine

    def check(service, argv_of, want_ok):
        argv = local_args(argv_of, ["gateway", *shards], own(service), certs, cache)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert (r.returncode == 0) == want_ok, f"{service} healthcheck {argv}: {r.returncode} {r.stdout} {r.stderr}"

    def start(service):
        argv = local_args(services[service]["command"], ["gateway", *shards], own(service), certs, cache)
        if service != "gateway":
            argv.append("--threads=1")
        log = open(os.path.join(work, service + ".log"), "w+")
        procs.append((service, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))

    def alive():
        for n, p, _ in procs:
            assert p.poll() is None, f"{n} exited: " + open(os.path.join(work, n + ".log")).read()[-2000:]

    def until(ok, what, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            alive()
            if ok():
                return
            time.sleep(0.2)
        pytest.fail(what)

    def passes(service, argv_of):
        argv = local_args(argv_of, ["gateway", *shards], own(service), certs, cache)
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0

    try:
        # the shards first (the gateway depends on them being healthy): none listens yet
        check(shards[0], healthcheck(services[shards[0]]), False)
        for n in shards:
            start(n)
        for n in shards:
            until(lambda n=n: passes(n, healthcheck(services[n])), f"{n}'s healthcheck never passed")
        wrong = os.path.join(work, "wrong.secret")
        with open(wrong, "w") as f:
            f.write("not-the-swarm-secret-0123456789\n")
        bad = [a.replace("/certs/swarm.secret", wrong) for a in healthcheck(services[shards[0]])]
        check(shards[0], bad, False)

        # the gateway: healthy only once it listens and the shards joined and cover the model
        gw_check = healthcheck(services["gateway"])
        check("gateway", gw_check, False)
        start("gateway")
        http_port = ports[("gateway", re.search(r"--listen=0\.0\.0\.0:(\d+)", " ".join(gw_cmd)).group(1))]
        url = f"http://127.0.0.1:{http_port}"

        def states():
            try:
                return get(url + "/v1/swarm", key)
            except OSError:
                return None

        swarm = None

        def formed():
            nonlocal swarm
            swarm = states()
            if not swarm:
                return False
            st = [s.get("state") for s in swarm.get("servers", [])]
            # every member joined and every block is covered. Who serves depends on the join order:
            # the two half-model shards first (both serve, the whole-model one waits as the spare),
            # or the whole-model shard first (it serves alone and the halves wait: neither adds
            # flow by itself, and one spare is wanted)
            joined = st.count("active") + st.count("spare") == len(shards)
            return joined and st.count("active") >= 1 and swarm.get("uncovered_blocks") == 0

        try:
            until(formed, "the cluster did not form", timeout=120)
        except BaseException:
            print("the swarm as last seen:", json.dumps(swarm))
            raise
        until(lambda: passes("gateway", gw_check), "the gateway's healthcheck never passed: " + json.dumps(swarm))

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


def test_images_have_the_healthcheck_commands():
    # the shard's (fusion-ping) is built into both images, the gateway's (curl) installed
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = open(os.path.join(DEPLOY, dockerfile)).read()
        assert re.search(r"--target [^\n]*\bfusion-ping\b", text), dockerfile
        final = text[text.rindex("\nFROM "):]
        assert re.search(r"apt-get install[^\n]*\\\n\s+[^\n]*\bcurl\b", final), dockerfile
    assert "curl" in runtime_packages()
    for name in COMPOSE_FILES:
        for sname, s in compose(name)["services"].items():
            if "healthcheck" in s:
                assert healthcheck(s)[0] in ("curl", "fusion-ping"), (name, sname)


def test_cuda_image():
    text = open(os.path.join(DEPLOY, "Dockerfile.cuda")).read()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(froms) == 2
    assert re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-devel-ubuntu[\d.]+", froms[0])
    assert re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-runtime-ubuntu[\d.]+", froms[1])
    assert froms[0].split("-devel-")[1] == froms[1].split("-runtime-")[1]  # the same Ubuntu
    assert "-DFUSION_CUDA=ON" in text and "FUSION_CUDA:BOOL=ON" in text  # fails rather than build CPU-only
    # the runtime stage installs the packages of the libraries that ldd finds in the build stage
    assert "/out/runtime-packages" in text[text.rindex("\nFROM "):]


def test_fusion_ping():
    # against the stand-in shard server: serving with the secret; refused without it; a usage error
    secret = "ping-test-secret-0123456789"
    echo = subprocess.Popen([program("rpc-echo"), "--insecure"], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, FUSION_SWARM_SECRET=secret))
    try:
        target = f"127.0.0.1:{int(echo.stdout.readline().split()[1])}"

        def ping(*args, env_secret=None):
            env = {k: v for k, v in os.environ.items() if k != "FUSION_SECRET"}
            if env_secret:
                env["FUSION_SECRET"] = env_secret
            return subprocess.run([program("ping"), "--insecure", *args], capture_output=True, text=True, env=env,
                                  timeout=30)

        r = ping(target, env_secret=secret)
        assert r.returncode == 0 and r.stdout == f"{target}: serving\n", r
        assert ping(target, env_secret="wrong-secret-0123456789").returncode == 1
        assert ping(target).returncode == 2  # no secret
        assert ping(env_secret=secret).returncode == 2  # no address
    finally:
        echo.terminate()
        echo.wait(20)
