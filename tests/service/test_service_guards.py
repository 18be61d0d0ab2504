"""The service's guards at its edges (issue 30), in process: FastAPI's ``TestClient`` with the
app's lifespan, a real SQLite file and ``FakeRunner`` in place of Ray. The token's form, the
Host and Origin of a request, bodies nested deep, what a failure reason may carry, and the
modes of the files the service creates."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from support.fake_runner import FakeRunner
from support.service_app import TOKEN, Service, make_client, spec, start

from kaisa_train.corpus import DEFAULT_FORTUNES_DIR
from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_train.spec import parse_job_spec
from service.app import create_app
from service.runner import RayJobStatus
from service.settings import Settings


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    fake = FakeRunner()
    app, client = start(tmp_path, fake)
    with client:
        yield Service(app, client, fake)


# -- the token's form ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "words"),
    [(" ", "contains whitespace"), ("two words-token", "contains whitespace"), ("short", "5 ch")],
)
def test_a_token_no_client_could_send_or_anyone_could_guess_is_refused(
    tmp_path: Path, token: str, words: str
) -> None:
    with pytest.raises(ValidationError, match=words) as caught:
        Settings(data_dir=tmp_path, token=token)
    assert "secrets.token_hex" in str(caught.value)  # how to make a good one
    secret = tmp_path / "token"
    secret.write_text(f"{token}x\n" if token.strip() else " \n")
    with pytest.raises(ValidationError, match="token"):
        Settings(data_dir=tmp_path, token_file=secret)
    assert Settings(data_dir=tmp_path, token="").token is None  # an empty variable: unset
    assert Settings(data_dir=tmp_path, token="good-token-0123").secret == "good-token-0123"


# -- bodies --------------------------------------------------------------------------------


def test_deeply_nested_yaml_is_refused_before_it_is_parsed(service: Service) -> None:
    """Refused on its brackets, before PyYAML's scanner (quadratic in open brackets: 30 000
    of them took 0.6-1.9 s of CPU) reads it: the body is not valid YAML past its 40 brackets,
    and the answer is 'nested too deep', not the parser's error."""
    body = "name: " + "[" * 40 + "x: : :" + "[" * 20_000
    response = service.client.post(
        "/v1/jobs", content=body, headers={"Content-Type": "application/yaml"}
    )
    assert response.status_code == 422, response.text
    assert "nested too deep" in response.json()["detail"]
    # Nesting by indentation is bounded while composing, not after: 'nested too deep'.
    indented = "name:\n" + "".join(f"{' ' * i}a{i}:\n" for i in range(1, 200)) + " " * 200 + "x"
    response = service.client.post(
        "/v1/jobs", content=indented, headers={"Content-Type": "application/yaml"}
    )
    assert response.status_code == 422, response.text
    assert "nested too deep" in response.json()["detail"]


# -- what a failure reason may carry -------------------------------------------------------


def test_a_failure_reason_is_stored_without_terminal_escapes(service: Service) -> None:
    job = service.running("coloured")
    message = "\x1b[31mTrainingDivergedError\x1b[0m: loss nan\x1b]0;title\x07 at step 3\x00"
    service.fake.finish(job["id"], RayJobStatus.FAILED, message)
    failed = service.wait_state(job["id"], "FAILED")
    assert failed["failure_reason"] == (
        "the Ray Job failed: TrainingDivergedError: loss nan at step 3"
    )
    detail = service.client.get(f"/v1/jobs/{job['id']}").json()
    assert "\x1b" not in str(detail["transitions"])


# -- files ----------------------------------------------------------------------------------


def test_the_database_and_its_locks_are_the_owners_alone(tmp_path: Path) -> None:
    data = tmp_path / "fresh"
    app = create_app(Settings(data_dir=data, token=TOKEN), runner=FakeRunner())
    with make_client(app) as client:
        assert client.post("/v1/jobs", json=spec()).status_code == 201
        modes = {
            path.name: stat.S_IMODE(path.stat().st_mode)
            for path in data.iterdir()
            if path.name.startswith(("jobs.db", "service.lock"))
        }
    assert modes.keys() >= {"jobs.db", "jobs.db.lock", "service.lock", "jobs.db-wal"}
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes
    assert stat.S_IMODE(data.stat().st_mode) == 0o700


# -- Host and Origin -------------------------------------------------------------------------


@pytest.fixture
def open_service(tmp_path: Path) -> Iterator[Service]:
    """The service as the README starts it: loopback, no token."""
    fake = FakeRunner()
    app = create_app(Settings(data_dir=tmp_path, poll_interval_s=0.02), runner=fake)
    with make_client(app, base_url="http://127.0.0.1:8000") as client:
        yield Service(app, client, fake)


def test_without_a_token_only_loopback_host_names_are_answered(open_service: Service) -> None:
    """DNS rebinding: a page of evil.example, its name pointed at 127.0.0.1, sends requests
    that name evil.example: refused, reads and writes alike, naming the fix. Loopback names
    (with any port), the probes, and names the operator allowed are answered."""
    client = open_service.client
    for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/")):
        refused = client.request(method, path, json=spec(), headers={"Host": "evil.example"})
        assert refused.status_code == 400, (path, refused.text)
        detail = refused.json()["detail"]
        assert "Host 'evil.example' is not a name of this service" in detail
        assert "--allowed-host" in detail
        assert "--token-file" in detail
    assert open_service.fake.submitted == {}
    assert client.get("/v1/jobs").json()["total"] == 0
    for host in ("127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000", "127.0.0.2"):
        assert client.get("/v1/jobs", headers={"Host": host}).status_code == 200, host
    assert client.get("/readyz", headers={"Host": "10.0.0.5:8000"}).status_code == 200


def test_an_allowed_host_or_a_token_lets_other_names_in(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, allowed_hosts=["kaisa.lan"])
    with make_client(create_app(settings, runner=FakeRunner())) as client:
        assert client.get("/v1/jobs", headers={"Host": "kaisa.lan:8000"}).status_code == 200
        assert client.get("/v1/jobs", headers={"Host": "evil.example"}).status_code == 400
    settings = Settings(data_dir=tmp_path / "t", token=TOKEN)
    with make_client(create_app(settings, runner=FakeRunner())) as client:
        assert client.get("/v1/jobs", headers={"Host": "evil.example"}).status_code == 200


def test_simple_cross_site_requests_change_nothing(open_service: Service) -> None:
    """A form or a no-cors fetch from any page: a text/plain or form POST, or any request
    whose Origin is another site's, is refused before it reaches a route; the dashboard's
    own requests (same origin, JSON) and clients without an Origin go through."""
    client = open_service.client
    job = open_service.submitted()
    cancel = f"/v1/jobs/{job['id']}/cancel"
    for headers, status in (
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "null"}, 403),  # a sandboxed frame's
        ({"Origin": "http://127.0.0.1:9999"}, 403),  # another port is another site
    ):
        refused = client.post(cancel, content=b"{}", headers=headers)
        assert refused.status_code == status, (headers, refused.text)
    assert (
        "Content-Type text/plain is refused"
        in client.post(cancel, content=b"x", headers={"Content-Type": "text/plain"}).json()[
            "detail"
        ]
    )
    assert (
        "cross-site request refused"
        in client.delete(f"/v1/jobs/{job['id']}", headers={"Origin": "http://evil.example"}).json()[
            "detail"
        ]
    )
    assert open_service.job(job["id"])["state"] == "QUEUED"
    assert open_service.fake.stopped == []
    same = client.post(cancel, headers={"Origin": "http://127.0.0.1:8000"})
    assert same.status_code == 200, same.text
    assert same.json()["state"] in ("CANCELLING", "CANCELLED")
    assert client.post("/v1/jobs", json=spec("no-origin")).status_code == 201  # curl, the CLI


# -- the data sandbox --------------------------------------------------------------------------


def test_data_dir_outside_the_roots_is_refused_alike_whether_it_exists_or_not(
    tmp_path: Path,
) -> None:
    """Under --data-root only, after symlinks and '..' are resolved; a path outside gets the
    same answer whether it exists (the folder of the service's own token, say) or not, so
    the answers map nothing of the host. Inside, the dataset's own checks apply as before;
    kaisa-ray train (no roots) reads any folder."""
    root = tmp_path / "roots"
    (root / "mnist").mkdir(parents=True)
    (root / "escape").symlink_to(tmp_path / "service")
    app = create_app(
        Settings(data_dir=tmp_path / "service", token=TOKEN, data_roots=[root]),
        runner=FakeRunner(),
    )

    def answer(data_dir: str, name: str = "mnist") -> tuple[int, str]:
        body = spec(dataset={"name": name, "data_dir": data_dir})
        response = client.post("/v1/jobs", json=body)
        if response.status_code != 422:
            return response.status_code, ""
        return 422, response.json()["detail"].replace(data_dir, "<path>")

    with make_client(app) as client:
        outside = {
            "exists": str(tmp_path / "service"),  # the service's data dir: its database
            "missing": str(tmp_path / "no-such-folder"),
            "dotdot": str(root / ".." / "service"),
            "dotdot-missing": str(root / ".." / "no-such-folder"),
            "symlink-out": str(root / "escape"),
            "system": "/etc",
        }
        answers = {kind: answer(path) for kind, path in outside.items()}
        assert len(set(answers.values())) == 1, answers
        status, detail = answers["exists"]
        assert status == 422
        assert detail == (
            "1 problem(s): dataset: <path> is not under this service's data roots "
            f"({root}): put the data under one of them, or start the service with "
            "--data-root DIR"
        )
        relative = answer("../../..")
        assert relative[0] == 422
        assert "is a relative path" in relative[1]
        assert answer(str(root / "mnist")) == (201, "")
        assert answer(str(root / "mnist" / ".." / "mnist")) == (201, "")
        missing_inside = answer(str(root / "nothing-here"))
        assert "does not exist" in missing_inside[1]  # inside the roots: as before
        assert answer(str(tmp_path / "service"), name="synthetic")[0] == 422  # any dataset
        plan = client.post(
            "/v1/plan",
            json={
                "spec": spec(dataset={"name": "mnist", "data_dir": "/etc"}),
                "hardware": "a100-80gb-hdr",
            },
        )
        assert plan.status_code == 422
        assert "not under this service's data roots" in plan.json()["detail"]
    assert parse_job_spec(spec(dataset={"name": "mnist", "data_dir": str(root)})).dataset


def test_the_default_roots_are_the_datasets_own_folders(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, token=TOKEN)
    assert settings.roots == sorted({DEFAULT_FASHION_MNIST_DIR, DEFAULT_FORTUNES_DIR})
    with make_client(create_app(settings, runner=FakeRunner())) as client:
        elsewhere = spec(dataset={"name": "mnist", "data_dir": str(tmp_path)})
        refused = client.post("/v1/jobs", json=elsewhere)
        assert refused.status_code == 422
        assert str(DEFAULT_FASHION_MNIST_DIR) in refused.json()["detail"]


def test_a_uri_root_admits_streamed_data_under_its_prefix_and_nothing_else(
    tmp_path: Path,
) -> None:
    """``--data-root s3://bucket/prefix``: a streamed dataset on another system is accepted
    under that prefix (the cluster reads it with the service's credentials), refused beside
    it, in another bucket or scheme, with a query (another endpoint), a '..' or a '//'; the
    folder roots still apply to local paths; a bad URI root fails the settings."""
    folder = tmp_path / "roots"
    folder.mkdir()
    settings = Settings(
        data_dir=tmp_path / "service", token=TOKEN, data_roots=["s3://lab/datasets/", folder]
    )
    assert settings.roots == ["s3://lab/datasets", folder]

    def answer(train: str, validation: str = "s3://lab/datasets/fmnist/validation") -> str:
        dataset = {
            "name": "parquet",
            "train": train,
            "validation": validation,
            "columns": {"input": "pixels", "label": "label"},
        }
        response = client.post("/v1/jobs", json=spec(dataset=dataset))
        return "accepted" if response.status_code == 201 else response.json()["detail"]

    with make_client(create_app(settings, runner=FakeRunner())) as client:
        assert answer("s3://lab/datasets/fmnist/train") == "accepted"
        refused = {
            "beside": "s3://lab/datasets-private/train",
            "bucket": "s3://other/datasets/train",
            "scheme": "gs://lab/datasets/train",
            "endpoint": "s3://lab/datasets/train?endpoint_override=attacker.example",
            "dotdot": "s3://lab/datasets/../secrets/train",
            "slashes": "s3://lab/datasets//train",
            "local": "/etc",
        }
        answers = {kind: answer(uri) for kind, uri in refused.items()}
        assert all(a != "accepted" for a in answers.values()), answers
        assert "not under this service's data roots" in answers["beside"]
        assert "s3://lab/datasets" in answers["bucket"]
        assert "query" in answers["endpoint"]
        assert "'..'" in answers["dotdot"]
        assert "'//'" in answers["slashes"]
        assert "/etc is not under this service's data roots" in answers["local"]
    with pytest.raises(ValidationError, match="query"):
        Settings(data_dir=tmp_path, token=TOKEN, data_roots=["s3://lab/x?region=eu"])
