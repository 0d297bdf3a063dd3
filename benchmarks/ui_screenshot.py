"""ui-screenshot: what the MLflow UI shows of a registered drafter, evaluated beside served, as a PNG for the docs.

The version is pulled as a serving host pulls it, served by real vLLM beside its verifier (the directory its
lineage names, ``verifier.path``), given a little traffic (a few prompts), and
``draftline observe`` records the window on it. Then a real ``mlflow server`` on the same tracking store serves the
UI, and headless Chromium (Debian's ``chromium``) takes the version's LoggedModel page, where the evaluation's
``eval/*`` and the fleet's ``served/*`` metrics sit side by side, and the experiment's model list, one row per
drafter. Writes ``docs/img/ui-logged-model.png`` (the evaluation's figures), ``docs/img/ui-served.png`` (the fleet's)
and ``docs/img/ui-models.png``.

After ``./demo_real.sh`` (``--registered-model smollm2-gsm8k-drafter``, the default) or ``./demo_kimi.sh``
(``--registered-model kimi-drafter``), on the demo's store (``$MLFLOW_TRACKING_URI``, default ``sqlite:///mlflow.db``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

from draftline import names

DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not found:
        raise SystemExit("no chromium here: apt-get install chromium (Debian's package)")
    return found


def screenshot(url: str, out: Path, *, wait_for: str, search: str | None = None,
               size: tuple[int, int] = (1500, 1100)) -> Path:
    """A PNG of the UI page ``url`` once ``wait_for`` (a text on it) has drawn, its assistant panel closed and, on a LoggedModel page,
    its metrics table filtered by ``search`` (Playwright driving Debian's Chromium: ``pip install playwright``,
    no browser download)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise SystemExit("this benchmark drives Chromium with Playwright: pip install playwright") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": size[0], "height": size[1]})
        page.goto(url, wait_until="load")
        page.get_by_text(wait_for).first.wait_for(timeout=60000)  # the UI polls: it is never network-idle
        close = page.get_by_role("button", name="Close")
        if close.count():
            close.first.click()
        if search:
            box = page.get_by_placeholder("Search metrics")
            box.wait_for(timeout=30000)
            box.fill(search)
            box.scroll_into_view_if_needed()
        page.wait_for_timeout(1500)
        page.screenshot(path=str(out), full_page=True)
        browser.close()
    return out


def _observe(client, name: str, version: str, window_s: float, verifier: str | None) -> dict:
    """Serve the pulled version on loopback vLLM, send its evaluation prompts, record one observe window."""
    import httpx
    from click.testing import CliRunner

    from draftline.cli import cli
    from draftline.registry.versions import pull
    from draftline.serving.engine import ServeSpec, VllmServer
    from draftline.serving.hf_model import allow_custom_code

    mv = client.get_model_version(name, version)
    verifier = verifier or mv.tags.get(names.VERIFIER_PATH)
    if not verifier or not Path(verifier).is_dir():
        raise SystemExit(f"models:/{name}/{version}'s verifier {verifier} is not on this machine: pass --verifier DIR")
    if mv.tags.get(names.VERIFIER_TRUST_REMOTE_CODE) == "True":
        allow_custom_code(verifier)
    prompts = ["What is 12 times 7?", "Name three prime numbers.", "Explain what a drafter does.",
               "A train leaves at 3 pm at 60 km/h; how far has it gone at 5 pm?"]
    with tempfile.TemporaryDirectory(prefix="draftline-ui-") as tmp:
        pulled = pull(client, name, stage=None, alias=None, version=version, dest=Path(tmp) / "drafter")
        spec = pulled["speculative_config"]
        with VllmServer(ServeSpec(model=verifier, served_name="drafted", max_model_len=1024, drafter=spec["model"],
                                  k=spec["num_speculative_tokens"])) as served:
            def traffic():
                for p in prompts * 2:
                    httpx.post(served.endpoint + "/completions", timeout=300, json={
                        "model": "drafted", "prompt": p, "max_tokens": 32, "temperature": 0})

            sender = threading.Thread(target=traffic)
            sender.start()
            r = CliRunner().invoke(cli, ["observe", "--endpoint", served.endpoint, "--drafter", spec["model"],
                                         "--window", str(window_s), "--json"])
            sender.join()
    if r.exit_code not in (0, 1):
        raise SystemExit(f"observe failed: {r.output[-2000:]}")
    return json.loads(r.stdout)


def run(registered: str = "smollm2-gsm8k-drafter", version: str | None = None, observe: bool = True,
        window_s: float = 30.0, verifier: str | None = None) -> dict:
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path('mlflow.db').absolute()}")
    from mlflow import MlflowClient

    from draftline.registry.versions import model_id_of
    from tests.kit.localserver import start_mlflow_server, stop

    name, client = registered, MlflowClient()
    versions = client.search_model_versions(f"name = '{name}'")
    if not versions:
        raise SystemExit(f"no registered model {name} in {os.environ['MLFLOW_TRACKING_URI']}: run its demo first")
    version = version or max(versions, key=lambda v: int(v.version)).version
    observed = _observe(client, name, version, window_s, verifier) if observe else None
    mv = client.get_model_version(name, version)
    model_id = model_id_of(mv)
    logged = client.get_logged_model(model_id)
    with tempfile.TemporaryDirectory(prefix="draftline-ui-server-") as root:
        proc, uri = start_mlflow_server(Path(root), backend_store_uri=os.environ["MLFLOW_TRACKING_URI"])
        try:
            page = f"{uri}/#/experiments/{logged.experiment_id}/models/{model_id}"
            model_png = screenshot(page, DOCS_IMG / "ui-logged-model.png", wait_for="Datasets used",
                                   search="measured/acceptance_length")
            served_png = screenshot(page, DOCS_IMG / "ui-served.png", wait_for="Datasets used", search="served/")
            list_png = screenshot(f"{uri}/#/experiments/{logged.experiment_id}/models", DOCS_IMG / "ui-models.png",
                                  wait_for=name)
        finally:
            stop(proc)
    metrics = {m.key: m.value for m in logged.metrics or []}
    shown = {k: round(v, 4) for k, v in sorted(metrics.items())
             if k.startswith(("served/acceptance_length", names.MEASURED_ACCEPTANCE_LENGTH, "eval/speed/c1/speedup"))}
    return {"summary": {"version": f"models:/{name}/{version}", "served": logged.tags.get(names.SERVED_ACCEPTANCE_LENGTH),
                        "verdict": logged.tags.get(names.SERVED_VERDICT),
                        "images": [str(p.relative_to(DOCS_IMG.parent.parent)) for p in (model_png, served_png, list_png)]},
            "metrics_shown": shown, "observed": observed,
            "method": "draftline pull -> vLLM serves it beside its verifier -> traffic -> draftline observe; then "
                      "mlflow server on the same store and headless Chromium (--virtual-time-budget 20 s)"}
