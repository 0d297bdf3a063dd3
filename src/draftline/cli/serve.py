"""``draftline serve``: the deployment side of the registry (the work is in :mod:`draftline.serving.deploy`)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from draftline import names
from draftline.cli.common import _stdout_to_stderr, cli, model_name
from draftline.store import check_store


@cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("name", callback=model_name)
@click.option("--stage", default=None, help="Serve the version in this stage (e.g. Production).")
@click.option("--alias", default=None, help="Serve the version this alias points at (e.g. production).")
@click.option("--version", "version", default=None, help="Serve this version number (nothing to follow).")
@click.option("--dest", type=click.Path(file_okay=False), required=True,
              help="Folder the versions are pulled into (DEST/v<N>, verified as by pull).")
@click.option("--verifier", default=None,
              help="The verifier this host serves (its path or id), given to vLLM; a version trained for another "
                   "one is refused [default: the one the version records].")
@click.option("--vllm", "vllm_cmd", default=None,
              help="The command that starts this host's vLLM server [default: `vllm serve` on the PATH, else "
                   "$DRAFTLINE_VLLM_PYTHON -m vllm.entrypoints.openai.api_server].")
@click.option("--follow-minutes", type=click.FloatRange(0, min_open=True), default=None,
              help="Ask the registry every N minutes which version the stage or alias names, and switch vLLM to it "
                   "when it moves (a promotion or a rollback).")
@click.option("--stop-timeout", type=click.FloatRange(0), default=120.0, show_default=True,
              help="Seconds vLLM gets to stop after SIGTERM (on a switch or a signal) before SIGKILL.")
@click.option("--log", "log_file", type=click.Path(dir_okay=False), default=None,
              help="Append vLLM's output to this file [default: it goes to this command's output].")
@click.option("--print", "print_only", is_flag=True, help="Pull and verify, print the vLLM command, start nothing.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(name, stage, alias, version, dest, verifier, vllm_cmd, follow_minutes, stop_timeout, log_file, print_only,
          vllm_args):
    """Serve the drafter a registry stage names with this host's vLLM: pull and verify the version, start
    `vllm serve` for its verifier with the version's --speculative-config and this host's own flags (after
    `--`, e.g. `-- --tensor-parallel-size 8 --port 8000`), forward SIGTERM/SIGINT to vLLM and exit with its
    status. With --follow-minutes it switches to the version the stage names whenever a promotion or a rollback
    moves it; a failed pull or an unreachable registry leaves the serving version serving. Every switch is
    recorded on the versions (served.<host>.since / .until)."""
    if sum(bool(x) for x in (stage, alias, version)) != 1:
        raise click.UsageError("pass exactly one of --stage, --alias or --version")
    if version and follow_minutes:
        raise click.UsageError("--follow-minutes follows a --stage or an --alias; a --version never moves")
    passthrough = [a for a in vllm_args if a != "--"]
    check_store(read_only=True)
    from draftline.console import say
    from draftline.serving import deploy

    prefix = deploy.launcher(vllm_cmd) if not print_only else shlex.split(vllm_cmd or "vllm serve")
    install = None if print_only else _vllm_install(prefix, say)
    follow = _registry_follow(name, stage, alias, version, Path(dest), verifier, install, say)
    if print_only:
        with _stdout_to_stderr():
            v = follow.pull(follow.current())
        click.echo(shlex.join(deploy.argv(prefix, v, passthrough)))
        return
    code = deploy.serve(follow, prefix, passthrough, every_s=follow_minutes * 60 if follow_minutes else None,
                        stop_timeout_s=stop_timeout, say=say, log=Path(log_file) if log_file else None)
    sys.exit(code)


def _vllm_install(prefix: list[str], say):
    """The vLLM the host's command runs, or None (said) when its Python cannot be told."""
    from draftline.serving import vllm_install

    install = vllm_install.find(prefix)
    if install is None:
        say(f"cannot tell which vLLM {shlex.join(prefix)} runs (not a Python nor a script of one); whether it serves "
            "each drafter is left to vLLM")
    return install


def _registry_follow(name: str, stage: str | None, alias: str | None, version: str | None, dest: Path,
                     verifier: str | None, install, say):
    """The registry side of serving: the version named now, its verified pull into DEST/v<N>, and the record of
    a switch on the version (a failure to record is said, never fatal). A version this host's vLLM (``install``)
    or verifier cannot serve is refused before anything is downloaded."""
    from draftline import tracking
    from draftline.drafter.servable import require_servable
    from draftline.errors import DraftlineError
    from draftline.kinds import layer_kind
    from draftline.registry import versions
    from draftline.registry.lineage import verifier_identity
    from draftline.registry.retry import retrying
    from draftline.serving import deploy, vllm_install

    tracking.setup_read_only()
    client = tracking.client()
    uri = f"models:/{name}/{stage.capitalize()}" if stage else f"models:/{name}@{alias}" if alias else \
        f"models:/{name}/{version}"
    host = deploy.host_name()

    def current() -> str:
        return str(retrying(f"resolve {uri}", lambda: versions.resolve_version(client, uri, refuse_split=True))[1]
                   .version)

    def pull(number: str) -> deploy.Version:
        tags = retrying(f"read models:/{name}/{number}", lambda: client.get_model_version(name, number)).tags
        kind = layer_kind(tags.get(names.DRAFTER_LAYER))
        if install is not None:
            vllm_install.check(install, kind, f"models:/{name}/{number}")
        if verifier:  # before anything is downloaded
            deploy.check_verifier(verifier, verifier_identity(verifier, verifier)[0], tags, f"models:/{name}/{number}",
                                  say)
        with _stdout_to_stderr():
            out = versions.pull(client, name, stage=None, alias=None, version=number, dest=dest / f"v{number}",
                                check=require_servable)
        return deploy.Version(number=str(out["version"]), directory=Path(out["path"]),
                              spec=out["speculative_config"], verifier=verifier or out["verifier"],
                              trust_remote_code=tags.get(names.VERIFIER_TRUST_REMOTE_CODE) == "True",
                              dtype=kind.served_dtype)

    def record(number: str, what: str, when: str) -> None:
        try:
            client.set_model_version_tag(name, number, f"served.{host}.{what}", when)
        except Exception as e:  # noqa: BLE001 (serving goes on whatever the registry answers)
            say(f"could not record served.{host}.{what} on version {number} ({DraftlineError(str(e))})")

    return deploy.Follow(current=current, pull=pull, record=record)
