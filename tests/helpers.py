"""Run the real entry points in subprocesses, as a user would, with shrunk settings."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]

# A short classification run on the embedded digits: the real configs, shrunk.
FAST_TRAIN = ("trainer.epochs=1", "trainer.max_steps=3", "trainer.batch_size=32", "trainer.progress=false",
              "trainer.log_every=1", "trainer.num_workers=0")


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")  # + --nproc_per_node=N


def run_entry(script: str, *args: str, env: Optional[Dict[str, str]] = None, timeout: int = 600,
              check: bool = True, launcher: Sequence[str] = (), root: Path = REPO,
              fork: bool = False) -> subprocess.CompletedProcess:
    """``python <script> <args>`` from the repository root (or a copy of it: ``root``); raises with the
    output on failure. ``fork=True``: a process forked from this one (:class:`Forked`), not a fresh interpreter;
    with torchrun as the ``launcher``, its agent is the forked process (:func:`torchrun`)."""
    full_env = {**os.environ, "WANDB_MODE": "disabled", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
                "HYDRA_FULL_ERROR": "1", **(env or {})}
    if fork:  # the script, or torchrun's agent, forked
        assert root == REPO, "a forked child runs this process's package"
        assert not launcher or tuple(launcher[:3]) == TORCHRUN[:3], "torchrun is the launcher a fork knows"
        child = (torchrun(*launcher[3:], root / script, *args, env=full_env) if launcher else
                 Forked([root / script, *args], env=full_env, cwd=root, stderr=True))
        stdout, stderr = child.communicate(timeout=timeout)
        return _checked(subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr or ""), check)
    cmd = [*launcher, str(root / script), *args] if launcher else [sys.executable, str(root / script), *args]
    with subprocess.Popen(cmd, cwd=root, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as child:  # its own process group: a hung run goes whole
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # torchrun's workers too, not only the agent
            stdout, stderr = child.communicate()
            raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout} s\n--- stdout\n{stdout[-4000:]}\n"
                                 f"--- stderr\n{stderr[-6000:]}") from None
    return _checked(subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr), check)


def _checked(proc: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, proc.args))} exited {proc.returncode}\n--- stdout\n"
                             f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


class Forked:
    """``python <argv...>`` as a process forked from this one: a process of its own (pid, signals, exit status,
    environment, working directory, resource limits: ``preexec`` runs in it first), without the 5-7 s of CPU a fresh
    interpreter spends importing torch, timm and Hydra. ``argv[0]`` (a script) runs as ``__main__`` with that
    ``sys.argv``; ``code=`` runs a string instead (as ``python -c``). Its output goes to a file, stdout and stderr
    together unless ``stderr=True``; the interface is Popen's (``poll``, ``wait``, ``send_signal``, ``communicate``,
    ``returncode``). Where the fresh interpreter is what a test is about (the README's command, what a process
    imports, torchrun's processes, the SLURM line) the test starts one with ``subprocess`` instead."""

    def __init__(self, argv: Sequence[str] = (), env: Optional[Dict[str, str]] = None, cwd: Path = REPO,
                 preexec=None, code: Optional[str] = None, stderr: bool = False):
        import tempfile
        self.args, self.returncode = [*argv], None
        self._out = tempfile.TemporaryFile()
        self._err = tempfile.TemporaryFile() if stderr else self._out
        env = {**os.environ, "WANDB_MODE": "disabled", "MPLBACKEND": "Agg", **(env or {})}
        sys.stdout.flush()  # nothing buffered here is written twice, by the child too
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            _forked_child(self.args, env, cwd, preexec, code, self._out.fileno(), self._err.fileno())

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        import time
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)  # its loader workers too

    def _read(self, f) -> str:
        f.seek(0)
        return f.read().decode(errors="replace")

    def output(self) -> str:
        """What it has written so far (to stdout, and to stderr unless ``stderr=True``)."""
        return self._read(self._out)

    def communicate(self, timeout: Optional[float] = None):
        """(its output, its stderr: None unless ``stderr=True``) once it ends; killed, with its output in the error,
        if it is not done within ``timeout`` s."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            output = self._read(self._out)[-6000:]
            raise AssertionError(f"{self.args} did not finish in {timeout} s\n{output}") from None
        return self._read(self._out), (self._read(self._err) if self._err is not self._out else None)


def _forked_child(argv, env, cwd, preexec, code, out_fd, err_fd) -> None:
    """In the forked child: this test process's state undone where a fresh interpreter would differ (fds, streams,
    signal handlers, exit handlers, logging, Hydra's singletons, environment, directory, ``sys.argv`` and
    ``sys.path[0]``), then the script; ``os._exit`` with its status, as the interpreter would end."""
    import atexit
    import logging
    import runpy
    import traceback
    status = 1
    try:
        os.setsid()  # its own process group, as run_entry's children: a kill takes its loader workers too
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the test worker's channel to pytest
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdin = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        atexit._clear()  # the test process's; the script's own run at the end
        logging.getLogger().handlers.clear()
        logging.getLogger().setLevel(logging.WARNING)
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.hydra_config import HydraConfig
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
        os.environ.clear()
        os.environ.update(env)
        if "torch" in sys.modules:  # one intra-op thread: the OpenMP pool of this process's threads is not in the
            import torch  # child, whose first parallel region would wait for it forever (a suite run with -n 0)
            torch.set_num_threads(1)
        os.chdir(cwd)
        if preexec is not None:
            preexec()
        first = "" if code is not None else str(Path(argv[0]).resolve().parent)  # as python -c / python script
        sys.path[:0] = [first, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
        if code is not None:
            sys.argv = ["-c", *map(str, argv)]
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = [str(a) for a in argv]
            runpy.run_path(str(argv[0]), run_name="__main__")
        status = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(ranks: int, script, *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 300,
              check: bool = True) -> List[Forked]:
    """``python <script> <args>`` on ``ranks`` gloo ranks of this machine, each a :class:`Forked` process with the
    variables torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``; rank 0 hosts the rendezvous's store, as without torchrun's agent). For what
    many ranks do in training; what torchrun itself does (its signals, its ending of the other workers) is tested
    under :func:`torchrun`. The ended ranks (their output: ``rank.output()``). With ``check``, raises with every rank's
    output when one fails (the others are ended 30 s later: they could be waiting in a collective) or time runs out."""
    import time

    import torch.distributed as dist
    assert not dist.is_initialized(), "a forked rank would inherit this process's group"
    shared = {"WANDB_MODE": "disabled", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1",
              **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks),
              "LOCAL_WORLD_SIZE": str(ranks)}
    procs = [Forked([script, *args], env={**shared, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(ranks)]
    end = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        if any(p.returncode for p in procs):
            end = min(end, time.monotonic() + 30)
        time.sleep(0.05)
    for p in procs:
        p.kill()
        p.wait()
    if check and any(p.returncode for p in procs):
        told = "\n".join(f"--- rank {r} exited {p.returncode}\n{p.output()[-4000:]}" for r, p in enumerate(procs))
        raise AssertionError(f"{script} on {ranks} ranks\n{told}")
    return procs


TORCHRUN_MAIN = "import runpy; runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)"


def torchrun(*argv: str, env: Optional[Dict[str, str]] = None, cwd: Path = REPO) -> Forked:
    """``python -m torch.distributed.run <argv>``: torchrun's agent, forked from this process (its workers are the fresh
    interpreters it starts), its output in one stream. :meth:`Forked.kill` ends the agent's process group, not its
    workers: torchrun starts each in a session of its own. The agent's own 2.5 s of importing torch are spared; what
    it does is torchrun's."""
    full_env = {"WANDB_MODE": "disabled", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", **(env or {})}
    return Forked([str(a) for a in argv], env=full_env, cwd=cwd, code=TORCHRUN_MAIN)


def load_tool(name: str, folder: str = "tools"):
    """Import ``tools/<name>.py`` (or ``<folder>/<name>.py``) as a module (the tools are scripts, not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", REPO / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does (a dataclass's annotations are looked up there)
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module; its siblings (``harness``, ...) import from ``benchmarks/``, which
    pytest puts on the path (``pyproject.toml``), as running the script does."""
    return load_tool(name, "benchmarks")


def save_untrained_classifier(path: Path, img_size: int) -> Path:
    """An untrained digits proxy classifier for ``img_size`` saved at ``path``, as the trainer saves a trained one (a
    run's copy, ``digits_classifier=``, or ``classifier_cache_path(img_size)``: it carries the cache's key): the sample
    metrics' plumbing without training one, which takes minutes (the tests of that training aside)."""
    import torch

    from moh_vision.analysis.metrics import DigitsClassifier, classifier_key
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": DigitsClassifier().state_dict(), "img_size": img_size, "key": classifier_key(img_size)}, path)
    return path


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def bf16_train_outputs(modules, x):
    """Each module's train-mode output under CPU bf16 autocast (checked bf16, with a finite input
    gradient after a backward), as float: what the sparse-vs-masked autocast tests compare."""
    import torch
    outs = []
    for m in modules:
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m.train()(xi)
        assert y.dtype == torch.bfloat16
        y.float().square().mean().backward()
        assert torch.isfinite(xi.grad).all()
        outs.append(y.float())
    return outs


def recorded_backward(m, x, grad_out, train: bool):
    """One forward in a routing recorder, then backward of ``sum(y * grad_out) + aux`` (aux at weight 1):
    ``(y, input gradient, {parameter: gradient}, recorder)``, what the sparse-vs-masked tests compare."""
    from moh_vision.attention import record_routing
    m.train(train)
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with record_routing(m) as routing:
        y = m(x)
    ((y * grad_out).sum() + routing.aux_loss(coef=1.0)).backward()
    return y.detach(), x.grad, {name: p.grad for name, p in m.named_parameters()}, routing


def model_config(name: str, **overrides) -> dict:
    """A model config as train.py passes it to a task: every key present."""
    return {"name": name, "checkpoint_path": None, "init_from": None, "kwargs": {}, **overrides}


ATTENTION_PRESET = {"name": None, "aux_loss_weight": 0.01}  # keep the model's own attention


def trainer_config(**overrides):
    """The trainer's typed config with the defaults of the schema, shrunk for tests (no progress bar,
    no FLOP count); ``ema={...}`` overrides the EMA options."""
    from moh_vision.config import EmaConfig, TrainerConfig
    ema = EmaConfig(**overrides.pop("ema", {}))
    settings = {"progress": False, "count_flops": False, "device": "cpu", **overrides}
    return TrainerConfig(ema=ema, **settings)


def assert_compiles_for_hopper_without_spills(fn, meta: dict, pointer_types: Dict[str, str], num_warps: int,
                                              tmp_path: Path, ints: Sequence[str] = (), floats: Sequence[str] = ()) -> None:
    """Compile the Triton kernel ``fn`` for sm_90 (Triton's compiler and its bundled ptxas: no GPU) with the
    constexprs ``meta`` and fail on any spill to local memory. Parameters named with a capital are pointers (``pointer_types``
    names their element type, default ``*bf16``) unless listed in ``ints``; those in ``floats`` are ``fp32``; the
    rest are ``i32``."""
    import inspect

    import pytest
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton without its bundled ptxas")
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in meta else pointer_types.get(n, "*bf16") if n[0].isupper() and n not in ints
                 else "fp32" if n in floats else "i32" for n in names}
    constants = {(names.index(n),): meta[n] for n in names if n in meta}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptx = tmp_path / f"{fn.fn.__name__}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    report = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                            capture_output=True, text=True, check=True).stderr
    assert " 0 bytes spill stores" in report, (fn.fn.__name__, report)


# Runs each named script in turn in one process and writes {name: None, or the traceback of its failure} as JSON.
_INTERPRETER_RUNNER = r"""
import json, sys, traceback
scripts, tests, out = json.loads(open(sys.argv[1]).read()), sys.argv[2], sys.argv[3]
results = {}
for name, source in scripts.items():
    sys.argv = ["-c", tests]
    try:
        exec(compile(source, name, "exec"), {"__name__": "__main__"})
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()[-4000:]
open(out, "w").write(json.dumps(results))
"""


def run_in_triton_interpreter(scripts: Dict[str, str], tmp: Path) -> Dict[str, Optional[str]]:
    """Run the named ``scripts`` (Python; ``sys.argv[1]`` is the tests folder) in turn in one fresh process with
    ``TRITON_INTERPRET=1`` (Triton decides at import whether its language is interpreted): for each name, None or
    the traceback of its failure. One process for them all: each would spend 5 s of CPU importing torch and Triton."""
    import pytest
    pytest.importorskip("triton")
    (tmp / "scripts.json").write_text(json.dumps(scripts))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", _INTERPRETER_RUNNER, str(tmp / "scripts.json"),
                           str(Path(__file__).parent), str(tmp / "results.json")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((tmp / "results.json").read_text())


class Spy(TorchDispatchMode):
    """The operators dispatched while it is open, by name (``seen``)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
