"""The registry's commands: promote, rollback, pull, lineage, list, compare, observe."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from draftline.cli.common import _stdout_to_stderr, cli, model_name
from draftline.registry.policy_file import load_policy, policy_path
from draftline.store import check_store


def _client():
    from draftline import tracking

    tracking.setup_read_only()  # the registry's commands log no runs, and never create a tracking store
    return tracking.client()


def _report(out: dict, as_json: bool) -> None:
    from draftline.registry.promotion import format_results

    if as_json:
        click.echo(json.dumps({**out, "results": [r.__dict__ for r in out["results"]]}, indent=2))
        return
    if out["results"]:
        click.echo(format_results(out["results"]))
    click.echo(out["message"])


@cli.command()
@click.argument("name", callback=model_name)
@click.argument("version")
@click.option("--to", "stage", type=click.Choice(["Staging", "Production"], case_sensitive=False), required=True,
              help="The stage to promote to.")
@click.option("--policy", "policy_file", default=None,
              help="Policy YAML, or a set draftline ships by name (gpu: gates on speed, for GPU deployments) "
              "[default: $DRAFTLINE_REGISTRY_POLICIES/<stage>.yaml, else registry_policies/<stage>.yaml].")
@click.option("--dry-run", is_flag=True, help="Evaluate the policy and change nothing.")
@click.option("--demote", is_flag=True, help="Allow moving the version that holds Production (or Staging) to the "
              "other stage, leaving the stage it held empty.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def promote(name, version, stage, policy_file, dry_run, demote, as_json):
    """Promote VERSION of registered model NAME to a stage through its policy (registry_policies/): the alias
    (@staging/@production) moves to it, and the stage with it, archiving the previous holder. Promoting the
    version that already holds the stage changes nothing."""
    policy = policy_path(stage, policy_file)
    load_policy(policy)  # before MLflow loads: a bad policy is one line at once
    check_store(read_only=True)
    from draftline.registry.promotion import promote as run

    with _stdout_to_stderr():
        out = run(_client(), name, version, stage, policy_file=policy, dry_run=dry_run, demote=demote)
    _report(out, as_json)


@cli.command()
@click.argument("name", callback=model_name)
@click.option("--to", "version", default=None, help="The version to put back [default: the one Production held "
              "before the current holder].")
@click.option("--reason", required=True, help="Why (recorded on the version with who and when).")
@click.option("--policy", "policy_file", default=None,
              help="Production policy YAML, or a shipped set by name (gpu) [default: "
              "$DRAFTLINE_REGISTRY_POLICIES/production.yaml, else registry_policies/production.yaml].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def rollback(name, version, reason, policy_file, as_json):
    """Put Production of NAME back on the version it held before (or --to VERSION). The integrity rules of the
    Production policy still apply; "not worse than the current Production" does not."""
    policy = policy_path("Production", policy_file)
    load_policy(policy)
    check_store(read_only=True)
    from draftline.registry.promotion import rollback as run

    with _stdout_to_stderr():
        out = run(_client(), name, to=version, reason=reason, policy_file=policy)
    _report(out, as_json)


@cli.command("list")
@click.argument("name", required=False, callback=model_name)
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def list_cmd(name, as_json):
    """The registered models (aliases, latest version), or NAME's versions (stage, aliases, headline metric,
    parent)."""
    check_store(read_only=True)
    from draftline.registry import views

    with _stdout_to_stderr():
        client = _client()
        rows = views.list_versions(client, name) if name else views.list_models(client)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        click.echo(views.render_versions(name, rows) if name else views.render_models(rows))


@cli.command()
@click.argument("name", callback=model_name)
@click.argument("versions", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def compare(name, versions, as_json):
    """VERSIONS of NAME side by side (lineage, data digest, headline metrics, stage), each version's registered
    parent included; rows where they differ are starred."""
    check_store(read_only=True)
    from draftline.registry import views

    with _stdout_to_stderr():
        table = views.compare(_client(), name, list(versions))
    click.echo(json.dumps(table, indent=2) if as_json else views.render_compare(table))


UNCHANGED = 3  # pull --if-changed: DEST already holds the version named


@cli.command()
@click.argument("name", required=False, callback=model_name)
@click.option("--stage", default=None, help="Pull the version in this stage (e.g. Production).")
@click.option("--alias", default=None, help="Pull the version this alias points at (e.g. production).")
@click.option("--version", "version", default=None, help="Pull this version number.")
@click.option("--dest", type=click.Path(file_okay=False), default=None, help="Directory to download into.")
@click.option("--verify-only", "verify_dir", type=click.Path(file_okay=False), default=None,
              help="Download nothing: re-hash every file of this already pulled directory against its "
              "checksums.json (a pod checking what its disk holds); exit 1 naming the first altered file.")
@click.option("--verifier", default=None, help="Refuse the version unless it was trained for this verifier.")
@click.option("--cache/--no-cache", "cache", default=None,
              help="The local content-addressed cache ($DRAFTLINE_CACHE_DIR, default ~/.cache/draftline). By "
              "default a pull takes what the cache holds, and keeps what it downloads where the cache's copy is a "
              "clone (XFS with reflink, btrfs) or $DRAFTLINE_CACHE_DIR is set; --cache keeps it on any file "
              "system (a second write of every byte on ext4, repaid by the next pull of those bytes on this "
              "node); --no-cache neither reads nor keeps.")
@click.option("--if-changed", is_flag=True,
              help="For orchestrators that restart pods themselves: when DEST already holds the version the stage or "
              "alias names, download nothing and exit 3 (0: a new version was pulled).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def pull(name, stage, alias, version, dest, verifier, cache, if_changed, as_json, verify_dir):
    """Download a registered drafter, verify every file against its checksums, print the vLLM command.

    Files are hashed while they arrive; files already in the local content-addressed cache (same sha256, hashed
    when they were cached, unchanged since by their size, modification and change times) are cloned or copied
    from it, so a restarted pod or a version sharing files downloads nothing. DEST never shares a file with
    the cache or with another DEST. DEST receives the complete verified directory or is left as it was. A
    drafter vLLM would serve other than as it was trained is refused (as by --verify-only): aux layers its two
    model runners would read differently, or fc_norm (EAGLE 3.1) in its config that its tensors do not bear out;
    re-export it."""
    from draftline.drafter.servable import require_servable  # light: json, headers and the errors only

    if verify_dir:
        from draftline.registry.transfer import verify_directory

        out = verify_directory(Path(verify_dir))
        require_servable(Path(verify_dir))
        click.echo(json.dumps(out, indent=2) if as_json else
                   f"{out['path']}: {out['files']} files, {out['bytes'] / (1 << 20):.1f} MiB, every sha256 as "
                   "checksums.json names it")
        return
    if not name or not dest:
        raise click.UsageError("pass NAME and --dest (or --verify-only DIR)")
    if sum(bool(x) for x in (stage, alias, version)) != 1:  # before any tracking store is touched
        raise click.UsageError("pass exactly one of --stage, --alias or --version")
    check_store(read_only=True)
    from draftline.registry import versions

    with _stdout_to_stderr():
        out = versions.pull(_client(), name, stage=stage, alias=alias, version=version, dest=Path(dest),
                            verifier=verifier, use_cache=cache, check=require_servable, if_changed=if_changed)
    if out.get("unchanged"):
        click.echo(json.dumps(out, indent=2) if as_json else
                   f"{out['path']} already holds models:/{name}/{out['version']}: nothing downloaded")
        sys.exit(UNCHANGED)
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        mib = 1 << 20
        click.echo(f"pulled models:/{name}/{out['version']} into {out['path']} (checksums verified; "
                   f"{out['downloaded_bytes'] / mib:.1f} MiB downloaded, {out['cached_bytes'] / mib:.1f} MiB "
                   f"from the verified cache)\n{out['command']}")


@cli.command()
@click.argument("name", callback=model_name)
@click.argument("version")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def lineage(name, version, as_json):
    """The ancestry of VERSION of NAME (a number, a stage, @alias, or a models:/ URI) back to its external
    root, with the data digest and headline metrics of every generation."""
    check_store(read_only=True)
    from draftline.registry.ancestry import ancestors, render

    uri = version if version.startswith("models:/") else \
        f"models:/{name}@{version[1:]}" if version.startswith("@") else f"models:/{name}/{version}"
    with _stdout_to_stderr():
        chain = ancestors(_client(), uri)
    click.echo(json.dumps(chain, indent=2) if as_json else render(chain))


@cli.command()
@click.option("--endpoint", "endpoints", multiple=True, required=True,
              help="A serving vLLM's OpenAI base URL (http://host:8000/v1); repeat it for several servers behind "
              "one name (their counters are summed). Credentials in the URL or the API key are never logged.")
@click.option("--drafter", "drafter_dir", type=click.Path(file_okay=False), default=None,
              help="The pulled directory the servers load: its checksums.json names the registered version. "
              "`draftline serve`'s DEST/serving points at the version vLLM runs; as a sidecar, observe follows it.")
@click.option("--version", "version", default=None,
              help="Or the version itself: models:/NAME/VERSION (or /STAGE, @alias).")
@click.option("--model", default=None, help="The served model name [default: the first server's first].")
@click.option("--window", "window_s", type=click.FloatRange(1), default=60.0, show_default=True,
              help="Seconds between the two reads of /metrics.")
@click.option("--every-minutes", type=click.FloatRange(0, min_open=True), default=None,
              help="Run as a sidecar: one window every N minutes (until stopped, or --windows).")
@click.option("--windows", type=click.IntRange(1), default=None, help="With --every-minutes: stop after N windows.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def observe(endpoints, drafter_dir, version, model, window_s, every_minutes, windows, as_json):
    """Record what serving vLLM sees on the version it serves: acceptance length and per-position rates from
    its spec-decode counters over a window, on the version's LoggedModel (served/*), and say whether it is as
    the evaluation measured or below its interval (exit 1 when below: an alert)."""
    check_store(read_only=False)
    from draftline import tracking
    from draftline.console import say
    from draftline.evaluation import observe as observing

    tracking.setup()
    with _stdout_to_stderr():
        out = observing.run(tracking.client(), list(endpoints), model=model, drafter_dir=drafter_dir, version=version,
                            window_s=window_s, every_s=every_minutes * 60 if every_minutes else None,
                            windows=windows, say=say)
    click.echo(json.dumps(out, indent=2) if as_json else
               f"models:/{out['name']}/{out['version']}: served {out['served_acceptance_length']} "
               f"({'BELOW the evaluation' if out['below'] else 'as evaluated'}); run {out['run_id']}")
    if out["below"]:
        raise SystemExit(1)
