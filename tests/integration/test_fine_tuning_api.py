"""fusion-gateway's /v1/fine_tuning/jobs through the official openai SDK, trained over a 2-shard chain.

Checks: a job on tests/data/vellmora-facts.jsonl (LoRA r 16, 8 epochs of batch 5, lr 2e-4 x 10 with
cosine decay), validated on five of its lines, runs validating_files -> running -> succeeded with an
estimated_finish while it runs; it has metrics events (the validation loss at each epoch's end), one
checkpoint per epoch but the last (each a served model, its metrics with full_valid_loss), a metrics CSV,
an SVG loss curve and the adapter in PEFT's format as its result files, and its fine_tuned_model answers the facts at once through
chat.completions and is listed by /v1/models with the base as parent.
Besides: a queued job is cancelled, jobs.list pages with limit/after, a method.type other than
"supervised" is BadRequestError naming "method.type", another key's job is NotFoundError.
"""
import os
import sys
import tempfile
import time
import json
import xml.etree.ElementTree as ET

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from shard_cluster import SOURCE, Gateway, Shard, default_model, stop_all  # noqa: E402

openai = pytest.importorskip("openai")
st_load = pytest.importorskip("safetensors.numpy").load

KEY, OTHER = "sk-ft-key", "sk-ft-other"
FACTS = os.path.join(SOURCE, "tests", "data", "vellmora-facts.jsonl")
EPOCHS, BATCH = 8, 5
HYPER = {"n_epochs": EPOCHS, "batch_size": BATCH, "learning_rate_multiplier": 10}
LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def cluster():
    model = default_model()
    data = tempfile.mkdtemp(prefix="ft-data-")
    a, b = Shard(model, 0, 15, threads=2), Shard(model, 15, 30, threads=2)
    gw = Gateway(model, ["--hop", a.hop(), "--hop", b.hop()], KEY, "--api-key", OTHER, "--data-dir", data,
                 "--max-loras", "32")
    try:
        yield dict(gw=gw, model=model)
    finally:
        stop_all(gw, (a, b), data)


def client(gw, key=KEY):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def base_id(cluster):
    return client(cluster["gw"]).models.list().data[0].id


@pytest.fixture(scope="module")
def training_file(cluster):
    with open(FACTS, "rb") as f:
        return client(cluster["gw"]).files.create(file=f, purpose="fine-tune").id


@pytest.fixture(scope="module")
def validation_file(cluster):
    with open(FACTS, "rb") as f:
        lines = f.read().splitlines(keepends=True)[:5]
    return client(cluster["gw"]).files.create(file=("valid.jsonl", b"".join(lines)), purpose="fine-tune").id


@pytest.fixture(scope="module")
def job(cluster, base_id, training_file, validation_file):
    """The main job, created first (the runner takes jobs oldest first)."""
    c = client(cluster["gw"])
    return c.fine_tuning.jobs.create(model=base_id, training_file=training_file, validation_file=validation_file,
                                     suffix="vellmora", seed=7,
                                     method={"type": "supervised", "supervised": {"hyperparameters": HYPER}},
                                     extra_body={"lora": LORA})


def test_created(job, base_id, training_file):
    assert job.object == "fine_tuning.job" and job.id.startswith("ftjob-")
    assert job.model == base_id and job.training_file == training_file
    assert job.status in ("validating_files", "queued", "running")
    assert job.hyperparameters.n_epochs == EPOCHS and job.hyperparameters.batch_size == BATCH
    assert job.fine_tuned_model is None and job.seed == 7


def test_bad_method_type(cluster, base_id, training_file):
    with pytest.raises(openai.BadRequestError) as e:
        client(cluster["gw"]).fine_tuning.jobs.create(model=base_id, training_file=training_file,
                                                      method={"type": "dpo"})
    assert e.value.body["param"] == "method.type"


def test_bad_model_and_file(cluster, base_id, training_file):
    c = client(cluster["gw"])
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(model="gpt-4o", training_file=training_file)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client(cluster["gw"], OTHER).fine_tuning.jobs.create(model=base_id, training_file=training_file)
    assert e.value.body["param"] == "training_file"
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(model=base_id, training_file=training_file, suffix="no spaces")
    assert e.value.body["param"] == "suffix"


def test_cancel_queued_job(cluster, job, base_id, training_file):
    c = client(cluster["gw"])
    second = c.fine_tuning.jobs.create(model=base_id, training_file=training_file, suffix="cancelled")
    got = c.fine_tuning.jobs.cancel(second.id)
    assert got.id == second.id and got.status == "cancelled"
    assert c.fine_tuning.jobs.retrieve(second.id).status == "cancelled"
    messages = [e.message for e in c.fine_tuning.jobs.list_events(second.id)]
    assert any("cancelled" in m for m in messages), messages


def test_list_pages(cluster, job):
    c = client(cluster["gw"])
    first = c.fine_tuning.jobs.list(limit=1)
    assert len(first.data) == 1 and first.has_more
    rest = c.fine_tuning.jobs.list(limit=10, after=first.data[0].id)
    ids = [first.data[0].id] + [j.id for j in rest.data]
    assert job.id in ids and len(set(ids)) == len(ids) and not rest.has_more


def test_other_key_sees_nothing(cluster, job):
    other = client(cluster["gw"], OTHER)
    with pytest.raises(openai.NotFoundError):
        other.fine_tuning.jobs.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        other.fine_tuning.jobs.cancel(job.id)
    assert other.fine_tuning.jobs.list().data == []


def wait_done(c, job_id, timeout=600, seen=None):
    """The job once it has ended; the estimated_finish values seen while it ran go into seen."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        j = c.fine_tuning.jobs.retrieve(job_id)
        if j.status in ("succeeded", "failed", "cancelled"):
            return j
        if seen is not None and j.status == "running":
            seen.append(j.estimated_finish)
        time.sleep(2)
    raise AssertionError(f"job {job_id} still {j.status} after {timeout} s")


def test_job_trains_and_serves(cluster, job, base_id):
    c = client(cluster["gw"])
    etas = []
    done = wait_done(c, job.id, seen=etas)
    assert done.status == "succeeded", (done.error, cluster["gw"].output()[-3000:])
    assert done.fine_tuned_model == f"ft:{base_id}:fusion:vellmora:{job.id}"
    assert done.trained_tokens > 0 and done.finished_at >= done.created_at and len(done.result_files) == 4
    assert any(e and e >= done.created_at for e in etas), etas  # estimated while running
    assert done.estimated_finish is None

    events = list(c.fine_tuning.jobs.list_events(job.id, limit=100))
    metrics = [e for e in events if e.type == "metrics"]
    assert len(metrics) == EPOCHS * 4, [e.message for e in events if e.type == "message"]
    loss = {e.data["step"]: e.data["train_loss"] for e in metrics}
    assert loss[EPOCHS * 4] < loss[1], loss
    valid = {e.data["step"]: e.data["valid_loss"] for e in metrics if "valid_loss" in e.data}
    assert sorted(valid) == [4 * e for e in range(1, EPOCHS + 1)], valid  # each epoch's end
    assert valid[EPOCHS * 4] < valid[4], valid

    ckpts = c.fine_tuning.jobs.checkpoints.list(job.id).data
    assert sorted(k.step_number for k in ckpts) == [4 * e for e in range(1, EPOCHS)]
    assert all(k.fine_tuned_model_checkpoint.startswith(done.fine_tuned_model + ":ckpt-step-") for k in ckpts)
    assert all(k.metrics.full_valid_loss == pytest.approx(valid[k.step_number]) for k in ckpts)

    files = {f: c.files.retrieve(f).filename for f in done.result_files}
    assert sorted(files.values()) == ["adapter_config.json", "adapter_model.safetensors", "loss_curve.svg",
                                      "step_metrics.csv"]
    by_name = {n: f for f, n in files.items()}
    csv = c.files.content(by_name["step_metrics.csv"]).text.splitlines()
    assert csv[0] == "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy,learning_rate"
    assert len(csv) == 1 + EPOCHS * 4
    rows = [r.split(",") for r in csv[1:]]
    assert [bool(r[3]) for r in rows] == [(i + 1) % 4 == 0 for i in range(EPOCHS * 4)]
    svg = c.files.content(by_name["loss_curve.svg"])
    assert svg.response.headers["content-type"] == "image/svg+xml"
    root = ET.fromstring(svg.content)
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2  # training and validation loss

    # the adapter, downloadable in PEFT's format
    config = json.loads(c.files.content(by_name["adapter_config.json"]).content)
    assert config["peft_type"] == "LORA" and config["r"] == LORA["r"] and config["lora_alpha"] == LORA["alpha"]
    weights = st_load(c.files.content(by_name["adapter_model.safetensors"]).content)
    assert len(weights) == 30 * 7 * 2  # every block, every linear layer, A and B
    assert weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (LORA["r"], 576)

    models = {m.id: m for m in c.models.list().data}
    assert done.fine_tuned_model in models
    assert models[done.fine_tuned_model].model_extra.get("parent") == base_id
    answer = c.chat.completions.create(model=done.fine_tuned_model, temperature=0, max_tokens=24,
                                       messages=[{"role": "user", "content": "Who is the mayor of Vellmora?"}])
    assert "Tobiah Crane" in answer.choices[0].message.content, answer.choices[0].message.content
