"""The service and its dashboard end to end: the real ``kaisa-ray serve`` with its embedded
Ray head, a SQLite file, and Debian's Chromium driven by Selenium through Debian's
ChromeDriver (no download).

The test asks for the token as a first-time user would meet it, submits a ``kfac: auto`` job
through the form (first with a bad damping, which must be named next to its field), sees the
job in the list and opens its page. Then the service is killed (``kill -9``) while the job
trains and started again on the same data directory: it adopts its Ray head, keeps the job's
history, and follows the job to SUCCEEDED, and the open page reconnects and draws the whole
run (with what happened while no service watched). The page is checked (curves, the tuner's
table with what the budget ruled out, spec, log) and saved as a screenshot under the test's
output (``tmp_path``; also to ``$KAISA_RAY_SCREENSHOT`` when set, which is how the README's is
made). A graceful stop then takes the embedded head down.
The browser's console must show no error but the HTTP ones the test causes (the 401 before
the token, the 422 of the bad spec): a script error or a blocked outside request (the page's
Content-Security-Policy allows its own origin only) fails it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.browser import NEEDS_BROWSER, points, text_of, wait
from support.service_process import ServiceProcess, start_service

from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_train.head import free_port
from service.head import RayHead

TOKEN = "dashboard-e2e-token"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.skipif(
        not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
    ),
    NEEDS_BROWSER,
]


def console_errors(driver: Any) -> list[str]:
    """SEVERE console entries, but for the errors the test causes on purpose: the 401 before
    the token, the 422 of the bad spec, and the broken stream, refused connections and dead
    sockets while the killed service is down (a request in flight when it is killed fails
    with ERR_SOCKET_NOT_CONNECTED or ERR_CONNECTION_RESET, by when it was sent)."""
    expected = re.compile(
        r"status of (401|422) |net::ERR_INCOMPLETE_CHUNKED_ENCODING|net::ERR_CONNECTION_REFUSED"
        r"|net::ERR_SOCKET_NOT_CONNECTED|net::ERR_CONNECTION_RESET"
    )
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and not expected.search(entry["message"])
    ]


def test_a_job_from_the_form_survives_a_service_crash_and_is_watched_to_the_end(
    browser: Any, tmp_path: Path
) -> None:
    data = tmp_path / "service"
    port = free_port()  # the restarted service takes the same one: the open page reconnects
    first = start_service(data, token=TOKEN, port=port)  # no --ray-address: the embedded head
    head = RayHead.load(data / "ray" / "head.json")
    assert head is not None
    assert head.alive()
    started = [first]

    def restart() -> ServiceProcess:
        started.append(start_service(data, token=TOKEN, port=port, log_name="service-2.log"))
        return started[-1]

    try:
        watch(browser, first, restart, tmp_path)
        assert started[-1].stop() == 0
        assert not head.alive()  # the graceful stop took the embedded head down
    finally:
        for service in started:
            if service.process.poll() is None:
                service.kill()
        head.stop(grace_s=1)


def watch(
    driver: Any, first: ServiceProcess, restart: Callable[[], ServiceProcess], tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(first.url + "/")

    # The API wants a token: the page asks for it once.
    dialog = wait(lambda: driver.find_element(By.ID, "token-dialog"), "the token dialog")
    wait(lambda: dialog.get_attribute("open") is not None, "the token dialog to open")
    driver.find_element(By.ID, "token-input").send_keys(TOKEN)
    driver.find_element(By.ID, "token-submit").click()
    wait(lambda: text_of(driver, "#live") == "live", "the event stream to connect")
    assert driver.execute_script("return localStorage.getItem('kaisa-ray-token')") == TOKEN
    # The closed sets the page shows come from the service's registry (the scripts hold no
    # copy: tests/test_definitions.py): the list's state filters are its job states.
    registry = first.client().registry()
    filters = "return [...document.querySelectorAll('[data-filter]')].map(e => e.dataset.filter);"
    assert wait(lambda: driver.execute_script(filters), "the filters") == registry["job_states"]

    # The form: a bad damping is refused, named next to its field.
    driver.find_element(By.ID, "nav-new").click()
    form = wait(lambda: driver.find_element(By.ID, "submit-form"), "the form")
    models = [o.text for o in Select(form.find_element(By.NAME, "model.name")).options]
    assert "lenet" in models

    def values(name: str) -> list[str]:
        options = Select(form.find_element(By.NAME, name)).options
        return [str(o.get_attribute("value")) for o in options]

    assert values("model.name") == registry["models"]
    assert values("optimizer.name") == registry["optimizers"]
    assert values("kfac.strategy") == [*registry["strategies"], "off"]
    # Every field starts at the JobSpec's default as the registry states it (the scripts
    # hold none: tests/test_definitions.py), or at its example where a job must give one.
    starts = {**registry["starter"], **registry["defaults"]}
    for name in (
        "name",
        "dataset.batch_size",
        "optimizer.lr",
        "kfac.damping",
        "kfac.inv_update_steps",
        "scaling.workers",
        "stop.max_steps",
        "eval_every",
    ):
        shown = form.find_element(By.NAME, name).get_attribute("value")
        assert shown == str(starts[name]), (name, shown)  # fmt: skip
    assert (
        Select(form.find_element(By.NAME, "kfac.strategy")).first_selected_option.get_attribute(
            "value"
        )
        == registry["defaults"]["kfac.strategy"]
    )

    def fill(name: str, value: str) -> None:
        field = form.find_element(By.NAME, name)
        field.clear()
        field.send_keys(value)

    fill("name", "dashboard-e2e")
    fill("dataset.batch_size", "64")
    fill("dataset.limit", "2048")
    Select(form.find_element(By.NAME, "kfac.strategy")).select_by_value("auto")
    fill("kfac.damping", "-1")
    # Between the tuner's predicted peaks for f=1/2 (16.60 MiB) and f=1 (16.82 MiB) here (the
    # JobSpec's inverse method; exact to the byte, the same on every run): the budget rules out
    # the f=1 candidates, and the page must say so.
    fill("memory_budget", "16.71MiB")
    fill("scaling.workers", "2")
    fill("stop.max_steps", "160")
    fill("eval_every", "20")
    driver.find_element(By.ID, "submit").click()
    damping_error = wait(
        lambda: text_of(driver, '[data-field="kfac.damping"] .field-error'),
        "the damping's error next to its field",
    )
    assert "greater than 0" in damping_error
    assert driver.find_elements(By.CSS_SELECTOR, '[data-field="kfac.damping"].invalid')
    assert not text_of(driver, '[data-field="name"] .field-error')

    fill("kfac.damping", "0.1")
    driver.find_element(By.ID, "submit").click()
    job_id = wait(
        lambda: (re.fullmatch(r".*#/jobs/([0-9a-f]+)", driver.current_url) or [None, None])[1],
        "the job's page",
    )

    # The list shows it.
    driver.find_element(By.ID, "nav-jobs").click()
    row = f'tr[data-job="{job_id}"]'
    wait(lambda: text_of(driver, f"{row} .job-link") == "dashboard-e2e", "the job in the list")
    assert text_of(driver, f"{row} .badge") in {
        "QUEUED",
        "PROFILING",
        "RUNNING",
        "SUCCEEDED",
    }

    # Its page draws live; then the service dies under it while the job trains.
    # The row is redrawn as events come: find and click in one step, again if it went stale.
    wait(
        lambda: driver.find_element(By.CSS_SELECTOR, f"{row} .job-link").click() or True,
        "a click on the job's link",
    )
    wait(lambda: points(driver, "chart-loss") >= 2, "the loss curve to draw", timeout_s=240)
    client = first.client()
    before = client.job(job_id)
    points_before = client.metrics(job_id)["points"]
    first.kill()
    wait(lambda: text_of(driver, "#live") == "reconnecting…", "the page to see the loss")

    client = restart().client()
    again = client.job(job_id)
    assert again["transitions"][: len(before["transitions"])] == before["transitions"]
    assert client.metrics(job_id)["points"][: len(points_before)] == points_before
    wait(lambda: text_of(driver, "#live") == "live", "the page to reconnect", timeout_s=60)
    wait(
        lambda: driver.find_elements(By.CSS_SELECTOR, '.job-head .badge[data-state="SUCCEEDED"]'),
        "the job to succeed",
        timeout_s=240,
    )
    final = client.job(job_id)
    assert final["progress"]["step"] == 160
    steps = [p["step"] for p in client.metrics(job_id, ["step"])["points"]]
    assert steps == list(range(10, 161, 10))  # nothing lost while no service watched
    # The page has it all too: 16 step points, 8 evaluations (each with 2 series).
    wait(lambda: points(driver, "chart-throughput") == 16, "every step point on the page")
    wait(lambda: points(driver, "chart-accuracy") == 16 + 8, "every evaluation on the page")
    assert driver.find_elements(By.CSS_SELECTOR, "#chart-loss .main-svg"), "Plotly drew nothing"
    candidates = driver.find_elements(By.CSS_SELECTOR, ".candidates tbody tr")
    assert len(candidates) >= 2
    assert len(driver.find_elements(By.CSS_SELECTOR, ".candidates tr.chosen")) == 1
    ruled_out = driver.find_elements(By.CSS_SELECTOR, ".candidates tr.rejected")
    assert ruled_out, "the budget ruled nothing out"
    assert all("ruled out" in row.text and "budget" in row.text for row in ruled_out)
    assert '"strategy": "auto"' in text_of(driver, "#spec")
    wait(lambda: "finished at step 160" in text_of(driver, "#log") or None, "the log's end")
    assert "\x1b[" not in text_of(driver, "#log")
    # A finished job: done, with nothing to cancel (no button at all).
    assert text_of(driver, ".job-head .bar-label").startswith("done")
    assert not driver.find_elements(By.ID, "cancel")

    # The whole page, as on a laptop's width.
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1440, max(1000, int(height) + 150))
    time.sleep(1)  # the charts are responsive: let them redraw at the new size
    shot = tmp_path / "dashboard-job.png"
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 50_000
    if os.environ.get("KAISA_RAY_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["KAISA_RAY_SCREENSHOT"])

    # Back on the list, the job is finished there too (the list followed the event stream).
    driver.find_element(By.ID, "nav-jobs").click()
    wait(lambda: text_of(driver, f"{row} .badge") == "SUCCEEDED", "the list to show SUCCEEDED")
    assert text_of(driver, f'{row} [data-col="accuracy"]').endswith("%")
    driver.set_window_size(1440, 1000)
    driver.save_screenshot(str(tmp_path / "dashboard-list.png"))
    assert console_errors(driver) == []
