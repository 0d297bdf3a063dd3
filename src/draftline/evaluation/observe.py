"""What the fleet sees: a serving vLLM's spec-decode counters over a window, recorded on the registered version
it serves, beside what the evaluation promised.

vLLM exposes its speculative decoding as Prometheus counters on ``/metrics`` (``vllm:spec_decode_num_drafts``,
``…_num_draft_tokens``, ``…_num_accepted_tokens``, ``…_num_accepted_tokens_per_pos{position}``). A window is the
difference of two reads. A counter that went down means the server restarted in between: that server's window
then counts from its restart (its second read alone), and the window says it saw a reset. Several servers behind
one served name are read one by one and summed. The served acceptance length is vLLM's ``1 + accepted / drafts``.

The version is found from the directory the server loads (the pulled drafter: the digest of its
``checksums.json`` is the version's ``export.sha256``, and where one export was registered as several versions,
the ``v<N>`` folder ``draftline serve`` pulled it into says which; a directory vLLM would serve other than as it
was trained is refused, :mod:`draftline.drafter.servable`), or named (``models:/NAME/VERSION``). Each window is a step
of one ``observe`` run, logged on the version's LoggedModel as ``served/*``, and compared with the version's
measured evaluation on the Production policy's set: inside or above its interval is "as evaluated"; below its
lower bound, "below" (the command then exits 1, for an alert). Traffic is not the evaluation set, so this says
whether production serves as evaluated, not why. Endpoints are logged without credentials.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlflow

from draftline import names, tracking
from draftline.data.regenerate import served_models
from draftline.drafter.servable import require_servable
from draftline.errors import DataError, DraftlineError, RegistryError
from draftline.registry.evidence import evaluations_of
from draftline.registry.policies import policy_set
from draftline.registry.versions import model_id_of, resolve_version
from draftline.serving.client import auth_headers, read_counters, redact
from draftline.util import manifest_digest

SERVED = "served"


@dataclass
class Window:
    seconds: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    generated: int = 0  # the tokens the servers generated in the window (0 where they do not export it)
    per_pos: dict[int, int] = field(default_factory=dict)
    servers: int = 0
    resets: int = 0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    def rates(self) -> list[float]:
        return [self.per_pos.get(p, 0) / self.drafts if self.drafts else 0.0 for p in range(len(self.per_pos))]

    def metrics(self) -> dict[str, float]:
        out = {f"{SERVED}/acceptance_length": self.acceptance_length, f"{SERVED}/drafts": float(self.drafts),
               f"{SERVED}/draft_tokens": float(self.draft_tokens), f"{SERVED}/accepted_tokens": float(self.accepted),
               f"{SERVED}/generated_tokens": float(self.generated),
               f"{SERVED}/window_s": self.seconds, f"{SERVED}/servers": float(self.servers),
               f"{SERVED}/counter_resets": float(self.resets)}
        out.update({f"{SERVED}/acceptance_rate_pos{p}": r for p, r in enumerate(self.rates())})
        return out


def read_all(endpoints: list[str], model: str) -> list[dict]:
    headers = auth_headers()
    return [read_counters(e, model, headers) for e in endpoints]


def window(before: list[dict], after: list[dict], seconds: float) -> Window:
    """The counters' differences, summed over servers; a server whose counters went down restarted: its
    window is its counts since the restart."""
    w = Window(seconds=seconds, servers=len(after))
    for b, a in zip(before, after, strict=True):
        reset = any(a[k] < b[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
        base = {k: 0.0 for k in b} if reset else b
        w.resets += int(reset)
        w.drafts += int(round(a["num_drafts"] - base["num_drafts"]))
        w.draft_tokens += int(round(a["num_draft_tokens"] - base["num_draft_tokens"]))
        w.accepted += int(round(a["num_accepted_tokens"] - base["num_accepted_tokens"]))
        w.generated += int(round(a.get("generation_tokens", 0.0) - base.get("generation_tokens", 0.0)))
        per_b = {} if reset else b["num_accepted_tokens_per_pos"]
        for p, v in a["num_accepted_tokens_per_pos"].items():
            w.per_pos[p] = w.per_pos.get(p, 0) + int(round(v - per_b.get(p, 0.0)))
    return w


def identify(client, *, drafter_dir: str | None, version: str | None):
    """The registered version served: named (``models:/NAME/VERSION|STAGE|@alias``), or the one whose
    ``export.sha256`` is the digest of the pulled directory's ``checksums.json``. Raises :class:`RegistryError`."""
    if version:
        return resolve_version(client, version)[1]
    if not drafter_dir:
        raise RegistryError("say which version the server serves: --drafter <the pulled directory it loads> or "
                            "--version models:/NAME/VERSION")
    path = Path(drafter_dir) / "checksums.json"
    try:
        digest = manifest_digest(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise RegistryError(f"{path} is unreadable ({type(e).__name__}): pass the directory `draftline pull` "
                            "wrote, or --version models:/NAME/VERSION") from None
    require_servable(drafter_dir)  # vLLM would serve it other than as it was measured
    found = client.search_model_versions(f"tags.`export.sha256` = '{digest}'")
    if len(found) > 1:  # one export registered twice: `draftline serve` pulls version N into DEST/vN
        named = [mv for mv in found if Path(drafter_dir).resolve().name == f"v{mv.version}"]
        found = named if len(named) == 1 else found
    if len(found) != 1:
        raise RegistryError(f"{drafter_dir} is {'no' if not found else 'more than one'} registered version (export "
                            f"digest {digest[:12]}): pass --version models:/NAME/VERSION")
    return found[0]


def promised(client, mv) -> tuple[float, float, float, str] | None:
    """The version's measured acceptance on the Production policy's evaluation set (else its newest measured
    one): ``(value, low, high, set name)``, or None when it was never measured."""
    evaluations = [e for e in evaluations_of(client, model_id_of(mv)) if names.MEASURED_ACCEPTANCE_LENGTH in e.metrics]
    if not evaluations:
        return None
    wanted = policy_set("Production")
    ev = next((e for e in evaluations if e.name == wanted), evaluations[0])
    m = ev.metrics
    return m[names.MEASURED_ACCEPTANCE_LENGTH], m.get(names.MEASURED_LOW, m[names.MEASURED_ACCEPTANCE_LENGTH]), m.get(names.MEASURED_HIGH, m[names.MEASURED_ACCEPTANCE_LENGTH]), ev.name


def verdict(w: Window, evaluated: tuple[float, float, float, str] | None) -> tuple[bool, str]:
    """``(below, the line said)``."""
    served = f"served acceptance {w.acceptance_length:.3f} over {w.drafts} drafts in {w.seconds:.0f} s"
    if w.resets:
        served += f" ({w.resets} server restart{'s' if w.resets > 1 else ''} in the window: counted from it)"
    if evaluated is None:
        return False, f"{served}; the version has no measured evaluation to compare with"
    value, low, high, name = evaluated
    band = f"evaluated {value:.3f} [{low:.3f}, {high:.3f}] on {name}"
    if w.acceptance_length < low:
        return True, f"BELOW: {served}, under the evaluation's interval ({band})"
    return False, f"as evaluated: {served}; {band}"


def check_endpoints(endpoints: list[str], model: str) -> None:
    """Every endpoint answers as a vLLM with a drafter (before any run exists)."""
    read_all(endpoints, model)


def one_window(endpoints: list[str], model: str, seconds: float) -> Window:
    before, t0 = read_all(endpoints, model), time.monotonic()
    time.sleep(seconds)
    after = read_all(endpoints, model)
    w = window(before, after, time.monotonic() - t0)
    if w.drafts <= 0:
        raise DataError(f"no speculative decoding on {', '.join(map(redact, endpoints))} in {w.seconds:.0f} s "
                        "(no drafts counted): no traffic in the window; nothing was recorded")
    return w


def run(client, endpoints: list[str], *, model: str | None, drafter_dir: str | None, version: str | None,
        window_s: float, every_s: float | None = None, windows: int | None = None, say=print) -> dict:
    """Observe ``endpoints`` for one window (or one every ``every_s`` seconds, ``windows`` of them or until
    stopped), recording each on the version served; returns the last window's summary with ``below`` (any
    window under the evaluation's interval). Everything that can be checked is checked before a run exists,
    and a window without traffic records nothing.

    As a sidecar, the version served is found again at every window (``--drafter DEST/serving``, the link
    ``draftline serve`` moves on each switch, or a stage or alias): when it is another one, the windows go to it,
    in a run of its own, and a window during which it changed is said and not recorded."""
    def served():
        return _served_version(client, drafter_dir, version)

    mv = served()
    model = model or served_models(endpoints[0], what="vLLM endpoint", flag="--endpoint")[0]
    check_endpoints(endpoints, model)
    say(f"observing {len(endpoints)} server(s) serving {model} as models:/{mv.name}/{mv.version}, "
        f"{window_s:.0f} s windows ...")
    if every_s is None:
        w = one_window(endpoints, model, window_s)  # no run before a window with traffic
    else:  # a sidecar waits for traffic, and records a window on the version served throughout it
        mv, w = _next_window(endpoints, model, window_s, 0.0, say, served)
    below_any, out, recorded = False, {}, 0
    while True:
        evaluated = promised(client, mv)
        tags = {names.OBSERVE_VERSION: f"models:/{mv.name}/{mv.version}", "draftline.observe.model": model}
        with tracking.stage_run("observe", run_name=f"observe {mv.name} v{mv.version}", tags=tags) as active:
            tracking.log_params_once({"endpoints": ",".join(redact(e) for e in endpoints), "model": model,
                                      "window_s": window_s, "version": f"models:/{mv.name}/{mv.version}"})
            step = 0
            while True:
                below, line = verdict(w, evaluated)
                below_any |= below
                _record(w, below, model_id_of(mv), active.info.run_id, step)
                say(line)
                out = {"version": mv.version, "name": mv.name, "run_id": active.info.run_id, "below": below_any,
                       "served_acceptance_length": round(w.acceptance_length, 4), "drafts": w.drafts,
                       "generated_tokens": w.generated,
                       "rates": [round(r, 4) for r in w.rates()], "window_s": round(w.seconds, 1),
                       "resets": w.resets, "evaluated": list(evaluated[:3]) if evaluated else None}
                step += 1
                recorded += 1
                if every_s is None or (windows is not None and recorded >= windows):
                    return out
                now, w = _next_window(endpoints, model, window_s, every_s, say, served)
                if _key(now) != _key(mv):
                    say(f"now serving models:/{now.name}/{now.version} (was v{mv.version}): its windows go to it, "
                        "in a run of its own")
                    mv = now
                    break


def _key(mv) -> tuple[str, str]:
    return mv.name, str(mv.version)


def _served_version(client, drafter_dir: str | None, version: str | None):
    """The version served now, with a LoggedModel to record on."""
    mv = identify(client, drafter_dir=drafter_dir, version=version)
    if not model_id_of(mv):
        raise RegistryError(f"models:/{mv.name}/{mv.version} has no LoggedModel to record on (registered before "
                            "draftline 3): re-export it")
    return mv


def _record(w: Window, below: bool, model_id: str | None, run_id: str, step: int) -> None:
    assert model_id, "_served_version returns versions with a LoggedModel"
    metrics = {**w.metrics(), f"{SERVED}/below_evaluation": float(below)}
    mlflow.log_metrics(metrics, step=step, model_id=model_id)  # on the run, linked to the version's model
    mlflow.set_logged_model_tags(model_id, {
        names.SERVED_ACCEPTANCE_LENGTH: f"{w.acceptance_length:.4f}",
        names.SERVED_VERDICT: "below evaluation" if below else "as evaluated",
        names.SERVED_OBSERVED_AT: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        names.SERVED_OBSERVE_RUN: run_id})


def _next_window(endpoints: list[str], model: str, window_s: float, every_s: float, say, served):
    """The sidecar's next window with traffic and one version served throughout, with that version: a quiet
    window, one during which the version changed, or a registry that did not answer is said, records nothing,
    and the next is tried."""
    while True:
        time.sleep(max(0.0, every_s - window_s))
        try:
            before = served()
            w = one_window(endpoints, model, window_s)
            after = served()
        except DraftlineError as e:  # said; the sidecar goes on with the next window
            say(str(e))
            continue
        if _key(before) != _key(after):
            say(f"the version served changed during the window (v{before.version} to v{after.version}); nothing "
                "was recorded")
            continue
        return after, w
