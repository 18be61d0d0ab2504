"""The dashboard's "What would this cost?" in a real browser: the app under uvicorn on a
loopback port (``FakeRunner`` for Ray: planning needs none), Debian's Chromium through
Selenium and Debian's ChromeDriver. The form describes ResNet-50 on 64 GPUs, the box prices it
on the A100 preset, the page shows the tuner's choice and the table per strategy, and the
figures are the REST API's; a job that cannot be planned shows why; nothing is submitted and
the console shows no error but the 401 before the token and the 422 the test causes."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from support.browser import (
    NEEDS_BROWSER,
    text_of,
    wait,
)
from support.fake_runner import FakeRunner
from support.served import serve

from service.app import create_app
from service.settings import Settings

TOKEN = "plan-dashboard-token"

pytestmark = NEEDS_BROWSER


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FakeRunner]]:
    fake = FakeRunner()
    settings = Settings(data_dir=tmp_path_factory.mktemp("service"), token=SecretStr(TOKEN))
    app = create_app(settings, runner=fake)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        server, thread, url = serve(app, sock)
        yield url, fake
        server.should_exit = True
        thread.join(timeout=15)
        assert not thread.is_alive(), "uvicorn did not shut down"


def test_the_form_prices_the_job_before_it_is_submitted(
    browser: Any, site: tuple[str, FakeRunner], tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url, fake = site
    shots = tmp_path
    browser.get(url + "/#/new")
    wait(lambda: browser.find_element(By.ID, "token-dialog").get_attribute("open") is not None,
         "the token dialog")  # fmt: skip
    browser.find_element(By.ID, "token-input").send_keys(TOKEN)
    browser.find_element(By.ID, "token-submit").click()
    form = wait(lambda: browser.find_element(By.ID, "submit-form"), "the form")
    box = wait(lambda: browser.find_element(By.ID, "plan-box"), "the plan box")
    hardware = wait(
        lambda: [o.text for o in Select(box.find_element(By.ID, "plan-hardware")).options],
        "the hardware presets",
    )
    assert "a100-80gb-hdr: 8 x NVIDIA A100-SXM4-80GB" in hardware

    def fill(name: str, value: str) -> None:
        field = form.find_element(By.NAME, name)
        field.clear()
        field.send_keys(value)

    Select(form.find_element(By.NAME, "model.name")).select_by_value("resnet50")
    Select(form.find_element(By.NAME, "dataset.name")).select_by_value("synthetic")
    fill("dataset.batch_size", "32")
    fill("scaling.workers", "64")
    Select(form.find_element(By.NAME, "kfac.strategy")).select_by_value("auto")
    fill("memory_budget", "40GB")
    browser.find_element(By.ID, "plan-button").click()
    choice = wait(lambda: text_of(browser, "#plan-choice"), "the plan's choice", timeout_s=60)
    assert "64 x NVIDIA A100-SXM4-80GB (8 node(s) of 8), budget 37.25 GiB per GPU" in choice
    assert re.search(r"the tuner would choose (HYBRID-OPT|MEM-OPT).* per step", choice)
    rows = browser.find_elements(By.CSS_SELECTOR, "#plan-table tbody tr")
    assert [r.find_element(By.CSS_SELECTOR, "td").text for r in rows] == [
        "MEM-OPT", "HYBRID-OPT 1/32", "HYBRID-OPT 1/16", "HYBRID-OPT 1/8", "HYBRID-OPT 1/4",
        "HYBRID-OPT 1/2", "COMM-OPT",
    ]  # fmt: skip
    assert "Where the choice changes as the budget grows: from" in text_of(browser, "#plan-result")
    browser.save_screenshot(str(shots / "plan-box.png"))

    # The same figures as the API's for the same job.
    import httpx

    spec = {
        "name": "my-kfac-job",
        "model": {"name": "resnet50"},
        "dataset": {"name": "synthetic", "batch_size": 32},
        "kfac": {"strategy": "auto", "damping": 0.1},
        "memory_budget": "40GB",
        "scaling": {"workers": 64},
        "stop": {"max_steps": 1000},
    }
    report = httpx.post(
        url + "/v1/plan",
        json={"spec": spec},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    ).json()
    chosen = report["choices"][0]["chosen"]
    assert chosen["strategy"] in choice
    assert f"{chosen['factor_update_steps']}/{chosen['inv_update_steps']}" in choice

    # A job that cannot be planned says why in the box; nothing was submitted.
    Select(form.find_element(By.NAME, "kfac.strategy")).select_by_value("off")
    browser.find_element(By.ID, "plan-button").click()
    error = wait(lambda: text_of(browser, "#plan-error"), "the plan's error")
    assert "kfac: off; there is no K-FAC to plan" in error
    assert not fake.submitted
    severe = [
        e["message"]
        for e in browser.get_log("browser")
        if e["level"] == "SEVERE" and not re.search(r"status of (401|422) ", e["message"])
    ]
    assert not severe, severe
