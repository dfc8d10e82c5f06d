"""Typed messages between the gateway and the draft and target services.

Every message is a msgspec Struct carried in a frame's header (see transport.py). Per-request
token data does not travel in the header: each batch message names flat tensors in its payload
(tokens of all entries concatenated in entry order) and every entry says how many are its own.
Each entry carries its request id and step number: the step is the gateway's iteration counter for
that request and must increase from call to call, so a replayed or reordered call is refused
instead of corrupting a request.

The target's call travels by batch, not by request: a Forward's verify entries and its reply's results
are columns (`VerifyColumns`, `ResultColumns`: the request ids as one list, every numeric field as one
little-endian array for all entries, the rare fields as sparse maps by row), so that neither end builds,
encodes or reads a Struct per entry on the hot path. `VerifyEntry` and `StepResult` are one row of them,
for the code that works entry by entry.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec
import numpy as np
from msgspec import Struct


class ErrorInfo(Struct):
    """Why one entry (or a whole call) was refused. Codes are stable strings clients can match."""

    code: str  # e.g. unknown_request, out_of_sync, stale_step, invalid_tree, too_large, out_of_blocks
    message: str  # human-readable detail


# ---- common ----------------------------------------------------------------------------------
class Error(Struct, tag=True):
    """The reply to a call that could not be run at all (malformed frame, bad message, ...)."""

    code: str  # malformed_frame, message_too_large, frame_timeout, bad_message, unauthenticated, unsupported,
    #            internal
    message: str


class Health(Struct, tag=True):
    """The one call a connection may make before it authenticates."""


# ---- authentication (shared/wire/auth.py): the first calls on every connection --------------------
class AuthHello(Struct, tag=True):
    nonce: bytes  # the client's nonce: 32 random bytes


class AuthChallenge(Struct, tag=True):
    nonce: bytes  # the server's nonce: 32 random bytes, good for one AuthProof
    proof: bytes  # HMAC-SHA256 (32 bytes) of the secret over "...server" + both nonces: the server holds it


class AuthProof(Struct, tag=True):
    proof: bytes  # HMAC-SHA256 (32 bytes) of the secret over "...client" + both nonces


class AuthOk(Struct, tag=True):
    """The connection is authenticated: every call is served from now on."""


class HealthReply(Struct, tag=True):
    service: str  # "draft" or "target"
    status: str  # "ok", or "offloaded" for a draft whose weights are in host memory
    model: str  # model directory
    device: str  # e.g. "cpu", "cuda:0"
    dtype: str  # e.g. "float32"
    uptime_s: float  # seconds since the service started
    fingerprint: str = ""  # what sets its pass latency (service_base.latency_fingerprint); profiles are keyed by it
    reads_features: bool = False  # a draft that drafts from the target's features (Forward.features feeds it)
    max_depth: int = 0  # a draft: the deepest tree it accepts (its --max-depth); 0 for a target
    max_width: int = 0  # a draft: the widest beam it accepts (its --max-width)


class Stats(Struct, tag=True):
    pass


class StatsReply(Struct, tag=True):
    service: str
    total_blocks: int  # KV pool size in blocks (0 while a draft is offloaded)
    free_blocks: int
    used_blocks: int
    block_size: int  # tokens per KV block
    resident_requests: int  # requests the service holds state for
    calls: int  # calls served since start
    entry_errors: int  # entries refused since start
    offloaded: bool = False  # draft only: weights in host memory, KV pool freed
    last_offload_s: float = 0.0  # draft only: seconds the last offload took
    last_reload_s: float = 0.0  # draft only: seconds the last reload took
    request_ids: list[str] = []  # the requests it holds state for (a gateway that (re)connects releases strays)
    prefix_caching: bool = False  # its KV blocks of committed tokens are kept in a prefix cache (block_manager.py)
    cached_blocks: int = 0  # blocks holding a prefix-cache entry, held by requests or evictable
    evictable_blocks: int = 0  # cached blocks no request holds: counted in free_blocks (allocatable at once)
    device: str = ""  # target only: where its model pass runs ("cpu", "cuda"; "simulated": a modelled pass)


class Release(Struct, tag=True):
    rids: list[str]  # requests whose state and KV blocks are freed


class ReleaseReply(Struct, tag=True):
    released: list[str]
    unknown: list[str]  # ids the service held nothing for (not an error: release is idempotent)
    free_blocks: int


# ---- draft service ---------------------------------------------------------------------------
class SpeculateEntry(Struct):
    rid: str
    step: int  # the gateway's iteration number for this request; strictly increasing
    num_new: int  # tokens of its slice of tensor "tokens": committed since its last call, then the assumed ones
    num_committed: int  # all committed tokens of the request after this call (prompt + output), assumed excluded
    depth: int  # beam steps d; 0 only appends the new tokens (keeps the draft KV in sync)
    width: int  # beam width w (children kept per step)
    num_assumed: int = 0  # drafting ahead: the last tokens of its slice are a guess, not committed; the tree
    # grows from them, then the draft forgets them (tokens and KV)
    feature_start: int = 0  # position of the first of its target features in tensor "features"
    num_features: int = 0  # its rows of "features" (a feature-level draft's input; 0 for other drafts)


class Speculate(Struct, tag=True):
    """Payload: "tokens" int32 [sum num_new], the entries' new tokens concatenated in order; for a draft
    that reads the target's features, "features" float32 [sum num_features, hidden] in the same order."""

    entries: list[SpeculateEntry]


class DraftTree(Struct):
    rid: str
    step: int
    num_nodes: int  # 1 + d*w nodes, root (the newest committed token) first; 0 if refused
    depth: int  # the depth actually searched (0 when speculation was skipped)
    error: ErrorInfo | None = None


class SpeculateReply(Struct, tag=True):
    """Payload, nodes of all trees concatenated in entry order: "tokens" int32, "parents" int32
    (index within the request's tree, -1 for the root), "path_prob" float32 (product of draft
    probabilities from the root to the node; 1 for the root)."""

    trees: list[DraftTree]
    catchup_ms: float  # appending committed tokens to the draft KV (prefill chunks), milliseconds
    beam_ms: float  # the d beam steps: forwards and top-w selection, milliseconds
    total_ms: float  # the whole call inside the service, milliseconds
    forwards: int  # model passes this call ran
    free_blocks: int  # draft KV blocks free after the call
    offloaded: bool = False  # the draft is offloaded: trees are root-only, tokens were recorded
    warmup: bool = False  # a beam step captured a CUDA graph for a new shape: a one-off cost, not its time again


class Offload(Struct, tag=True):
    """Draft only: move the weights to host memory and free the KV pool."""


class Reload(Struct, tag=True):
    """Draft only: bring the weights back and rebuild an empty KV pool (requests catch up lazily)."""


class TransitionReply(Struct, tag=True):
    offloaded: bool  # the state after the call
    seconds: float  # how long the transition took
    weight_bytes: int  # bytes of weights moved
    kv_bytes: int  # bytes of KV pool freed (offload) or allocated (reload)
    cold_requests: int  # requests whose draft KV must be rebuilt from their committed tokens


# ---- target service --------------------------------------------------------------------------
class SamplingSpec(Struct):
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = no limit
    seed: int | None = None  # per-request seed for reproducible sampling
    min_p: float = 0.0  # [0, 1]; 0 = off
    # the penalties (shared/spec/penalties.py); neutral by default, and then the target keeps no token counts
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # output tokens before a stop id (stop_token_ids, eos_ids) may be sampled
    stop_token_ids: list[int] = []  # the request's own stop ids (the gateway ends its output at one, keeping it)
    eos_ids: list[int] = []  # with min_tokens: the EOS ids it holds back too (none with ignore_eos)
    num_prompt: int | None = None  # prompt tokens of the context (a preempted request's context goes on with
    #                                its output, which the penalties count as output); None: all of it
    # logprobs (shared/spec/logprobs.py): None = none; N in 0..MAX_LOGPROBS = each output token's logprob and
    # the N most likely tokens at its position. prompt_logprobs (needs logprobs): the same for every prompt
    # token but the first, computed during prefill.
    logprobs: int | None = None
    prompt_logprobs: bool = False


class PrefillEntry(Struct):
    rid: str
    step: int  # strictly increasing per request
    start: int  # prompt tokens already prefilled (0 for the first chunk)
    num_tokens: int  # this chunk's prompt tokens (its slice of tensor "prefill_tokens")
    last: bool  # the prompt's last chunk: sample and return the first output token
    sampling: SamplingSpec | None = None  # required on the first chunk, ignored after
    # a preempted request rebuilding its KV: the prompt here is prompt + output but its newest token,
    # and that token (already emitted) becomes the root instead of a newly sampled one
    resume_token: int | None = None
    masked: bool = False  # structured output: its row of "token_masks" (last chunk only) limits the first token


class VerifyEntry(Struct):
    """One row of `VerifyColumns`."""

    rid: str
    step: int  # strictly increasing per request
    num_committed: int  # committed tokens (prompt + output) before this step; the root is the newest
    num_nodes: int  # tree nodes, root first (its slice of "tree_tokens" and "tree_parents")
    masked: bool = False  # structured output: num_nodes rows of "token_masks", each node's allowed next tokens
    # sent one step ahead (the gateway's --async-scheduling): its root is the token the request's previous step
    # emits, which the gateway does not know yet; the target takes its own newest committed token as the root
    # (its slot in "tree_tokens" is ignored) and checks num_committed as for any entry
    root_pending: bool = False
    # a root_pending tree of more than one node was drafted on a guess of the step before it, which emits one
    # token at least: where the request then has num_committed + guess committed tokens and its newest token is
    # a child of the sent root, the subtree under that child is verified (that child its root); otherwise, where
    # it has num_committed ... num_committed + guess, its root alone (`guarded`)
    guess: int = 0


def column(values: Sequence[int] | np.ndarray, dtype: type) -> bytes:
    """One numeric field of every entry of a batch, as the bytes of a little-endian array."""
    return np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def read_column(data: bytes, dtype: type, rows: int, name: str) -> np.ndarray:
    """A column's array (read-only, on the message's bytes); ValueError where it does not hold `rows` values."""
    kind = np.dtype(dtype).newbyteorder("<")
    if len(data) != rows * kind.itemsize:
        raise ValueError(f"column {name!r} holds {len(data)} bytes, not {rows} x {kind.itemsize}")
    return np.frombuffer(data, dtype=kind)


VERIFY_MASKED, VERIFY_ROOT_PENDING = 1, 2  # VerifyColumns.flags bits: VerifyEntry.masked, VerifyEntry.root_pending


class VerifyColumns(Struct):
    """A Forward's verify entries by column, row i the i-th entry (`VerifyEntry`'s fields): `rids` their request
    ids, then one array each: int64 `steps` and `committed` (num_committed), int32 `nodes` (num_nodes), uint8
    `flags` (VERIFY_MASKED | VERIFY_ROOT_PENDING), and int32 `guesses` (guess), empty where every guess is 0."""

    rids: list[str] = msgspec.field(default_factory=list)
    steps: bytes = b""
    committed: bytes = b""
    nodes: bytes = b""
    flags: bytes = b""
    guesses: bytes = b""

    @classmethod
    def of(cls, entries: Sequence[VerifyEntry]) -> VerifyColumns:
        return cls.build([e.rid for e in entries], [e.step for e in entries], [e.num_committed for e in entries],
                         [e.num_nodes for e in entries],
                         [VERIFY_MASKED * e.masked + VERIFY_ROOT_PENDING * e.root_pending for e in entries],
                         [e.guess for e in entries])

    @classmethod
    def build(cls, rids: list[str], steps: Sequence[int], committed: Sequence[int], nodes: Sequence[int],
              flags: Sequence[int], guesses: Sequence[int] = ()) -> VerifyColumns:
        return cls(rids, column(steps, np.int64), column(committed, np.int64), column(nodes, np.int32),
                   column(flags, np.uint8), column(guesses, np.int32) if any(guesses) else b"")

    def guess_list(self) -> list[int]:
        """Each entry's guess (all 0 where the column is empty); ValueError where it does not hold one per id."""
        if not self.guesses:
            return [0] * len(self.rids)
        guesses: list[int] = read_column(self.guesses, np.int32, len(self.rids), "guesses").tolist()
        return guesses

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(steps, committed, nodes, flags); ValueError where a column does not hold one value per request id."""
        n = len(self.rids)
        return (read_column(self.steps, np.int64, n, "steps"), read_column(self.committed, np.int64, n, "committed"),
                read_column(self.nodes, np.int32, n, "nodes"), read_column(self.flags, np.uint8, n, "flags"))

    def entries(self, columns: Sequence[list[int]] | None = None) -> list[VerifyEntry]:
        """Every row as a `VerifyEntry` (ValueError as `arrays`); `columns`: `arrays()` as lists, where the caller
        has read them already."""
        steps, committed, nodes, flags = columns if columns is not None else [a.tolist() for a in self.arrays()]
        return [VerifyEntry(rid, s, c, n, bool(f & VERIFY_MASKED), bool(f & VERIFY_ROOT_PENDING), g)
                for rid, s, c, n, f, g in zip(self.rids, steps, committed, nodes, flags, self.guess_list(),
                                              strict=True)]

    def __len__(self) -> int:
        return len(self.rids)


class Forward(Struct, tag=True):
    """Payload: "prefill_tokens" int32, "tree_tokens" int32, "tree_parents" int32 (-1 for roots); with any
    entry masked, "token_masks" int32 [rows, ceil(V / 32)], the masked entries' rows in entry order
    (shared/spec/token_mask.py: bit t % 32 of word t // 32 allows token t at that position)."""

    prefill: list[PrefillEntry] = msgspec.field(default_factory=list)
    verify: VerifyColumns = msgspec.field(default_factory=VerifyColumns)
    # Return the target's features: the final norm's output at every prefill chunk token and at each
    # verified tree's accepted path (its root first), for a draft that reads them.
    features: bool = False
    # Requests released before the pass, as a Release call would (ids it holds nothing for are ignored): the
    # gateway sends what it owes a target with its next pass instead of a call of their own.
    release: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.verify, list):  # built from entries (tests, tools): carried as columns
            self.verify = VerifyColumns.of(self.verify)


class StepResult(Struct):
    """One row of `ResultColumns`."""

    rid: str
    step: int
    num_tokens: int  # tokens emitted (its slice of "tokens"): accepted drafts + 1, or the first token
    num_accepted: int  # accepted draft nodes (tree steps only)
    error: ErrorInfo | None = None
    num_features: int = 0  # with Forward.features: its rows of "features" (every chunk token; the accepted path)
    num_cached: int = 0  # a prefill chunk: its leading tokens taken from the prefix cache (not computed)
    # With SamplingSpec.prompt_logprobs / logprobs: its rows of "logprobs", the prompt positions of this chunk
    # (each chunk token but the prompt's first) then one per emitted token (none for a resume_token), and
    # top_logprobs ranked tokens per row in "top_ids" and "top_logprobs".
    num_prompt_logprobs: int = 0
    num_logprobs: int = 0
    top_logprobs: int = 0


class ResultExtra(Struct, array_like=True):
    """A result's rarer fields (`StepResult`'s), sent only for the rows that have any."""

    num_features: int = 0
    num_cached: int = 0
    num_prompt_logprobs: int = 0
    num_logprobs: int = 0
    top_logprobs: int = 0


class ResultColumns(Struct):
    """A ForwardReply's results by column, row i the i-th result (`StepResult`'s fields): `rids`, then one array
    each, int64 `steps`, int32 `num_tokens` and `num_accepted`; by row, only where they apply, `errors` and
    `extra` (ResultExtra). Indexing and iterating give `StepResult`s."""

    rids: list[str] = msgspec.field(default_factory=list)
    steps: bytes = b""
    num_tokens: bytes = b""
    num_accepted: bytes = b""
    errors: dict[int, ErrorInfo] = msgspec.field(default_factory=dict)
    extra: dict[int, ResultExtra] = msgspec.field(default_factory=dict)

    @classmethod
    def of(cls, results: Sequence[StepResult]) -> ResultColumns:
        errors = {i: r.error for i, r in enumerate(results) if r.error is not None}
        extras = ((i, ResultExtra(r.num_features, r.num_cached, r.num_prompt_logprobs, r.num_logprobs,
                                  r.top_logprobs)) for i, r in enumerate(results))
        return cls([r.rid for r in results], column([r.step for r in results], np.int64),
                   column([r.num_tokens for r in results], np.int32),
                   column([r.num_accepted for r in results], np.int32), errors,
                   {i: x for i, x in extras if x != ResultExtra()})

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps, num_tokens, num_accepted); ValueError where a column does not hold one value per request id."""
        n = len(self.rids)
        return (read_column(self.steps, np.int64, n, "steps"), read_column(self.num_tokens, np.int32, n, "num_tokens"),
                read_column(self.num_accepted, np.int32, n, "num_accepted"))

    def rows(self) -> list[StepResult]:
        """Every row as a `StepResult` (ValueError as `arrays`)."""
        steps, tokens, accepted = (a.tolist() for a in self.arrays())
        return [self._row(i, step, n, a) for i, (step, n, a) in enumerate(zip(steps, tokens, accepted, strict=True))]

    def _row(self, i: int, step: int, num_tokens: int, num_accepted: int) -> StepResult:
        x = self.extra.get(i, ResultExtra())
        return StepResult(self.rids[i], step, num_tokens, num_accepted, self.errors.get(i), x.num_features,
                          x.num_cached, x.num_prompt_logprobs, x.num_logprobs, x.top_logprobs)

    def __len__(self) -> int:
        return len(self.rids)

    def __iter__(self) -> Iterator[StepResult]:
        return iter(self.rows())

    def __getitem__(self, index: int) -> StepResult:
        """Row `index` alone (negative counts from the end, as for a list)."""
        i = range(len(self.rids))[index]
        steps, tokens, accepted = self.arrays()
        return self._row(i, int(steps[i]), int(tokens[i]), int(accepted[i]))


class ForwardReply(Struct, tag=True):
    """Payload: "tokens" int32, the emitted tokens of all results concatenated in order; with
    Forward.features, "features" float32 [sum num_features, hidden] in the same order; where a result
    has logprob rows, "logprobs" float32 [sum rows], "top_ids" int32 and "top_logprobs" float32
    [sum rows * top_logprobs], in the same order (a result's prompt rows, then its emitted tokens')."""

    results: ResultColumns  # prefill entries first, then verify entries, in request order
    forward_ms: float  # the model pass, milliseconds
    accept_ms: float  # acceptance and KV commit, milliseconds
    total_ms: float  # the whole call inside the service (checks, pass, acceptance, reply), milliseconds
    free_blocks: int  # target KV blocks free after the step (evictable prefix-cache blocks included)
    warmup: bool = False  # the pass captured a CUDA graph for a new shape: a one-off cost, not its time again
    cached_blocks: int = 0  # blocks holding a prefix-cache entry after the step (held or evictable)

    def __post_init__(self) -> None:
        if isinstance(self.results, list):  # built from rows (tests, tools): carried as columns
            self.results = ResultColumns.of(self.results)


Message = (
    Error
    | Health
    | AuthHello
    | AuthChallenge
    | AuthProof
    | AuthOk
    | HealthReply
    | Stats
    | StatsReply
    | Release
    | ReleaseReply
    | Speculate
    | SpeculateReply
    | Offload
    | Reload
    | TransitionReply
    | Forward
    | ForwardReply
)
