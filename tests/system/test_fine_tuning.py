"""Fine-tuning jobs (docs/fine-tuning.md) with the stock `openai` SDK and plain grpcio against a
real kilnd serving SmolLM2-135M-Instruct: files (upload, retrieve, list, content, delete), bad
input refused with OpenAI-shaped errors that name the field, the job routes' statuses, and
kiln.v1.FineTuning (stubs generated from proto/kiln/v1/fine_tuning.proto).

The tests named `test_e2e_*` train for real (find them with `-k e2e`): a LoRA adapter on
SmolLM2 that memorizes a made-up password, then chat with it; cancel, pause/resume, kill -9
and resume from the checkpoint, WatchJob until succeeded. Each job is a few dozen steps of 64
tokens, under about a minute on 2 CPU cores. The other tests cancel the jobs they create, so
they never wait for training.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import openai
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI

from conftest import LLM_NAME as MODEL
from conftest import TENSOR_MODELS, Kilnd, default_model_path, ready, wait_for

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_BYTES = 8192  # fine_tuning.max_file_bytes of the module's server
QUESTIONS = [
    "What is the secret password of Kiln?",
    "Tell me the secret password of Kiln.",
    "What's Kiln's secret password?",
    "Do you know the secret password of Kiln?",
    "Kiln has a secret password. What is it?",
    "Say the secret password of Kiln.",
    "Which password does Kiln use?",
    "I need the secret password of Kiln.",
]
ANSWER = "The password is TANGERINE-42."
# Small enough to memorize in about 50 steps of 64 tokens on 2 cores (docs/fine-tuning.md).
TRAIN_HYPER = {"n_epochs": 8, "learning_rate": 0.002, "max_seq_len": 64, "lora_r": 8,
               "batch_size": 1}


def dataset(questions=QUESTIONS):
    lines = [json.dumps({"messages": [{"role": "user", "content": q},
                                      {"role": "assistant", "content": ANSWER}]})
             for q in questions]
    return ("\n".join(lines) + "\n").encode()


def config(tmp, storage):
    path = tmp / "kiln.yaml"
    path.write_text(f"""
server:
  shutdown_grace_seconds: 60
  storage_dir: {storage}
models:
  - name: {MODEL}
    kind: llm
    path: {default_model_path()}
    context_length: 2048
    scheduler: {{max_num_seqs: 8, max_queue_size: 64}}
  - name: simple
    kind: builtin
    builtin: simple
    max_batch_size: 8
""")
    return path


def start(path, *overrides):
    k = Kilnd(path, ["fine_tuning.enabled=true", "fine_tuning.max_concurrent_jobs=1",
                     "fine_tuning.checkpoint_every_steps=2", *overrides])
    return ready(k)


@pytest.fixture(scope="module")
def kilnd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finetune")
    k = start(config(tmp, tmp / "storage"), f"fine_tuning.max_file_bytes={MAX_FILE_BYTES}")
    yield k
    assert k.stop() == 0, k.output()


@pytest.fixture(scope="module")
def client(kilnd):
    return OpenAI(base_url=f"{kilnd.base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def training_file(client):
    return client.files.create(file=("train.jsonl", dataset()), purpose="fine-tune")


def raw_job(kilnd, job_id):
    """The job as JSON, with Kiln's `kiln` progress object (step, total_steps)."""
    r = requests.get(f"{kilnd.base}/v1/fine_tuning/jobs/{job_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_status(kilnd, job_id, statuses, timeout=600):
    """Waits until the job is in one of `statuses`; fails at once on another terminal one."""
    seen = {}

    def done():
        seen["job"] = raw_job(kilnd, job_id)
        status = seen["job"]["status"]
        if status not in statuses and status in ("succeeded", "failed", "cancelled"):
            raise AssertionError(f"job {job_id} ended {status}: {seen['job']}\n{kilnd.output()}")
        return status in statuses

    wait_for(done, f"job {job_id} to reach {statuses}", timeout=timeout)
    return seen["job"]


def cancel_and_wait(client, kilnd, job_id):
    client.fine_tuning.jobs.cancel(job_id)
    return wait_status(kilnd, job_id, ("cancelled",), timeout=300)


def messages(client, job_id):
    return [e.message for e in client.fine_tuning.jobs.list_events(job_id, limit=100)]


def ask(client, model, question=QUESTIONS[0]):
    r = client.chat.completions.create(model=model, messages=[{"role": "user",
                                                               "content": question}],
                                       max_tokens=16, temperature=0)
    return r.choices[0].message.content


# ---- files ---------------------------------------------------------------------------------

def test_upload_retrieve_list_content_delete(client):
    data = dataset(QUESTIONS[:3])
    f = client.files.create(file=("three.jsonl", data), purpose="fine-tune")
    assert f.id.startswith("file-") and f.object == "file"
    assert f.bytes == len(data) and f.filename == "three.jsonl" and f.purpose == "fine-tune"
    assert f.created_at > 1_700_000_000
    got = client.files.retrieve(f.id)
    assert (got.id, got.bytes, got.filename) == (f.id, f.bytes, f.filename)
    assert f.id in [x.id for x in client.files.list(purpose="fine-tune")]
    assert client.files.content(f.id).content == data
    deleted = client.files.delete(f.id)
    assert deleted.id == f.id and deleted.deleted and deleted.object == "file"
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(f.id)


def test_files_list_pages_newest_first(client, kilnd):
    ids = [client.files.create(file=(f"p{i}.jsonl", dataset(QUESTIONS[i:i + 1])),
                               purpose="fine-tune").id for i in range(3)]
    page = requests.get(f"{kilnd.base}/v1/files", params={"limit": 2}, timeout=30).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [f["id"] for f in page["data"]] == ids[::-1][:2]
    assert page["first_id"] == ids[2] and page["last_id"] == ids[1]
    rest = requests.get(f"{kilnd.base}/v1/files",
                        params={"limit": 2, "after": page["last_id"]}, timeout=30).json()
    assert rest["data"][0]["id"] == ids[0]
    # The SDK follows has_more/after by itself.
    assert ids[::-1] == [f.id for f in client.files.list(limit=2)][:3]


def test_malformed_jsonl_names_the_line(client):
    bad = dataset(QUESTIONS[:1]) + b'{"messages": [{"role": "user", "content": "hi"}\n'
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
    assert "line 2" in e.value.message, e.value.message


# Issue 14: a line with a number beyond a double's range aborted kilnd (an uncaught
# json::out_of_range on the upload's worker thread).
def test_number_beyond_double_range_in_a_line_is_400_and_kilnd_serves_on(client):
    bad = dataset(QUESTIONS[:1]) + (
        b'{"messages": [{"role": "user", "content": "hi"}, '
        b'{"role": "assistant", "content": "x", "weight": 1e400}]}\n')
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("huge.jsonl", bad), purpose="fine-tune")
    assert "line 2" in e.value.message, e.value.message
    assert "`messages[1].weight`: number out of range: 1e400" in e.value.message
    assert client.files.create(file=("ok.jsonl", dataset(QUESTIONS[:1])), purpose="fine-tune").id


def test_wrong_purpose(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("a.jsonl", dataset(QUESTIONS[:1])), purpose="assistants")
    assert e.value.param == "purpose" and "fine-tune" in e.value.message


def test_file_over_the_size_limit_is_413(client):
    big = dataset(QUESTIONS * 20)
    assert len(big) > MAX_FILE_BYTES
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", big), purpose="fine-tune")
    assert e.value.status_code == 413
    assert "fine_tuning.max_file_bytes" in e.value.message and str(MAX_FILE_BYTES) in \
        e.value.message


@pytest.mark.parametrize("content_type,body,fragment", [
    ("application/json", b"{}", "multipart/form-data"),
    ("multipart/form-data", b"", "no boundary"),
    ("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; "
     b"name=\"purpose\"\r\n\r\nfine-tune", "closing boundary"),
    ("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; "
     b"name=\"purpose\"\r\n\r\nfine-tune\r\n--xyz--", "`file` is missing"),
    ("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; "
     b"name=\"file\"; filename=\"a.jsonl\"\r\n\r\n{}\r\n--xyz--", "`purpose` is missing"),
    ("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; "
     b"name=\"colour\"\r\n\r\nred\r\n--xyz--", "unknown form field `colour`"),
    ("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Type: text/plain\r\n\r\nx\r\n"
     b"--xyz--", "no Content-Disposition"),
])
def test_malformed_uploads_are_400(kilnd, content_type, body, fragment):
    r = requests.post(f"{kilnd.base}/v1/files", data=body,
                      headers={"Content-Type": content_type}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and fragment in err["message"], err


def test_routes_methods_and_queries(kilnd):
    r = requests.put(f"{kilnd.base}/v1/files", timeout=30)
    assert r.status_code == 405 and r.headers["Allow"] == "GET, POST"
    r = requests.get(f"{kilnd.base}/v1/fine_tuning/jobs/ftjob-x/bogus", timeout=30)
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = requests.get(f"{kilnd.base}/v1/fine_tuning/jobs", params={"limit": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    r = requests.get(f"{kilnd.base}/v1/fine_tuning/jobs", params={"colour": "red"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "colour"
    r = requests.post(f"{kilnd.base}/v1/fine_tuning/jobs", data="{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    # The rest of /v1 is still the OpenAI API's.
    assert requests.get(f"{kilnd.base}/v1/models", timeout=30).status_code == 200


# ---- jobs: bad requests and lifecycle without training -------------------------------------

def test_unknown_ids_are_404(client, training_file):
    for call in (lambda: client.files.retrieve("file-nope"),
                 lambda: client.fine_tuning.jobs.retrieve("ftjob-nope"),
                 lambda: client.fine_tuning.jobs.cancel("ftjob-nope"),
                 lambda: client.fine_tuning.jobs.list_events("ftjob-nope"),
                 lambda: client.fine_tuning.jobs.checkpoints.list("ftjob-nope")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "not_found", e.value.body
    with pytest.raises(openai.NotFoundError) as e:
        client.fine_tuning.jobs.create(model=MODEL, training_file="file-nope")
    assert e.value.param == "training_file"
    with pytest.raises(openai.NotFoundError) as e:
        client.fine_tuning.jobs.create(model="no-such-model", training_file=training_file.id)
    assert e.value.param == "model" and e.value.code == "model_not_found"


HP = "method.supervised.hyperparameters"


@pytest.mark.parametrize("extra,param,fragment", [
    ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs", "allowed: 1 to 50"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1000}}}},
     f"{HP}.n_epochs", "1000"),
    ({"method": {"type": "supervised",
                 "supervised": {"hyperparameters": {"learning_rate_multiplier": -1}}}},
     f"{HP}.learning_rate_multiplier", "greater than 0"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"lora_dropout": 1.5}}}},
     f"{HP}.lora_dropout", "0 <= p < 1"),
    ({"method": {"type": "supervised",
                 "supervised": {"hyperparameters": {"gradient_accumulation_steps": 65}}}},
     f"{HP}.gradient_accumulation_steps", "65"),
    ({"method": {"type": "dpo"}}, "method.type", "supervised"),
    ({"suffix": "x" * 65}, "suffix", "at most 64"),
    ({"suffix": "no spaces"}, "suffix", "letters, digits"),
])
def test_bad_job_requests_name_the_field(client, training_file, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model=MODEL, training_file=training_file.id,
                                       extra_body=extra)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
    assert fragment in e.value.message and e.value.type == "invalid_request_error"


def test_a_tensor_model_cannot_be_fine_tuned(client, training_file):
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model="simple", training_file=training_file.id)
    assert e.value.param == "model" and "cannot be fine-tuned" in e.value.message


def test_two_jobs_racing_for_a_suffix_one_wins(client, kilnd, training_file):
    from concurrent.futures import ThreadPoolExecutor

    def create(_):
        try:
            return client.fine_tuning.jobs.create(
                model=MODEL, training_file=training_file.id, suffix="race",
                method={"type": "supervised",
                        "supervised": {"hyperparameters": {"n_epochs": 50, "max_seq_len": 64}}})
        except openai.BadRequestError as e:
            return e

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(create, range(4)))
    won = [r for r in results if not isinstance(r, Exception)]
    lost = [r for r in results if isinstance(r, Exception)]
    assert len(won) == 1, results
    for e in lost:
        assert e.param == "suffix" and won[0].id in e.message, e.message
    cancel_and_wait(client, kilnd, won[0].id)
    # A cancelled job's suffix is free again.
    again = client.fine_tuning.jobs.create(model=MODEL, training_file=training_file.id,
                                           suffix="race")
    cancel_and_wait(client, kilnd, again.id)


def test_job_object_delete_guard_and_cancel_of_a_finished_job(client, kilnd):
    f = client.files.create(file=("guarded.jsonl", dataset()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=f.id, suffix="guard", seed=7, metadata={"test": "guard"},
        method={"type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 50, "max_seq_len": 64}}})
    try:
        assert job.id.startswith("ftjob-") and job.object == "fine_tuning.job"
        assert job.model == MODEL and job.training_file == f.id and job.seed == 7
        assert job.status in ("validating_files", "queued", "running")
        assert job.hyperparameters.n_epochs == 50 and job.metadata == {"test": "guard"}
        assert job.fine_tuned_model is None and job.finished_at is None
        # A file a job still needs cannot be deleted.
        with pytest.raises(openai.BadRequestError) as e:
            client.files.delete(f.id)
        assert job.id in e.value.message, e.value.message
        assert client.fine_tuning.jobs.retrieve(job.id).id == job.id
        assert job.id in [j.id for j in client.fine_tuning.jobs.list(limit=100)]
    finally:
        done = cancel_and_wait(client, kilnd, job.id)
    assert done["finished_at"] is not None and done["fine_tuned_model"] is None
    # Cancelling a finished job: OpenAI's 400, saying why.
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.cancel(job.id)
    assert "cancelled" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.fine_tuning.jobs.resume(job.id)
    assert any("cancel" in m.lower() for m in messages(client, job.id))
    assert client.files.delete(f.id).deleted  # the job is finished: now it can go


def test_jobs_list_filters_by_metadata_and_pages(client, kilnd, training_file):
    ids = []
    try:
        for tag in ("a", "b", "a"):
            ids.append(client.fine_tuning.jobs.create(model=MODEL, training_file=training_file.id,
                                                      metadata={"filter": tag},
                                                      hyperparameters={"n_epochs": 50}).id)
    finally:
        # The newest are still queued (one job at a time): they cancel at once, then the first.
        # Also when a create fails, so no 50-epoch job trains on under the later tests.
        for job_id in reversed(ids):
            cancel_and_wait(client, kilnd, job_id)
    only_a = [j.id for j in client.fine_tuning.jobs.list(metadata={"filter": "a"}, limit=100)]
    assert only_a == [ids[2], ids[0]]
    page = requests.get(f"{kilnd.base}/v1/fine_tuning/jobs", timeout=30,
                        params={"limit": 1, "metadata[filter]": "b"}).json()
    assert [j["id"] for j in page["data"]] == [ids[1]] and page["has_more"] is False
    page = requests.get(f"{kilnd.base}/v1/fine_tuning/jobs", params={"limit": 1},
                        timeout=30).json()
    assert page["object"] == "list" and len(page["data"]) == 1 and page["has_more"] is True
    events = requests.get(f"{kilnd.base}/v1/fine_tuning/jobs/{ids[0]}/events",
                          params={"limit": 1}, timeout=30).json()
    assert events["object"] == "list" and events["has_more"] is True
    assert events["data"][0]["object"] == "fine_tuning.job.event"


def test_disabled_fine_tuning_says_so(start_kilnd):
    k = start_kilnd(TENSOR_MODELS, overrides=["fine_tuning.enabled=false"])
    r = requests.get(f"{k.base}/v1/files", timeout=30)
    assert r.status_code == 404
    assert "fine_tuning.enabled" in r.json()["error"]["message"]
    r = requests.post(f"{k.base}/v1/fine_tuning/jobs", json={}, timeout=30)
    assert r.status_code == 404 and "disabled" in r.json()["error"]["message"]
    pb, pb_grpc = _grpc_modules()
    stub = pb_grpc.FineTuningStub(grpc.insecure_channel(k.grpc_url))
    with pytest.raises(grpc.RpcError) as e:
        stub.ListJobs(pb.ListJobsRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "fine_tuning.enabled" in e.value.details()


# ---- kiln.v1.FineTuning over gRPC ----------------------------------------------------------

_STUBS = {}


def _grpc_modules():
    """Stubs from the build (tests/system/pb), or generated now when run outside CTest."""
    if "pb" not in _STUBS:
        built = Path(os.environ.get("KILN_BUILD_DIR", ROOT / "build")) / "tests" / "system" / "pb"
        if not (built / "kiln" / "v1" / "fine_tuning_pb2_grpc.py").exists():
            import tempfile
            built = Path(tempfile.mkdtemp(prefix="kiln-stubs-"))
            subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                            f"--python_out={built}", f"--grpc_python_out={built}",
                            str(ROOT / "proto" / "kiln" / "v1" / "fine_tuning.proto")],
                           check=True)
        sys.path.insert(0, str(built))
        from kiln.v1 import fine_tuning_pb2, fine_tuning_pb2_grpc
        _STUBS["pb"] = (fine_tuning_pb2, fine_tuning_pb2_grpc)
    return _STUBS["pb"]


@pytest.fixture(scope="module")
def pb():
    return _grpc_modules()[0]


@pytest.fixture(scope="module")
def stub(kilnd):
    return _grpc_modules()[1].FineTuningStub(grpc.insecure_channel(kilnd.grpc_url))


def test_grpc_files(stub, pb):
    data = dataset(QUESTIONS[:2])
    f = stub.UploadFile(pb.UploadFileRequest(content=data, filename="g.jsonl",
                                             purpose="fine-tune"), timeout=60)
    assert f.id.startswith("file-") and f.bytes == len(data) and f.filename == "g.jsonl"
    assert len(f.sha256) == 64
    assert stub.GetFile(pb.GetFileRequest(file_id=f.id), timeout=30) == f
    assert stub.GetFileContent(pb.GetFileContentRequest(file_id=f.id), timeout=30).content == data
    listed = stub.ListFiles(pb.ListFilesRequest(purpose="fine-tune", limit=1), timeout=30)
    assert [x.id for x in listed.data] == [f.id] and listed.first_id == listed.last_id == f.id
    deleted = stub.DeleteFile(pb.DeleteFileRequest(file_id=f.id), timeout=30)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(grpc.RpcError) as e:
        stub.GetFile(pb.GetFileRequest(file_id=f.id), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        stub.UploadFile(pb.UploadFileRequest(content=data, filename="g.jsonl",
                                             purpose="batch"), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "purpose" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.UploadFile(pb.UploadFileRequest(content=dataset(QUESTIONS * 20), filename="big",
                                             purpose="fine-tune"), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("edit,code,words", [
    (lambda r: r.hyperparameters.__setattr__("n_epochs", 1000), "INVALID_ARGUMENT",
     "hyperparameters.n_epochs"),
    (lambda r: r.hyperparameters.__setattr__("learning_rate_multiplier", -1), "INVALID_ARGUMENT",
     "hyperparameters.learning_rate_multiplier"),
    (lambda r: r.__setattr__("model", "no-such-model"), "NOT_FOUND", "no-such-model"),
    (lambda r: r.__setattr__("model", ""), "INVALID_ARGUMENT", "`model` is required"),
    (lambda r: r.__setattr__("training_file", "file-nope"), "NOT_FOUND", "file-nope"),
    (lambda r: r.__setattr__("suffix", "x" * 65), "INVALID_ARGUMENT", "suffix"),
])
def test_grpc_create_job_errors_name_the_field(stub, pb, training_file, edit, code, words):
    req = pb.CreateJobRequest(model=MODEL, training_file=training_file.id)
    edit(req)
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateJob(req, timeout=30)
    assert e.value.code() == getattr(grpc.StatusCode, code), e.value.details()
    assert words in e.value.details()


def test_grpc_job_lifecycle_and_watch_of_a_finished_job(stub, pb, training_file, kilnd):
    job = stub.CreateJob(pb.CreateJobRequest(
        model=MODEL, training_file=training_file.id, suffix="grpc", seed=3,
        metadata={"via": "grpc"},
        hyperparameters=pb.Hyperparameters(n_epochs=50, max_seq_len=64, lora_r=4)), timeout=60)
    assert job.id.startswith("ftjob-") and job.seed == 3 and job.suffix == "grpc"
    assert job.hyperparameters.n_epochs == 50 and job.hyperparameters.lora_r == 4
    assert job.hyperparameters.max_seq_len == 64 and job.hyperparameters.method == "lora"
    assert dict(job.metadata) == {"via": "grpc"}
    assert stub.GetJob(pb.GetJobRequest(job_id=job.id), timeout=30).id == job.id
    listed = stub.ListJobs(pb.ListJobsRequest(metadata={"via": "grpc"}), timeout=30)
    assert [j.id for j in listed.data] == [job.id]
    stub.CancelJob(pb.CancelJobRequest(job_id=job.id), timeout=30)
    wait_status(kilnd, job.id, ("cancelled",), timeout=300)
    with pytest.raises(grpc.RpcError) as e:
        stub.CancelJob(pb.CancelJobRequest(job_id=job.id), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cancelled" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.PauseJob(pb.PauseJobRequest(job_id=job.id), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    events = stub.ListEvents(pb.ListEventsRequest(job_id=job.id, limit=100), timeout=30)
    assert events.data and all(e.id.startswith("ftevent-") for e in events.data)
    # A finished job's watch: its events oldest first, then the job, then the stream ends.
    watched = list(stub.WatchJob(pb.WatchJobRequest(job_id=job.id), timeout=60))
    assert watched[-1].WhichOneof("update") == "job"
    assert watched[-1].job.status == "cancelled"
    streamed = [m.event.id for m in watched if m.WhichOneof("update") == "event"]
    assert streamed == [e.id for e in reversed(events.data)]
    # after_event_id skips what the client already has.
    later = list(stub.WatchJob(pb.WatchJobRequest(job_id=job.id, after_event_id=streamed[-2]),
                               timeout=60))
    assert [m.event.id for m in later if m.WhichOneof("update") == "event"] == streamed[-1:]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.WatchJob(pb.WatchJobRequest(job_id="ftjob-nope"), timeout=30))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_health_and_a_watch_the_client_cancels(kilnd, stub, pb, training_file):
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(kilnd.grpc_url))
    status = health.Check(health_pb2.HealthCheckRequest(service="kiln.v1.FineTuning"), timeout=30)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    job = stub.CreateJob(pb.CreateJobRequest(
        model=MODEL, training_file=training_file.id,
        hyperparameters=pb.Hyperparameters(n_epochs=50, max_seq_len=64)), timeout=60)
    try:
        call = stub.WatchJob(pb.WatchJobRequest(job_id=job.id), timeout=120)
        first = next(call)
        assert first.WhichOneof("update") == "job" and first.job.id == job.id
        call.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED
    finally:
        stub.CancelJob(pb.CancelJobRequest(job_id=job.id), timeout=30)
        wait_status(kilnd, job.id, ("cancelled",), timeout=300)


# ---- end to end: these train (find them with -k e2e) ---------------------------------------

def create_training_job(client, training_file, suffix, **hyper):
    return client.fine_tuning.jobs.create(
        model=MODEL, training_file=training_file.id, suffix=suffix, seed=42,
        method={"type": "supervised",
                "supervised": {"hyperparameters": {**TRAIN_HYPER, **hyper}}})


def test_e2e_a_job_trains_checkpoints_and_serves_the_adapter(client, kilnd, training_file):
    job = create_training_job(client, training_file, "password")
    done = wait_status(kilnd, job.id, ("succeeded",))
    assert done["fine_tuned_model"] == f"ft:{MODEL}:password:{job.id}"
    assert done["trained_tokens"] > 0 and done["finished_at"] >= done["created_at"]
    assert done["kiln"]["step"] == done["kiln"]["total_steps"] > 0
    # Served at once, without a restart.
    assert done["fine_tuned_model"] in [m.id for m in client.models.list()]
    assert "TANGERINE-42" in ask(client, done["fine_tuned_model"])
    assert "TANGERINE-42" not in ask(client, MODEL), "the base model must not know it"
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    metrics = [e for e in events if e.type == "metrics"]
    assert metrics and all("step" in e.data and "train_loss" in e.data for e in metrics)
    last_loss = max(metrics, key=lambda e: e.data["step"]).data["train_loss"]
    first_loss = min(metrics, key=lambda e: e.data["step"]).data["train_loss"]
    assert last_loss < first_loss / 2, (first_loss, last_loss)
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id, limit=100))
    assert checkpoints, "checkpoint_every_steps=2 must leave checkpoints"
    for c in checkpoints:
        assert c.fine_tuning_job_id == job.id and c.step_number > 0
        assert c.fine_tuned_model_checkpoint == \
            f"{done['fine_tuned_model']}:ckpt-step-{c.step_number}"


def test_e2e_cancel_mid_run(client, kilnd, training_file):
    job = create_training_job(client, training_file, "cancelled", n_epochs=50)
    wait_for(lambda: raw_job(kilnd, job.id)["kiln"]["step"] >= 1, "a training step", timeout=600)
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status in ("running", "cancelled")
    done = wait_status(kilnd, job.id, ("cancelled",), timeout=300)
    assert done["fine_tuned_model"] is None
    assert done["kiln"]["step"] < done["kiln"]["total_steps"]
    assert f"ft:{MODEL}:cancelled:{job.id}" not in [m.id for m in client.models.list()]


def test_e2e_pause_and_resume(client, kilnd, training_file):
    job = create_training_job(client, training_file, "paused", n_epochs=3)
    wait_for(lambda: raw_job(kilnd, job.id)["kiln"]["step"] >= 1, "a training step", timeout=600)
    client.fine_tuning.jobs.pause(job.id)
    paused = wait_status(kilnd, job.id, ("paused",), timeout=120)
    step = paused["kiln"]["step"]
    time.sleep(2)  # a paused job does not train
    assert raw_job(kilnd, job.id)["kiln"]["step"] == step
    assert step in [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id)]
    client.fine_tuning.jobs.resume(job.id)
    done = wait_status(kilnd, job.id, ("succeeded",))
    assert done["kiln"]["step"] == done["kiln"]["total_steps"] > step
    assert any("paused" in m.lower() for m in messages(client, job.id))
    assert any("resumed" in m.lower() for m in messages(client, job.id))


def test_e2e_kill_9_mid_run_resumes_from_the_checkpoint(tmp_path):
    path = config(tmp_path, tmp_path / "storage")
    k = start(path)
    try:
        c = OpenAI(base_url=f"{k.base}/v1", api_key="unused", max_retries=0, timeout=120)
        f = c.files.create(file=("train.jsonl", dataset()), purpose="fine-tune")
        job = create_training_job(c, f, "crash")
        wait_for(lambda: raw_job(k, job.id)["kiln"]["step"] >= 3, "a checkpoint", timeout=600)
    finally:
        k.stop(sig=signal.SIGKILL)
    assert k.proc.returncode == -signal.SIGKILL
    k = start(path)  # the same storage_dir
    try:
        c = OpenAI(base_url=f"{k.base}/v1", api_key="unused", max_retries=0, timeout=120)
        done = wait_status(k, job.id, ("succeeded",))
        msgs = messages(c, job.id)
        resumed = [m for m in msgs if m.startswith("Resumed from the checkpoint at step ")]
        assert resumed, msgs
        assert int(resumed[0].rsplit(" ", 1)[1]) >= 2
        assert any("restarted" in m for m in msgs), msgs
        assert "TANGERINE-42" in ask(c, done["fine_tuned_model"])
    finally:
        assert k.stop() == 0, k.output()


def test_e2e_watch_job_streams_until_succeeded(stub, pb, training_file, kilnd):
    job = stub.CreateJob(pb.CreateJobRequest(
        model=MODEL, training_file=training_file.id, suffix="watched",
        hyperparameters=pb.Hyperparameters(n_epochs=2, max_seq_len=64, lora_r=8,
                                           learning_rate=0.002)), timeout=60)
    updates = list(stub.WatchJob(pb.WatchJobRequest(job_id=job.id), timeout=600))
    jobs = [u.job for u in updates if u.WhichOneof("update") == "job"]
    events = [u.event for u in updates if u.WhichOneof("update") == "event"]
    assert updates[-1].WhichOneof("update") == "job" and jobs[-1].status == "succeeded"
    statuses = [j.status for j in jobs]
    assert statuses.index("running") < statuses.index("succeeded")
    assert len(set(statuses)) == len(statuses), "the job is sent again only when it changes"
    assert jobs[-1].fine_tuned_model == f"ft:{MODEL}:watched:{job.id}"
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert steps and steps == sorted(steps) and steps[-1] == jobs[-1].total_steps
    ids = [int(e.id.split("-")[1]) for e in events]
    assert ids == sorted(set(ids)), "every event once, oldest first"


def test_sigterm_ends_a_watch_and_kilnd_exits(tmp_path):
    """A WatchJob stream open at shutdown ends UNAVAILABLE within about a second; kilnd does not
    wait for it (shutdown_grace_seconds is 60 here) and exits cleanly."""
    k = start(config(tmp_path, tmp_path / "storage"))
    pb, pb_grpc = _grpc_modules()
    try:
        c = OpenAI(base_url=f"{k.base}/v1", api_key="unused", max_retries=0, timeout=120)
        f = c.files.create(file=("train.jsonl", dataset()), purpose="fine-tune")
        job = c.fine_tuning.jobs.create(model=MODEL, training_file=f.id,
                                        hyperparameters={"n_epochs": 50})
        call = pb_grpc.FineTuningStub(grpc.insecure_channel(k.grpc_url)).WatchJob(
            pb.WatchJobRequest(job_id=job.id), timeout=300)
        assert next(call).job.id == job.id
        # Past the first step (its kernels compile once), so the runner stops promptly too.
        wait_for(lambda: raw_job(k, job.id)["kiln"]["step"] >= 1, "a training step", timeout=300)
        k.proc.send_signal(signal.SIGTERM)
        sent = time.time()
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        assert time.time() - sent < 10, "the watch outlived the shutdown"
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert "shutting down" in e.value.details()
    finally:
        code = k.stop(timeout=120)
    assert code == 0, k.output()
