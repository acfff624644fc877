"""Asynchronous GRPO (rl.max_staleness = k > 0): a generator process samples the rollouts of the next steps while the
trainer trains, from weights at most k optimizer steps old.

Each rank that generates (rollouts.py: the first of the ranks sharing a batch) starts one generator process: a
fresh interpreter started as the reward workers are (rewards.py says why not a fork or multiprocessing's spawn). It
imports experimental.custom_import, builds the sampler rl.sampler names on a whole model like the trainer's (the
family in training.dtype, model.converters applied, the seeded initialisation) on the trainer's device, and serves
two kinds of messages, in the order they were sent:

- weights: at the start of every step the trainer writes the policy's full state (every parameter and persistent
  buffer, gathered from any layout, on the CPU) to a file in shared memory (/dev/shm where there is one) and sends
  its path with its version, the number of optimizer steps behind it. Before each batch the generator loads the
  newest weights it has been sent (the sampler's ``load_weights``); the trainer removes the older files.
- requests: one batch's prompts (token ids), the sampling settings with the batch's seed, the stop ids, and the
  oldest version the batch may come from. The generator answers each in turn with its completions and the version
  it used; if the newest weights it has are older than allowed it waits for newer ones.

The trainer (rollouts.py) requests the batch of step t once it holds version t - k, with t - k as the oldest version
allowed: while it trains step v the generator works on the batches of steps v + 1 .. v + k, from the newest weights
it has when it starts each. Every batch records the version it came from (metrics rl/sampler_version and
rl/staleness, the step's version minus that), and the trainer refuses one older than allowed. Staleness counts from
the step a batch is made for: with rl.epochs_per_batch = E its later epochs use it up to E - 1 versions later still,
as the synchronous mode does.

The off-policy correction is GRPO's importance ratio itself (components/objectives/grpo.py): each token's
probability under the policy being trained divided by the probability the generator drew it with (the sampler's
log-probabilities travel with the tokens), rho = pi_v(token) / pi_(v - s)(token) for a batch s versions old, clipped
to [1 - clip_low, 1 + clip_high] as PPO clips its ratio against the behaviour policy. With k = 0 and one epoch, rho
is 1 at the step up to numerics; with stale rollouts it is not (metrics rl/mismatch_abs and rl/mismatch_kl measure
how far). Nothing else corrects: no truncated importance weights, no reweighting of whole sequences.

Checkpoints hold no rollouts in flight. A resumed run starts a new generator, sends it the loaded weights first and
regenerates from the saved stream position: the same prompts and seeds as the straight run, but the versions each
batch comes from depend on timing, so a resumed asynchronous run is not bitwise the straight one (a synchronous run
is).

On a CPU device the trainer and the generator compute on the same cores: each takes half of the trainer's threads
(torch.set_num_threads), since two processes with a thread per core wait on each other's descheduled threads
(measured on 2 busy cores: steps 3 to 10 times slower). The overlap only pays where the generator has compute the
trainer leaves idle (idle cores; on a GPU, the time the trainer spends on the host). The generator runs on its
trainer's device: separate generation devices are not supported yet. Weights travel through host memory: on a GPU
each step copies the whole state to the host and back.

Shutdown and failures: RolloutSource.close stops the generator (a stop message after its current batch; killed
after 10 s); a generator whose trainer died exits within a second and removes the weight files. A failure in the
generator (building the sampler, a generation), its death, or its silence reaches the trainer as one line
(DataError): a batch not answered within comm.train_timeout_seconds (comm.init_timeout_seconds for the first, which
includes the generator's start) ends the run.
"""

import importlib
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
from collections import deque
from functools import partial
from multiprocessing.connection import Connection, wait

import torch
from torch import nn

from torchtitan.data import DataError
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.precision import compute_autocast
from torchtitan.generation.engine import Completion
from torchtitan.hardware import DTYPES
from torchtitan.log import logger, one_line
from torchtitan.protocols.model_converter import ModelConverters
from torchtitan.protocols.train_spec import build_model_args, get_train_spec
from torchtitan.rl.rewards import exit_with_parent, start_child
from torchtitan.rl.sampler import SAMPLERS, SamplerContext
from torchtitan.stop_signals import STOP_SIGNALS

# How long a stopped generator may take to finish its batch and close its sampler before it is killed.
STOP_WAIT_SECONDS = 10.0


def whole_model(cfg, device: torch.device) -> nn.Module:
    """The policy's model whole on ``device``, as the trainer builds its local copy (train.py): the family's model in
    training.dtype, converted by model.converters, seeded-initialised."""
    spec = get_train_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model, spec.build_tokenizer_fn(cfg.model.hf_assets_path).vocab_size,
                            cfg.training.seq_len)
    converters = ModelConverters(cfg.model.converters, cfg, ParallelDims(1, 1, 1, 1, 1, world_size=1))
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to(DTYPES[cfg.training.dtype])
    converters.convert(model)
    model.to_empty(device=device)
    model.init_weights(cfg.debug.seed, buffer_device=device)
    converters.init_weights(model, cfg.debug.seed)
    return model.train()


class GeneratorProcess:
    """The trainer's end of one generator process (see the module docstring); ``close`` ends it."""

    def __init__(self, cfg, device: torch.device, threads: int | None = None):
        """``threads``: on a CPU device, the threads of each process (default: half this process's, which it then
        keeps too)."""
        shm = "/dev/shm"
        self.folder = tempfile.mkdtemp(prefix=f"torchtitan-rl-weights-{os.getpid()}-",
                                       dir=shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None)
        self.process, self.conn = start_child("torchtitan.rl.async_generation", "serve", os.getpid())
        self.timeouts = {"comm.init_timeout_seconds": cfg.comm.init_timeout_seconds,
                         "comm.train_timeout_seconds": cfg.comm.train_timeout_seconds}
        self.answered = 0
        self.weight_files: list[str] = []
        self.threads = None
        if torch.device(device).type == "cpu":
            # Both processes compute on the same cores: half of them each. Each with threads for every core, the
            # two wait on each other's descheduled threads (measured: steps several times slower).
            self.threads = threads or max(1, torch.get_num_threads() // 2)
            torch.set_num_threads(self.threads)
            logger.info(f"rl: the trainer and its generator process share the CPU cores: {self.threads} threads each")
        self._send((cfg, str(device), self.folder, self.threads))

    def send_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """The policy's full state at ``version`` (name -> full tensor on any device)."""
        path = os.path.join(self.folder, f"version-{version}.pt")
        torch.save({name: tensor.detach().cpu() for name, tensor in state.items()}, path)
        self._send(("weights", version, path))
        # The generator only ever loads the newest; one it is reading stays readable until it is done with it.
        for old in self.weight_files:
            os.remove(old)
        self.weight_files = [path]

    def request(self, prompts: list[list[int]], sampling, stop_token_ids: list[int], min_version: int) -> None:
        """Generate a batch from weights of ``min_version`` or newer; answered in request order by ``receive``."""
        self._send(("generate", prompts, sampling, stop_token_ids, min_version))

    def receive(self) -> tuple[list[Completion], int]:
        """The next requested batch's completions and the version they came from (waits for them)."""
        field = "comm.init_timeout_seconds" if self.answered == 0 else "comm.train_timeout_seconds"
        if not wait([self.conn], timeout=self.timeouts[field]):
            raise DataError(f"rl: the generator process (pid {self.process.pid}) answered no batch within "
                            f"{field} = {self.timeouts[field]} s; raise it if generating a batch takes that long")
        kind, *content = self._recv()
        self.answered += 1
        completions, version = content
        return completions, version

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.conn.send(None)
                self.process.wait(timeout=STOP_WAIT_SECONDS)
            except (OSError, subprocess.TimeoutExpired):  # gone already, or stuck: killed below
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except OSError:  # it exited: with the reason it sent, if any
            if self.conn.poll():
                self._recv()
            raise DataError(self._exited()) from None

    def _recv(self) -> tuple:
        """The generator's next message; DataError if it is a failure or the generator is gone."""
        try:
            kind, *content = self.conn.recv()
        except (EOFError, OSError):
            raise DataError(self._exited()) from None
        if kind == "error":
            raise DataError(f"rl: the generator process failed: {content[0]}")
        return kind, *content

    def _exited(self) -> str:
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = "none: it closed its end but still runs"
        return f"rl: the generator process (pid {self.process.pid}) exited (code {code}) with batches outstanding"


# ----- the generator process -----


def serve(fd: int, trainer: int) -> None:
    """The generator process's main: build the sampler, then answer the trainer (pid ``trainer``) on the socket
    ``fd``."""
    # Ctrl-C and a scheduler's stop notice are for the trainer to act on; it stops the generator.
    for sig in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(fd)
    cfg, device, folder, threads = conn.recv()
    # The trainer's pid, not getppid(): a trainer that died while this process started is its parent no more.
    threading.Thread(target=exit_with_parent, args=(trainer, partial(shutil.rmtree, folder, True)),
                     daemon=True).start()
    sampler = None
    try:
        try:
            sampler = _build_sampler(cfg, torch.device(device), threads)
        except Exception as e:  # whatever the sampler's or a custom module's code raises: the trainer reports it
            conn.send(("error", f"building rl.sampler = {cfg.rl.sampler!r}: {one_line(e)}"))
            return
        _answer(conn, sampler)
    except (EOFError, OSError):  # the trainer died (a stopping trainer removes its weight files itself)
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        if sampler is not None:
            sampler.close()


def _build_sampler(cfg, device: torch.device, threads: int | None):
    for module in filter(None, (m.strip() for m in cfg.experimental.custom_import.split(","))):
        importlib.import_module(module)  # test doubles and users' samplers register there
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if threads is not None:
        torch.set_num_threads(threads)
    if cfg.debug.deterministic:
        torch.use_deterministic_algorithms(True)
    autocast = compute_autocast(cfg.training, device, fsdp_enabled=False)
    return SAMPLERS.get(cfg.rl.sampler)(SamplerContext(cfg.rl, partial(whole_model, cfg, device), device, autocast,
                                                       cfg))


def _read(conn: Connection, inbox: queue.SimpleQueue) -> None:
    """The generator's reader thread: every message into ``inbox`` as it comes, then ("stop",) when told to stop or
    ("gone",) when the trainer's end closed. The trainer never waits on a send while the generator generates, and
    the generator may wait on sending a large answer while the trainer sends its next request: neither blocks the
    other."""
    try:
        while (message := conn.recv()) is not None:
            inbox.put(message)
        inbox.put(("stop",))
    except (EOFError, OSError):
        inbox.put(("gone",))


class _Stopped(Exception):
    """The trainer told the generator to stop."""


def _answer(conn: Connection, sampler) -> None:
    """Answer the requests in order until told to stop; EOFError if the trainer died."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(conn, inbox), daemon=True).start()
    requests: deque = deque()
    newest: tuple[int, str] | None = None  # (version, file) of the newest weights sent
    loaded = None

    def take(block: bool) -> bool:
        """Take one message (False: none waiting, when not blocking)."""
        nonlocal newest
        try:
            message = inbox.get(block=block)
        except queue.Empty:
            return False
        if message[0] == "stop":
            raise _Stopped
        if message[0] == "gone":
            raise EOFError
        if message[0] == "weights":
            newest = message[1], message[2]
        else:
            requests.append(message[1:])
        return True

    try:
        while True:
            # Everything already sent first: a request may use weights sent after it was made.
            while take(block=not (requests and newest is not None and newest[0] >= requests[0][3])):
                pass
            version, path = newest
            if version != loaded and (state := _weights(path)) is None:
                take(block=True)  # removed for newer weights, whose message was sent before: wait for it
                continue
            try:
                if version != loaded:
                    sampler.load_weights(state, version)
                    loaded = version
                    del state
                prompts, sampling, stop_token_ids, _ = requests.popleft()
                completions = sampler.generate(prompts, sampling, stop_token_ids)
            except Exception as e:  # whatever the sampler raises: the trainer reports it
                conn.send(("error", f"generating a batch from policy version {version}: {one_line(e)}"))
                return
            conn.send(("batch", completions, loaded))
    except _Stopped:
        return


def _weights(path: str) -> dict[str, torch.Tensor] | None:
    """The state in ``path`` (None if the trainer removed it already)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        return None
