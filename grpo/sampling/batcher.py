"""The engine thread behind `r1 serve`: every request's rows decoded together, continuously batched.

One thread owns the model, the tokenizer and a `grpo.sampling.local.slots.SlotBatch`. The HTTP handlers (asyncio, in
`flows.cli.serve`) hand it `Request`s through a thread-safe inbox (`submit`, `cancel`) and get events back
through a callback each request brings (the handler's `loop.call_soon_threadsafe` into its asyncio queue):
`Started` (the prompt token counts) or `Failed` first, then `Delta`s while a streamed row decodes, and one
`Finished` per choice. Between decode steps the thread takes what came in, tokenizes it (a fast tokenizer shared by
threads raises "Already borrowed": only this thread uses it), decodes the new tokens to text, cuts rows at their
stop strings (cancelling them, so their slots free at once), and cancels the rows of requests whose clients left.

Batching rules. One SlotBatch has one sampling setting (temperature, top_k, top_p), a prompt width P and a budget
C. A request joins the running batch at once, its rows queued for slots inside it, when its setting is the
batch's, its longest prompt fits P and its max_tokens (trimmed to the model's length) fits C. One that does not
fit waits, and every request after it waits behind it (first come, first served: nothing starves), until the
batch drains. The KV cache is paged, so a batch is as wide as the model (P = C = its length, every log-prob kept):
K/V follows what rows write, so every request of the batch's setting fits, and rows are admitted as slots and
pages free. A model with no known length gets a batch shaped for the waiting requests of the first one's setting:
P = `static_sampler.prompt_bucket` of their longest prompt, C = their largest max_tokens rounded up to a power of
two (at least 16). Slots: `slots` (default 64).

A row's tokens depend only on its prompt and its random stream: a request's are drawn from a `torch.Generator` seeded
with its `seed` (the engine's own generator when none), as `TransformersBackend.generate_from_text` under
`torch.manual_seed(seed)` draws them, so a seeded request gets the same tokens however busy the server is, and
the same as the local engine. A model the static sampler cannot compute (`unsupported_reason`) is served one
request at a time through the engine's `generate_from_text` (stop strings applied to its text; a stream gets it in
one piece). Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Callable, NamedTuple

import torch

from grpo.sampling.draws import draw_streams
from grpo.sampling.local import Ended, SlotBatch, TransformersBackend, prompt_bucket, render_prompts
from grpo.sampling.openai_requests import Request, RequestError

logger = logging.getLogger(__name__)

MIN_BUDGET = 16  # the smallest budget C a batch is shaped with
DRAW_ROWS = 64  # rows per block of streams, as the local engine draws them (SamplingConfig.batch_size)


class Started(NamedTuple):
    prompt_tokens: list[int]  # per prompt


class Delta(NamedTuple):
    choice: int
    text: str  # more of a streamed choice's text (never a possible start of a stop string)


class Finished(NamedTuple):
    choice: int
    text: str  # the whole text, cut before the stop string that ended it
    rest: str  # what a stream has not been sent yet
    token_ids: list[int]  # the sampled tokens, the end token included
    token_texts: list[str] | None  # each token decoded alone (with logprobs)
    logprobs: list[float] | None  # each token's log-prob (when the request asked)
    finish_reason: str  # "stop" (an end token or a stop string) or "length"


class Failed(NamedTuple):
    error: Exception  # a RequestError (the client's fault) or anything else (a 500)


class QueueFull(Exception):
    """As many requests wait as the server takes (its `max_waiting`)."""


class Job:
    """One request inside the engine: what it asks, where its events go, its tokenized prompts and rows."""

    def __init__(self, request: Request, emit: Callable[[object], None]):
        self.request, self.emit = request, emit
        self.waiting = True  # no row decoding yet: counts against the queue limit
        self.done = False  # finished, failed or cancelled
        self.texts: list[str] = []  # the prompts as the model sees them (chat: rendered)
        self.prompt_ids: list[list[int]] = []
        self.limit = 0  # new tokens at most per row
        self.streams: torch.Tensor | None = None  # [rows] int64 (`draws`), None at temperature 0
        self.rows_left = 0

    @property
    def setting(self) -> tuple:
        s = self.request.sampling
        return (0.0, 0, 1.0) if s.temperature == 0 else (s.temperature, s.top_k, s.top_p)


class _Row:
    """One choice as it decodes: its tokens, and its text decoded as they come (a token that ends inside a UTF-8
    character waits for the next), cut at the first stop string."""

    def __init__(self, job: Job, choice: int, key: int):
        self.job, self.choice, self.key = job, choice, key
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text, self.sent = "", 0  # decoded so far; how much of it a stream was sent
        self._prefix = self._read = 0  # token offsets of the incremental decode
        self.stopped = False

    @property
    def incremental(self) -> bool:
        return self.job.request.stream or bool(self.job.request.stop)

    def extend(self, tokenizer, ids: list[int], logprobs: list[float]) -> None:
        """Add tokens; with streaming or stop strings, their text (and `stopped` when a stop string appears)."""
        self.ids += ids
        self.logprobs += logprobs
        if not self.incremental or self.stopped:
            return
        before = tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        now = tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):  # nothing new, or a character cut in two
            return
        start = len(self.text)
        self.text += now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        stops = self.job.request.stop
        cuts = [i for i in (self.text.find(s, max(0, start - len(s) + 1)) for s in stops) if i >= 0]
        if cuts:
            self.text, self.stopped = self.text[:min(cuts)], True

    def sendable(self) -> str:
        """The text a stream may be sent now: all but a tail that could be the start of a stop string."""
        hold = 0
        for k in range(min(len(self.text) - self.sent, max(map(len, self.job.request.stop), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.job.request.stop):
                hold = k
                break
        new = self.text[self.sent:len(self.text) - hold]
        self.sent += len(new)
        return new

    def finish(self, tokenizer, finish_reason: str) -> Finished:
        whole = tokenizer.decode(self.ids, skip_special_tokens=True)
        if not self.stopped and whole.startswith(self.text[:self.sent]):
            self.text = whole  # the tokens decoded at once (a stream was sent a prefix of it)
        elif not self.stopped:
            self.text += tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)[
                len(tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)):]
        want = self.job.request.logprobs
        return Finished(self.choice, self.text, self.text[self.sent:], self.ids,
                        [tokenizer.decode([t]) for t in self.ids] if want else None,
                        self.logprobs if want else None, "stop" if self.stopped else finish_reason)


class RequestBatcher:
    """The engine thread; see the module docstring. `backend`: the local engine (its model, tokenizer, static
    sampler); max_len: prompt + completion tokens the model takes (None: unknown)."""

    def __init__(self, backend: TransformersBackend, *, slots: int = 64, max_waiting: int = 256,
                 max_len: int | None = None, threads: int | None = None):
        if slots < 1 or max_waiting < 0 or (threads is not None and threads < 1):
            raise ValueError(f"slots must be at least 1, max_waiting at least 0 and threads at least 1 (or None), "
                             f"got {slots}, {max_waiting} and {threads}")
        # the engine thread's CPU threads (None: torch's own); each thread has its own OpenMP setting, so it is set
        # in that thread, and what it got is read back there (`engine_threads`)
        self.threads, self.engine_threads = threads, None
        self.backend, self.tokenizer = backend, backend.tokenizer
        self.slots, self.max_waiting, self.max_len = slots, max_waiting, max_len
        sampler = backend.sampler
        reason = "sampler: loop" if sampler is None else sampler.unsupported_reason(max_len or 0)
        self.sampler = None if reason else sampler
        if reason:
            logger.info("r1 serve decodes one request at a time (%s)", reason)
        self.batch: SlotBatch | None = None
        self.batch_setting: tuple | None = None
        self.batches = 0  # batches shaped so far
        self.live = 0  # slots decoding a row, after the last step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: collections.deque[Job] = collections.deque()  # tokenized, not yet in a batch
        self._rows: dict[int, _Row] = {}  # the batch's keys -> rows
        self._lock = threading.Lock()
        self._waiting = 0  # jobs with no row decoding yet (under _lock: handlers read it)
        self._generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))
        self._thread = threading.Thread(target=self._run, name="r1-serve-engine", daemon=True)
        # one parallel op in this thread (the main one, as a rule) before the engine thread computes: where the
        # first OpenMP region runs in another thread, that thread's small ops ran 20-300x slower here (libgomp, 2
        # cores: a 0.15 ms decode op took 17-47 ms)
        torch.ones(2**20).sum()

    # ------------------------------------------------------------------------------------------------------------
    # Called from other threads

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self) -> None:
        """Fail what is left (503) and end the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join()

    def submit(self, request: Request, emit: Callable[[object], None]) -> Job:
        """Queue a request; its events go to `emit` (called from the engine thread). QueueFull past the limit."""
        job = Job(request, emit)
        with self._lock:
            if self._waiting >= self.max_waiting:
                raise QueueFull(f"{self._waiting} requests are waiting, as many as this server queues")
            self._waiting += 1
        self._inbox.put(("submit", job))
        return job

    def cancel(self, job: Job) -> None:
        """Drop a request (its client went away): out of the queue, its rows' slots freed."""
        self._inbox.put(("cancel", job))

    @property
    def waiting(self) -> int:
        return self._waiting

    # ------------------------------------------------------------------------------------------------------------
    # The engine thread

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        self.engine_threads = torch.get_num_threads()
        while True:
            idle = not self._pending and not (self.batch is not None and self.batch.busy)
            command = self._inbox.get() if idle else self._next_command()  # sleep while there is nothing to do
            while command is not None:
                kind, job = command
                if kind == "stop":
                    self._fail_all(RequestError(503, "the server is shutting down", kind="server_error"), inbox=True)
                    return
                self._take(job) if kind == "submit" else self._drop(job)
                command = self._next_command()
            try:
                if self.sampler is None:
                    if self._pending:
                        self._serve_alone(self._pending.popleft())
                    continue
                self._schedule()
                self._step()
            except Exception as e:  # a bug or an out-of-memory: the requests in hand get a 500, the server goes on
                logger.exception("the engine thread failed a batch")
                self._fail_all(e)

    def _next_command(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _take(self, job: Job) -> None:
        """Tokenize a new request and queue it (or fail it: a prompt the model cannot take)."""
        r, tok = job.request, self.tokenizer
        try:
            texts = job.texts = render_prompts(tok, list(r.prompts)) if r.chat else list(r.prompts)
            job.prompt_ids = tok(texts, add_special_tokens=r.add_special_tokens)["input_ids"]
            field = "messages" if r.chat else "prompt"
            for i, ids in enumerate(job.prompt_ids):
                where = field if len(texts) == 1 else f"{field}[{i}]"
                if not ids:
                    raise RequestError(400, f"{where} is empty: there is nothing to continue", field)
                if self.max_len is not None and len(ids) >= self.max_len:
                    raise RequestError(400, f"{where} is {len(ids)} tokens; this model takes at most "
                                            f"{self.max_len} tokens of prompt and completion together", field)
        except Exception as e:
            self._fail(job, e)
            return
        longest = max(map(len, job.prompt_ids))
        job.limit = r.sampling.max_new_tokens
        if self.max_len is not None and longest + job.limit > self.max_len:
            field = r.budget_field
            if field is None:  # the default budget: what the context leaves (the reply then ends "length")
                job.limit = self.max_len - longest
            else:  # a budget the request named: refused, as OpenAI and vLLM do
                self._fail(job, RequestError(
                    400, f"{field} is {job.limit}, and with the prompt's {longest} tokens that is "
                         f"{longest + job.limit}; this model takes at most {self.max_len} tokens of prompt and "
                         f"completion together: ask for at most {self.max_len - longest}", field))
                return
        rows = len(texts) * r.n
        job.rows_left = rows
        if r.sampling.temperature > 0:
            gen = self._generator if r.seed is None else torch.Generator().manual_seed(r.seed)
            # in blocks of DRAW_ROWS rows: what the local engine draws after torch.manual_seed(seed)
            job.streams = draw_streams(rows, per=DRAW_ROWS, generator=gen)
        job.emit(Started([len(ids) for ids in job.prompt_ids]))
        self._pending.append(job)

    def _drop(self, job: Job) -> None:
        if job.done:
            return
        if job in self._pending:
            self._pending.remove(job)
        for key in [k for k, row in self._rows.items() if row.job is job]:
            self.batch.cancel(key)
            del self._rows[key]
        self._close(job)
        self.live = 0 if self.batch is None else self.batch.live

    def _schedule(self) -> None:
        """Requests that fit the running batch join it, in order; a drained batch makes way for a new shape."""
        if not self._pending:
            return
        if self.batch is not None and not self.batch.busy and not self._fits(self._pending[0]):
            self.batch = None  # drained, and the next request needs another shape
        if self.batch is None:
            self._shape()
        while self._pending and self._fits(self._pending[0]):
            self._join(self._pending[0])
            self._pending.popleft()  # after joining: a request that failed to join is failed from the queue

    def _fits(self, job: Job) -> bool:
        b = self.batch
        return (b is not None and job.setting == self.batch_setting and max(map(len, job.prompt_ids)) <= b.P
                and job.limit <= b.C and (b.want_logprobs or not job.request.logprobs))

    def _shape(self) -> None:
        """A batch for the waiting requests of the first one's setting (see the module docstring)."""
        setting = self._pending[0].setting
        jobs = [j for j in self._pending if j.setting == setting]
        if self.max_len is not None:
            # a paged cache holds what rows write, not P + C a slot: one batch as wide as the model takes every
            # request of this setting, whatever its prompt and max_tokens, as slots and pages free
            P = C = self.max_len
            S, logprobs = self.slots, True
        else:
            P = prompt_bucket(max(len(ids) for j in jobs for ids in j.prompt_ids))
            C = max(MIN_BUDGET, 1 << (max(j.limit for j in jobs) - 1).bit_length())
            S = self.slots
            logprobs = any(j.request.logprobs for j in jobs)
        s = self._pending[0].request.sampling.model_copy(update={"max_new_tokens": C})
        eos, pad = self.backend.eos_ids, self.tokenizer.pad_token_id
        self.batch = SlotBatch(self.sampler, S, P, s, eos, pad, logprobs)
        self.batch_setting = setting
        self.batches += 1
        logger.info("batch %d: %d slots, prompts up to %d tokens, up to %d new tokens, temperature %g",
                    self.batches, S, P, C, s.temperature)

    def _join(self, job: Job) -> None:
        b, n = self.batch, job.request.n
        for i, ids in enumerate(job.prompt_ids):
            streams = torch.zeros(n, dtype=torch.long) if job.streams is None else job.streams[i * n:(i + 1) * n]
            keys = b.submit(torch.tensor(ids), streams=streams, n=n, limit=job.limit)  # greedy reads no stream
            for j, key in enumerate(keys):
                self._rows[key] = _Row(job, i * n + j, key)

    def _step(self) -> None:
        b = self.batch
        if b is None or not b.busy:
            return
        ended = b.step()
        # first what a client could ask after seeing a token: a request with a row in a slot no longer waits
        for key in b.slot_row:
            if key is not None and key in self._rows and self._rows[key].job.waiting:
                self._release(self._rows[key].job)
        self.live = b.live
        for e in ended:
            self._ended(e)
        if any(row.incremental for row in self._rows.values()):  # else the tokens come whole as rows end
            for key, (ids, logprobs) in b.new_tokens().items():
                row = self._rows.get(key)
                if row is not None:
                    self._advance(row, ids, logprobs)
        self.live = b.live  # less the rows stopped by a stop string

    def _ended(self, e: Ended) -> None:
        row = self._rows.pop(e.key, None)
        if row is None:
            return
        n = int(e.alive.sum())
        self._advance(row, e.ids[len(row.ids):n].tolist(), e.logprobs[len(row.ids):n].tolist(), ended=True)
        if not row.stopped:
            self._finish(row, "length" if e.truncated else "stop")

    def _advance(self, row: _Row, ids: list[int], logprobs: list[float], ended: bool = False) -> None:
        """New tokens of a row: its text streamed, or the row stopped at a stop string (its slot freed)."""
        row.extend(self.tokenizer, ids, logprobs)
        if row.stopped:
            if not ended and self.batch is not None and row.key in self._rows:
                self.batch.cancel(row.key)
                del self._rows[row.key]
            self._finish(row, "stop")
        elif row.job.request.stream:
            text = row.sendable()
            if text:
                row.job.emit(Delta(row.choice, text))

    def _finish(self, row: _Row, finish_reason: str) -> None:
        job = row.job
        job.emit(row.finish(self.tokenizer, finish_reason))
        job.rows_left -= 1
        if not job.rows_left:
            self._close(job)

    def _serve_alone(self, job: Job) -> None:
        """A request through the engine's own decode loop (a model the static sampler does not compute)."""
        r = job.request
        if r.seed is not None:
            torch.manual_seed(r.seed)  # only this thread draws from torch's generator
        s = r.sampling.model_copy(update={"max_new_tokens": job.limit, "batch_size": self.slots})
        out = self.backend.generate_from_text(job.texts, r.n, s, add_special_tokens=r.add_special_tokens,
                                              logprobs=r.logprobs)
        for choice in range(len(out.texts)):
            row = _Row(job, choice, -1)
            n = int(out.completion_mask[choice].sum())
            logprobs = out.logprobs[choice, :n].tolist() if r.logprobs else [0.0] * n
            row.extend(self.tokenizer, out.completion_ids[choice, :n].tolist(), logprobs)  # a stream: all at the end
            self._finish(row, "length" if bool(out.truncated[choice]) else "stop")

    def _release(self, job: Job) -> None:
        if job.waiting:
            job.waiting = False
            with self._lock:
                self._waiting -= 1

    def _close(self, job: Job) -> None:
        job.done = True
        self._release(job)

    def _fail(self, job: Job, error: Exception) -> None:
        if not job.done:
            job.emit(Failed(error))
            self._close(job)

    def _fail_all(self, error: Exception, inbox: bool = False) -> None:
        """Fail the batch's requests and the queued ones (and, with `inbox`, those not yet taken); the batch is let
        go."""
        for row in list(self._rows.values()):
            self._fail(row.job, error)
        self._rows.clear()
        self.batch, self.live = None, 0
        while self._pending:
            self._fail(self._pending.popleft(), error)
        if inbox:
            while (command := self._next_command()) is not None:
                if command[0] == "submit":
                    self._fail(command[1], error)
