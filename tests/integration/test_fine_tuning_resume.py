"""Fine-tuning jobs that lose their gateway or a shard, and jobs trained on a routed swarm.

Checks:
- Restart: a job whose gateway is SIGKILLed after its first checkpoint resumes, when the gateway
  starts again on the same --data-dir, from its last checkpoint and succeeds. Its metrics events
  are steps 1..N once each, its checkpoints are listed once each, no file is lost or doubled,
  and because a checkpoint carries the AdamW moments the resumed job ends with the adapter and
  the losses of the same job run undisturbed (same seed, same shards).
- Swarm: a gateway routing three --shard members ([0, 15) and twice [15, 30)) trains a job on a
  chain of whole spans; when the shard of the chain's second hop is SIGKILLed mid-job, the job
  goes on from its last checkpoint on the other [15, 30) shard and succeeds, and its adapter
  answers through chat.
- Queue: with --max-ft-jobs 2 two jobs train at once while a third waits.
"""
import os
import shutil
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import SOURCE, Gateway, Shard, default_model, stop_all, swarm_cluster  # noqa: E402

openai = pytest.importorskip("openai")
np = pytest.importorskip("numpy")
st_numpy = pytest.importorskip("safetensors.numpy")

KEY = "sk-resume-key"
FACTS = os.path.join(SOURCE, "tests", "data", "vellmora-facts.jsonl")
STEPS = 12  # 20 examples, batch 5, 3 epochs
HYPER = {"n_epochs": 3, "batch_size": 5, "learning_rate_multiplier": 10}
LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}


def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=2, timeout=120)


def create(c, file_id, suffix):
    base = c.models.list().data[0].id
    return c.fine_tuning.jobs.create(model=base, training_file=file_id, suffix=suffix, seed=11,
                                     method={"type": "supervised", "supervised": {"hyperparameters": HYPER}},
                                     extra_body={"lora": LORA})


def wait_status(c, job_id, statuses=("succeeded", "failed", "cancelled"), timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        j = c.fine_tuning.jobs.retrieve(job_id)
        if j.status in statuses:
            return j
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {j.status}")


def wait_past_checkpoint(c, job_id, timeout=300):
    """Waits until the job has a checkpoint and two more steps; returns the checkpoint's step."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        ckpts = c.fine_tuning.jobs.checkpoints.list(job_id).data
        steps = [e.data["step"] for e in c.fine_tuning.jobs.list_events(job_id, limit=5) if e.type == "metrics"]
        if ckpts and steps and max(steps) >= max(k.step_number for k in ckpts) + 2:
            return max(k.step_number for k in ckpts)
        time.sleep(0.3)
    raise AssertionError("no checkpoint")


def metrics(c, job_id):
    return [e.data for e in c.fine_tuning.jobs.list_events(job_id, limit=100) if e.type == "metrics"]


def adapter(data, job_id):
    return st_numpy.load_file(os.path.join(data, "jobs", job_id, "final", "adapter_model.safetensors"))


def test_gateway_restart_resumes_exactly():
    model = default_model()
    data = tempfile.mkdtemp(prefix="ft-resume-")
    a, b = Shard(model, 0, 15, threads=1), Shard(model, 15, 30, threads=1)
    route = ["--hop", a.hop(), "--hop", b.hop()]
    gw = Gateway(model, route, KEY, "--data-dir", data, "--max-loras", "32")
    try:
        c = client(gw)
        with open(FACTS, "rb") as f:
            file_id = c.files.create(file=f, purpose="fine-tune").id
        ref = create(c, file_id, "ref")
        assert wait_status(c, ref.id).status == "succeeded"
        job = create(c, file_id, "killed")
        ckpt = wait_past_checkpoint(c, job.id)
        gw.proc.kill()  # SIGKILL mid-job
        gw.proc.wait()
        gw = Gateway(model, route, KEY, "--data-dir", data, "--max-loras", "32")
        c = client(gw)
        done = wait_status(c, job.id)
        assert done.status == "succeeded", (done.error, gw.output()[-3000:])

        got = metrics(c, job.id)
        assert sorted(m["step"] for m in got) == list(range(1, STEPS + 1))  # each step once
        resumed = [e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=100) if "Resuming" in e.message]
        assert len(resumed) == 1 and int(resumed[0].split()[-1]) >= ckpt, resumed
        assert sorted(k.step_number for k in c.fine_tuning.jobs.checkpoints.list(job.id).data) == [4, 8]

        names = sorted(f.filename for f in c.files.list().data)
        assert names == sorted(["vellmora-facts.jsonl"] + 2 * ["loss_curve.svg", "step_metrics.csv", "adapter_config.json", "adapter_model.safetensors"]), names
        assert done.trained_tokens == wait_status(c, ref.id).trained_tokens

        want = {m["step"]: m["train_loss"] for m in metrics(c, ref.id)}
        assert {m["step"]: m["train_loss"] for m in got} == pytest.approx(want, rel=1e-5)
        x, y = adapter(data, ref.id), adapter(data, job.id)
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_allclose(y[k], x[k], rtol=1e-5, atol=1e-7, err_msg=k)

        answer = c.chat.completions.create(model=done.fine_tuned_model, max_tokens=4,
                                           messages=[{"role": "user", "content": "Hi"}])
        assert answer.choices[0].message.content is not None
    finally:
        stop_all(gw, (a, b), data)


def cpu_seconds(pid):
    """User + system CPU seconds of process pid so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busiest(shards):
    """The name of the shard that used the most CPU over the next second (the one training)."""
    before = {n: cpu_seconds(s.proc.pid) for n, s in shards.items()}
    time.sleep(1.0)
    return max(shards, key=lambda n: cpu_seconds(shards[n].proc.pid) - before[n])


def test_swarm_trains_and_fails_over():
    data = tempfile.mkdtemp(prefix="ft-swarm-")
    spans = {"head": (0, 15), "tail1": (15, 30), "tail2": (15, 30)}
    try:
        with swarm_cluster(spans, KEY, "--data-dir", data, "--max-loras", "32") as sc:
            gw, shards = sc["gw"], sc["shards"]
            c = client(gw)
            with open(FACTS, "rb") as f:
                file_id = c.files.create(file=f, purpose="fine-tune").id
            job = create(c, file_id, "swarm")
            wait_past_checkpoint(c, job.id)
            victim = busiest({n: shards[n] for n in ("tail1", "tail2")})
            shards[victim].stop(sig=9)
            done = wait_status(c, job.id)
            assert done.status == "succeeded", (done.error, gw.output()[-3000:])
            events = [e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=100)]
            assert any("was lost" in m for m in events), events
            assert sorted(m["step"] for m in metrics(c, job.id)) == list(range(1, STEPS + 1))
            assert not any(s.address in m for s in shards.values() for m in events)  # no internal addresses
            answer = c.chat.completions.create(model=done.fine_tuned_model, max_tokens=4,
                                               messages=[{"role": "user", "content": "Hi"}])
            assert answer.choices[0].message.content is not None
    finally:
        shutil.rmtree(data, ignore_errors=True)


def test_jobs_at_once():
    """--max-ft-jobs 2 trains two jobs at the same time; the third waits its turn, queued."""
    model = default_model()
    data = tempfile.mkdtemp(prefix="ft-many-")
    a, b = Shard(model, 0, 15, threads=1), Shard(model, 15, 30, threads=1)
    gw = Gateway(model, ["--hop", a.hop(), "--hop", b.hop()], KEY, "--data-dir", data, "--max-loras", "32",
                 "--max-ft-jobs", "2")
    try:
        c = client(gw)
        with open(FACTS, "rb") as f:
            file_id = c.files.create(file=f, purpose="fine-tune").id
        jobs = [create(c, file_id, f"many{i}") for i in range(3)]
        deadline, seen = time.time() + 120, set()
        while time.time() < deadline and len(seen) < 1:
            states = [c.fine_tuning.jobs.retrieve(j.id).status for j in jobs]
            if states[:2] == ["running", "running"] and states[2] in ("validating_files", "queued"):
                seen.add(tuple(states))
            time.sleep(0.2)
        assert seen, "the first two jobs never ran at once while the third waited"
        assert all(wait_status(c, j.id).status == "succeeded" for j in jobs)
    finally:
        stop_all(gw, (a, b), data)
