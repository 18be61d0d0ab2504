"""The README's service quickstart, run verbatim as a user would: a fresh home, a
checkout-like folder, no venv on PATH, the README's own ``kaisa-ray serve`` with its embedded
Ray head."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from support.ray_head import TEST_ENV

from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_train.head import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]


README_BLOCKS = re.compile(r"```bash\n(.*?)```", re.S)


def readme_quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("<!-- service-quickstart:begin -->")[1]
    section = section.split("<!-- service-quickstart:end -->")[0]
    return "\n".join(README_BLOCKS.findall(section))


@pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
)
def test_the_readme_service_quickstart_runs_verbatim(tmp_path: Path) -> None:
    """The README's service blocks, as written, in a fresh home and a checkout-like folder,
    for a user who never activated the venv (no venv on PATH): serve, submit --follow, jobs,
    the REST quickstart, follow the events, cancel, SIGTERM."""
    script = readme_quickstart()
    assert ".venv/bin/kaisa-ray serve &" in script
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in (".venv", "examples"):
        (clone / name).symlink_to(ROOT / name)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KAISA_RAY_", "RAY_", "VIRTUAL_ENV"))
    }
    env.update(TEST_ENV)
    env.update(HOME=str(home), KAISA_RAY_PORT=str(free_port()), PATH="/usr/bin:/bin")
    done = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert re.search(r"job \w+: SUCCEEDED", output), output[-4000:]
    assert '"state":"SUCCEEDED"' in output  # the REST job's event stream, to its end
    assert re.search(r"job \w+: CANCELL(ING|ED)", output), output[-4000:]
    assert "shutdown complete" in output
    assert (clone / "job.json").is_file()
    assert (home / "kaisa-ray" / "jobs.db").is_file()  # the default data directory, fresh
