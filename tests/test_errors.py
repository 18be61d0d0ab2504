"""One error tree end to end: every exception the project defines is a ``KaisaRayError``, and
each pickles cleanly (what Ray does to an exception that crosses an actor or a task)."""

from __future__ import annotations

import importlib
import pickle
import pkgutil
from types import ModuleType

import pytest
from ray import cloudpickle

import kaisa_ray
import kaisa_train
import service
import tuner
from kaisa_ray import ComputeMethod, KFACPreconditioner
from kaisa_ray.enums import parse_enum
from kaisa_ray.errors import ConfigurationError, KaisaRayError, StateDictError
from kaisa_train.datasets import DatasetNotFoundError, IDXFormatError
from kaisa_train.head import HeadStartError
from kaisa_train.spec import JobSpecError
from kaisa_train.sweep import WorkersNotPlacedError
from kaisa_train.worker import TrainingDivergedError
from service.client import ServiceClientError
from service.errors import (
    DatabaseInUseError,
    InsecureBindError,
    JobConflictError,
    JobNotFoundError,
    RayJobMissingError,
    RayUnavailableError,
    ServiceError,
    TookTooLongError,
)
from service.middleware import _TooDeepError, _TooLargeError
from service.model.lifecycle import IllegalTransitionError, JobEvent, JobState
from service.worker_pool import (
    PoolBusyError,
    PoolCancelledError,
    PoolStoppedError,
    PoolTimeoutError,
    WorkRefusedError,
)
from tuner.choice import NoFeasibleCandidateError
from tuner.hardware import HardwareProfileError

# One example of every exception class the project defines (a new one must be added here).
EXAMPLES: list[BaseException] = [
    KaisaRayError("something went wrong"),
    ConfigurationError("damping=-1 is not valid; use a positive number"),
    StateDictError("the checkpoint has layers fc1, fc2; this model has fc1"),
    DatasetNotFoundError("no train images in /nowhere; apt-get install dataset-fashion-mnist"),
    IDXFormatError("a corrupt gzip stream"),
    TrainingDivergedError("the training loss is nan at step 3"),
    HeadStartError("`ray start --head` exited with 1:\n...address already in use"),
    WorkersNotPlacedError("the job's 5 workers did not get their resources within 120 s"),
    JobSpecError(["kfac.damping: must be positive", "name: too long"], "job.yaml"),
    NoFeasibleCandidateError("no strategy fits the memory budget 1.00 MiB"),
    HardwareProfileError(["matmul: needs an fp32 table"], "h100.yaml"),
    ServiceError("an internal error"),
    JobNotFoundError("0123abcd"),
    JobConflictError("the job is not finished"),
    RayUnavailableError("cannot reach Ray"),
    DatabaseInUseError("another service uses the database"),
    RayJobMissingError("Ray has no Ray Job kaisa-ray-0123"),
    TookTooLongError("no answer in 4.0 s"),
    InsecureBindError("refusing to serve on 0.0.0.0 without a token"),
    IllegalTransitionError(JobState.SUCCEEDED, JobEvent.RUN),
    ServiceClientError("409: the job already finished", 409),
    _TooLargeError(1024),
    _TooDeepError("nested deeper than 32 levels"),
    PoolBusyError("40 plans are running; try again in 5 s", 5),
    PoolTimeoutError("the plan took over 60 s; run kaisa-ray plan instead"),
    PoolCancelledError("the client went away"),
    PoolStoppedError("the service is stopping"),
    WorkRefusedError("params.hidden: -1 must be positive"),
]


def _modules(package: ModuleType) -> list[ModuleType]:
    found = [package]
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        if info.name.startswith("service.migrations"):
            continue  # Alembic's scripts run against a database when imported
        found.append(importlib.import_module(info.name))
    return found


def defined_exceptions() -> set[type[BaseException]]:
    classes: set[type[BaseException]] = set()
    for package in (kaisa_ray, kaisa_train, tuner, service):
        for module in _modules(package):
            for value in vars(module).values():
                if (
                    isinstance(value, type)
                    and issubclass(value, BaseException)
                    and value.__module__ == module.__name__
                ):
                    classes.add(value)
    return classes


def test_every_project_exception_has_an_example_here() -> None:
    assert defined_exceptions() == {type(e) for e in EXAMPLES}


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_every_project_exception_is_a_kaisa_ray_error_and_pickles(error: BaseException) -> None:
    assert isinstance(error, KaisaRayError)
    for dumps in (pickle.dumps, cloudpickle.dumps):
        copy = pickle.loads(dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)
        assert copy.args == error.args
        assert vars(copy) == vars(error)


def test_a_bad_enum_value_is_a_configuration_error_naming_the_choices() -> None:
    with pytest.raises(ConfigurationError, match=r"compute_method='foo' is not valid.*'eigen'"):
        parse_enum(ComputeMethod, "foo", "compute_method")
    with pytest.raises(KaisaRayError, match="compute_method='foo'"):
        KFACPreconditioner(pytest.importorskip("torch").nn.Linear(2, 2), compute_method="foo")


def test_an_illegal_transition_is_a_conflict() -> None:
    error = IllegalTransitionError(JobState.CANCELLED, JobEvent.SUCCEED)
    assert isinstance(error, ServiceError)
    assert error.status == 409
    assert str(error) == "a CANCELLED job cannot succeed; CANCELLED is final"
