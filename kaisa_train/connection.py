"""How a driver (``kaisa-ray train``, ``tune``, ``sweep``, or a notebook calling ``run_job``)
reaches Ray: the cluster in ``RAY_ADDRESS``, or a head of its own.

- ``RAY_ADDRESS`` set (inside a Ray Job it always is; or a cluster you name): that cluster,
  after a quick check that something listens there, so that a stale address fails in
  seconds with what to do instead of Ray's ten-minute "Failed to connect to GCS".
- Unset (or ``local``): a head of this process's own (``kaisa_train.head``: free ports,
  its own temp directory, ``RAY_ADDRESS`` pinned in every process it starts, token auth with a
  token made for it), which ends with the process. Ray's own ``ray.init()`` would instead
  connect to whatever ``/tmp/ray/ray_current_cluster`` names (another user's head, or a
  dead one), and its workers would look for "the latest cluster" among every Ray on the
  machine.

A head of its own forgets everything when it stops; what later commands need is kept in the
local store (``local_store.LocalStore``, ``~/.cache/kaisa-ray``): the tuner's profiles are
loaded into the new head's tuner before a ``kfac: auto`` job asks it (``seed_tuner``) and saved
when the head stops, and every run's records (what ``kaisa-ray tune --history`` reads) are
saved when it stops.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import tempfile
import threading
from pathlib import Path
from typing import Any

from kaisa_ray.errors import ConfigurationError
from kaisa_train.head import Head, HeadStartError, head_environment, reachable, start_head
from kaisa_train.local_store import LocalStore

__all__ = ["cluster_address", "ensure_ray", "own_head", "release_ray", "seed_tuner"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_own: Head | None = None


def own_head() -> Head | None:
    """The head this process started for itself, while it runs."""
    return _own


def cluster_address() -> str | None:
    """The cluster a driver here would use: ``RAY_ADDRESS``, or None (a head of its own)."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    return None if address in ("", "local") else address


def _own_auth() -> dict[str, str]:
    """Ray's auth settings for a head of our own, set in this process too (the driver): token
    auth with ``RAY_AUTH_TOKEN`` if given, else a token made for this head alone;
    ``RAY_AUTH_MODE=disabled`` is respected (tests)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return {"RAY_AUTH_MODE": "disabled"}
    token = os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def _use_auth(auth: dict[str, str]) -> None:
    """``auth`` in this process's environment, and in Ray's settings if it read them already."""
    changed = any(os.environ.get(k) != v for k, v in auth.items())
    os.environ.update(auth)
    if not changed:
        return
    # Ray reads RAY_AUTH_MODE into its config when it is imported, and caches the token on
    # first use: both read again (what Ray itself does when ray.init() turns token auth on).
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def ensure_ray() -> None:
    """Connect this process to Ray once: the cluster in ``RAY_ADDRESS``, else a head of its
    own (stopped by ``release_ray`` or when the process exits).

    Raises:
        ConfigurationError: ``RAY_ADDRESS`` names a cluster that does not answer, or a head
            of its own did not start (the message says why and what to do).
    """
    import ray

    global _own
    with _lock:
        if ray.is_initialized():
            return
        address = cluster_address()
        if address is not None:
            _connect(address)
            return
        auth = _own_auth()
        _use_auth(auth)
        try:
            head = start_head(env={**head_environment(), **auth}, tied_to_this_process=True)
        except HeadStartError as err:
            raise ConfigurationError(
                f"could not start a local Ray for this command: {err}\nTo use a running "
                "cluster instead, set RAY_ADDRESS to its GCS address (host:port)"
            ) from err
        _own = head
        atexit.register(release_ray)
        # Anything in this process that looks for "the cluster" (Ray Tune's and Ray Train's
        # driver-side clients) finds this one.
        os.environ["RAY_ADDRESS"] = head.gcs_address
        logger.info("started a local Ray head of its own at %s", head.gcs_address)
        ray.init(address=head.gcs_address, log_to_driver=True)


RAY_CURRENT_CLUSTER = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
"""Where ``ray start`` (on Ray's default temp dir) leaves its address for ``auto``; a head
stopped by a signal leaves it behind."""


def _connect(address: str) -> None:
    import ray

    if address == "auto" and RAY_CURRENT_CLUSTER.is_file():
        named = RAY_CURRENT_CLUSTER.read_text().strip()
        if named and not reachable(named):
            raise ConfigurationError(
                f"RAY_ADDRESS=auto, and {RAY_CURRENT_CLUSTER} names {named}, but nothing "
                "answers there: the last `ray start` on this machine has stopped and left its "
                f"address behind. Remove the file (rm {RAY_CURRENT_CLUSTER}), set RAY_ADDRESS "
                "to a running cluster, or unset RAY_ADDRESS to let this command start a local "
                "Ray of its own"
            )
    if address.lower().startswith(("http://", "https://")):
        raise ConfigurationError(
            f"RAY_ADDRESS={address} is a job server (dashboard) address: `ray job submit "
            "--address` takes that one, but a command that trains connects to the cluster's GCS "
            "address, host:port (`kaisa-ray head start` prints it as 'GCS host:port (for "
            "RAY_ADDRESS)'; on a cluster's head node it is the port `ray start --head` was "
            "given, 6379 by default). Set RAY_ADDRESS to that, or unset it to let this command "
            "start a local Ray of its own"
        )
    plain = "://" not in address and address != "auto"
    if plain and not reachable(address):
        raise ConfigurationError(
            f"RAY_ADDRESS={address}, but nothing answers there: the cluster it named has "
            "stopped (a head stopped with `kill` leaves its address behind in a shell's "
            "environment). Start that cluster again, point RAY_ADDRESS at a running one, or "
            "unset RAY_ADDRESS to let this command start a local Ray of its own"
        )
    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as err:
        raise ConfigurationError(
            f"cannot reach the Ray cluster at RAY_ADDRESS={address} ({err}). Start it, point "
            "RAY_ADDRESS at a running cluster, or unset RAY_ADDRESS to let this command start "
            "a local Ray of its own"
        ) from err


def release_ray() -> None:
    """Stop the head this process started for itself (if any), after saving what later
    commands read to the local store; a no-op otherwise. Safe to call twice."""
    global _own, _seeded
    with _lock:
        head, _own, _seeded = _own, None, False
        if head is None:
            return
        import ray

        try:
            if ray.is_initialized():
                _save_store()
        except Exception as err:  # the store is best effort: the head must stop regardless
            logger.warning("could not save this run's records and profiles: %s", err)
        finally:
            ray.shutdown()
            head.stop()
            if os.environ.get("RAY_ADDRESS") == head.gcs_address:
                del os.environ["RAY_ADDRESS"]


def _named(name: str, namespace: str) -> Any:
    """A named actor of this cluster, or None when nobody created it."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


_seeded = False


def seed_tuner() -> None:
    """On a head of this process's own: the tuner's profiles from the local store, into this
    head's tuner (once; a job with ``kfac: auto`` calls it before its workers ask the tuner).
    Elsewhere nothing: a cluster's tuner keeps its own."""
    import ray

    from tuner.actor import tuner_actor

    global _seeded
    with _lock:
        if _own is None or _seeded:
            return
        _seeded = True
        profiles = LocalStore().profiles()
        if profiles:
            ray.get(tuner_actor().remember.remote(profiles))
            logger.info("the tuner starts with %d profile(s) from the local store", len(profiles))


def _save_store() -> None:
    """Every run's records and the tuner's profiles, from this head into the local store."""
    import ray

    from kaisa_train.progress import SINK_NAME, SINK_NAMESPACE
    from tuner.actor import TUNER_NAME, TUNER_NAMESPACE

    store = LocalStore()
    sink = _named(SINK_NAME, SINK_NAMESPACE)
    if sink is not None:
        for run in ray.get(sink.runs.remote()):
            page = ray.get(sink.read.remote(run))
            store.save_run(run, page["records"])
    tuner = _named(TUNER_NAME, TUNER_NAMESPACE)
    if tuner is not None:
        store.save_profiles(ray.get(tuner.profiles.remote()))
