"""``draftline``'s command group and the helpers its commands share.

Options of the stage commands are generated from the stage's pydantic settings (their descriptions are the
help), and ``--config FILE`` supplies any of them from YAML (flag > file > default). Expected failures print one
line and exit 1 (2 for usage errors); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import typing

import click
import pydantic

from draftline import console, environment
from draftline.config import check_model_name, groups, load_file, resolve
from draftline.errors import DraftlineError
from draftline.results import Result

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _Command(click.Command):
    """Accepts ``--snake_case`` spellings of its options (MLflow passes undeclared parameters that way); lists a
    grouped stage's options under its groups' titles in ``--help``."""

    def format_options(self, ctx, formatter):
        grouped = getattr(self.callback, "settings_groups", None)
        if not grouped:
            return super().format_options(ctx, formatter)
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx)}
        placed: set[str | None] = set()
        for title, fields in grouped:
            placed.update(fields)
            rows = [r for n in fields if (r := records.get(n))]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        rest = [r for n, r in records.items() if n not in placed and r]
        if rest:
            with formatter.section("Other options"):
                formatter.write_dl(rest)
        return None

    def parse_args(self, ctx, args):
        known = {o for p in self.params for o in p.opts}
        fixed = []
        for arg in args:
            name, eq, value = arg.partition("=")
            if name.startswith("--") and "_" in name and name not in known and name.replace("_", "-") in known:
                arg = name.replace("_", "-") + eq + value
            fixed.append(arg)
        return super().parse_args(ctx, fixed)


class _Group(click.Group):
    """Every expected failure ends in one ``error: …`` line and its exit code: a :class:`DraftlineError`, and
    click's own usage errors (a bad flag, a missing argument, a value its type refuses), which click would
    print as a usage block of several lines. ``--help`` (and ``draftline`` alone) print the help as before."""

    command_class = _Command

    def make_context(self, info_name, args, parent=None, **extra):
        try:  # the group's own flags: `draftline --bogus`
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.ClickException as e:
            _one_line(_usage_message(e), e.exit_code)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DraftlineError as e:
            _one_line(str(e), e.exit_code)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.ClickException as e:  # a command's flags and arguments, and its own click.UsageError
            _one_line(_usage_message(e), e.exit_code)


def _usage_message(e: click.ClickException) -> str:
    """click's message on one line, pointing at the command's help."""
    message = " ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
    ctx = getattr(e, "ctx", None)
    if ctx is None:
        return message
    message = message.rstrip(".")
    return f"{message}{' ' if message.endswith('?') else '; '}see `{ctx.command_path} --help`"


def _one_line(message: str, code: int) -> typing.NoReturn:
    click.secho(f"error: {message}", fg="red", err=True)
    raise click.exceptions.Exit(code)


def model_name(ctx, param, value):
    """click callback of every registered-model NAME argument and option: the one rule for names
    (:func:`draftline.config.check_model_name`), before anything is read or changed."""
    return value if value is None else check_model_name(value)


def _is_list(annotation) -> bool:
    return any(typing.get_origin(a) is list for a in (annotation, *typing.get_args(annotation)))


class _OrUnset(click.ParamType):
    """A setting's click type that also takes ``""``: what MLproject passes for a parameter left unset (the
    setting's default then applies)."""

    def __init__(self, inner: click.ParamType):
        self.inner, self.name = inner, inner.name

    def convert(self, value, param, ctx):
        return "" if value == "" else self.inner.convert(value, param, ctx)

    def get_metavar(self, param, ctx):
        return self.inner.get_metavar(param, ctx)


def _click_type(annotation) -> click.ParamType:
    """click's type for a settings field, so that ``--help`` shows it and click refuses a wrong value in one
    line: INTEGER, FLOAT, BOOLEAN, a choice for a ``Literal``; text for strings and lists (``2,30,58``, parsed
    by :func:`_settings`). Bounds stay with pydantic, which checks them once for flags and files alike."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return _OrUnset(click.Choice([str(a) for a in args]))
    inner = [a for a in args if a is not type(None)] if args else [annotation]
    if _is_list(annotation) or len(inner) != 1:
        return _OrUnset(click.STRING)
    types: dict[object, click.ParamType] = {int: click.INT, float: click.FLOAT, bool: click.BOOL}
    return _OrUnset(types.get(inner[0], click.STRING))


def _bounds(field) -> str:
    """pydantic's bounds of a field as click shows a range: ``  [0<=x<=3]`` (empty when unbounded)."""
    low = next((f"{m.ge}<=" for m in field.metadata if getattr(m, "ge", None) is not None), "") or next(
        (f"{m.gt}<" for m in field.metadata if getattr(m, "gt", None) is not None), "")
    high = next((f"<={m.le}" for m in field.metadata if getattr(m, "le", None) is not None), "") or next(
        (f"<{m.lt}" for m in field.metadata if getattr(m, "lt", None) is not None), "")
    return f"  [{low}x{high}]" if low or high else ""


def _metavar(annotation) -> str | None:
    return "A,B,C" if _is_list(annotation) else None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(model, f):
    """Wrap a command so that a required setting given neither as a flag nor in ``--config`` is a usage error
    (exit 2, click's format) before the command body runs. click's own ``required=True`` cannot be used: the
    config file may supply the value."""

    @functools.wraps(f)
    def checked(*args, **kwargs):
        missing = [n for n, fld in model.model_fields.items() if fld.is_required() and kwargs.get(n) in (None, "")]
        if missing and kwargs.get("config_file"):
            in_file = load_file(kwargs["config_file"])
            missing = [n for n in missing if in_file.get(n) in (None, "")]
        if missing:
            flags = ", ".join(f"'{_flag(n)}'" for n in missing)
            raise click.UsageError(f"Missing option{'s' if len(missing) > 1 else ''} {flags} (or set "
                                   f"{', '.join(missing)} in the --config file).", ctx=click.get_current_context())
        return f(*args, **kwargs)

    return checked


def _field_options(model, name: str, f):
    """Decorate ``f`` with the option of settings field ``name`` of ``model`` (``--kebab-name``): click's type,
    pydantic's bounds and the default shown in the help, the description as its help."""
    field = model.model_fields[name]
    flag = _flag(name)
    default = None if field.is_required() else field.default
    help_ = (field.description or "") + _bounds(field) + (
        f"  [default: {default}]" if default not in (None, "") else "") + (
        "  [required]" if field.is_required() else "")
    if field.annotation is bool:
        # `--log-shards`, `--no-log-shards`, or a value (`--log-shards false`, as MLproject passes it)
        f = click.option(f"--no-{name.replace('_', '-')}", f"no_{name}", is_flag=True, default=False,
                         hidden=True)(f)
        return click.option(flag, name, type=_click_type(bool), is_flag=False, flag_value="true", default=None,
                            help=help_, metavar="[true|false]")(f)
    # typed by click, bounded by pydantic: an empty value (MLproject's "unset") means the default
    return click.option(flag, name, type=_click_type(field.annotation), default=None, help=help_,
                        metavar=_metavar(field.annotation))(f)


def settings_options(model):
    """Decorate a command with one option per settings field (``--kebab-name``), help from the description.
    A setting without a default is marked ``[required]`` and checked before the command runs."""

    def decorate(f):
        f = _require(model, f)
        for name in reversed(list(model.model_fields)):
            f = _field_options(model, name, f)
        f.settings_groups = groups(model)  # --help lists them under their groups' titles (_Command)
        return click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                            help="YAML file of settings (flags override it).")(f)

    return decorate


def shared_settings(model, *names: str):
    """The options ``names`` of the stage settings ``model``, declared once there and taken as they are by
    another command (``plan`` takes finetune's): the same flag, type, bounds, default and help. Each value is
    checked by the stage's own field (a bad one is click's one-line usage error) and reaches the command
    resolved: unset is the stage's default."""

    def decorate(f):
        @functools.wraps(f)
        def resolved(*args, **kwargs):
            for name in names:
                kwargs[name] = _field_value(model, name, kwargs.get(name))
            return f(*args, **kwargs)

        g = resolved
        for name in reversed(names):
            g = _field_options(model, name, g)
        return g

    return decorate


def _field_value(model, name: str, value):
    field = model.model_fields[name]
    if value in (None, "") and field.is_required():
        raise click.UsageError(f"Missing option '{_flag(name)}'.", ctx=click.get_current_context())
    if value in (None, ""):
        return field.default
    try:
        return getattr(_one_field(model, name)(**{name: value}), name)
    except pydantic.ValidationError as e:
        raise click.BadParameter(e.errors()[0]["msg"], param_hint=f"'{_flag(name)}'") from None


@functools.cache
def _one_field(model, name: str) -> type[pydantic.BaseModel]:
    """A model of ``model``'s field ``name`` alone, with the field validators the stage's model runs on it (the
    registered model's name rule, ...): the value is checked once, as the stage checks it."""
    field = model.model_fields[name]
    validators = {key: pydantic.field_validator(name, mode=dec.info.mode)(classmethod(getattr(dec.func, "__func__",
                                                                                                dec.func)))
                  for key, dec in model.__pydantic_decorators__.field_validators.items() if name in dec.info.fields}
    return pydantic.create_model(f"{model.__name__}.{name}", __validators__=validators,  # type: ignore[call-overload]
                                 **{name: (field.annotation, field)})


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send everything printed meanwhile to stderr, from Python and from child processes (fd 1 itself):
    MLflow, DeepSpeed and the runs `main` starts all print there."""
    try:
        out_fd, err_fd = sys.__stdout__.fileno(), sys.__stderr__.fileno()
        saved = os.dup(out_fd)
    except (AttributeError, OSError, ValueError):
        saved = None
    try:
        if saved is not None:
            sys.__stdout__.flush()
            os.dup2(err_fd, out_fd)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            sys.__stdout__.flush()
            os.dup2(saved, out_fd)
            os.close(saved)


def _result(fn, *args, **kwargs):
    """Run a library call with its output on stderr; print its result as JSON on stdout, so
    `draftline ... | jq` always works."""
    with _stdout_to_stderr():
        out = fn(*args, **kwargs)
    click.echo(json.dumps(out.to_json() if isinstance(out, Result) else out, indent=2, default=str))
    return out


def _settings(model, config_file, flags):
    flags = {k: v for k, v in flags.items() if v != ""}
    for name in [k for k in flags if k.startswith("no_") and k[3:] in model.model_fields]:
        if flags.pop(name):
            flags[name[3:]] = False
    for name, field in model.model_fields.items():
        value = flags.get(name)
        if _is_list(field.annotation) and isinstance(value, str):
            try:
                flags[name] = [int(x) for x in value.replace(" ", "").split(",") if x]
            except ValueError:
                raise click.BadParameter(f"expected comma-separated integers such as 2,30,58, got {value!r}",
                                         param_hint="--" + name.replace("_", "-")) from None
    return resolve(model, flags=flags, file=config_file)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="draftline")
@click.option("-v", "--verbose", count=True, help="Show the libraries' warnings and INFO logs (-vv: DEBUG too); "
              "the same as DRAFTLINE_LOG=info (or debug). Quiet by default.")
def cli(verbose: int):
    """draftline: EAGLE-3 drafters made from a verifier's own outputs, finetuned from a parent drafter with
    DeepSpeed ZeRO, and shipped with their lineage through the MLflow Model Registry to vLLM.

    \b
    Pipeline:  prepare -> finetune -> export (registers a version) -> promote -> pull
    Tracking:  MLFLOW_TRACKING_URI (default: sqlite:///$PWD/mlflow.db); experiment: DRAFTLINE_EXPERIMENT
    Verbosity: quiet by default; -v or DRAFTLINE_LOG=info|debug shows the libraries' warnings and logs
    """
    console.configure(verbose)
    environment.check()  # a DRAFTLINE_* variable of the wrong type: one line, before any work


