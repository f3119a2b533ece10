"""Draft-model proposals: a smaller model (or the target's first layers) guesses k tokens.

Two drafts, one proposal loop (`DraftProposer`):

- a separate model (`speculative_config.model`): any model `load_model` loads whose vocabulary
  is the target's. It has its own paged KV cache with the target's block ids: as many device
  blocks as the target (and as many host blocks, for swaps), so the target's block manager
  serves both and the block tables the engine passes are valid in the draft's cache too.
  `move_blocks` applies each step's swaps and copy-on-write copies to it. Per sequence the
  proposer remembers the tokens its cache holds and the block table they were written under;
  a proposal round first catches the draft up from the longest prefix still valid (matching
  tokens, unchanged blocks, at most the target's computed tokens), so rejected tokens,
  preemption and forks (which start from nothing) need no other bookkeeping.
- the target's first `draft_layers` layers with its final norm and LM head (self-speculation,
  no extra weights). Those layers write the same K/V as the target's for the same tokens, so
  the draft runs on the target's own cache of layers 0..L-1 and starts at the target's first
  uncomputed token; the target's verify step rewrites the slots the draft wrote.

A round is one varlen forward over every proposing sequence's uncomputed tokens (its last token
is sampled but not computed), then k-1 one-token steps, each batched over the sequences still
proposing. Each token is chosen from the draft's logits processed as the target's are
(`logit_bias`, penalties, min_tokens; not a grammar): the argmax for greedy requests (no
probabilities returned), else a draw from the temperature / top-k / top-p / min-p
distribution with the request's generator, whose rows are returned as `Proposal.probs`.
The draft's own cache stores the draft model's dtype (an 8-bit target cache is not copied).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from torch import nn

from engine.kv_cache import KVCache
from engine.model.decoder import DecoderForCausalLM, sliding_windows
from engine.model.loader import LoadedModel, load_model
from engine.runner import build_inputs
from engine.sampler import Sampler, SamplingState, argmax, draw, sampling_probs
from engine.spec_decode.proposer import Proposal

if TYPE_CHECKING:
    from engine.kv_scales import LayerKVScales
    from engine.request import Sequence
    from engine.scheduler import SchedulerOutput
    from engine.speculative_config import SpeculativeConfig


def make_draft_proposer(engine: Any, spec_config: "SpeculativeConfig") -> "DraftProposer":
    """The proposer of a "draft_model" `spec_config` for `engine` (an `LLMEngine`): the target's
    first `draft_layers` layers, or the model at `spec_config.model` with a cache of its own.
    ValueError when `draft_layers` is not in [1, num_hidden_layers), when the draft model
    cannot be loaded, or when its vocabulary differs from the target's."""
    backend = engine.config.backend
    if spec_config.draft_layers is not None:
        model = first_layers(engine.loaded.model, spec_config.draft_layers)
        num = spec_config.draft_layers
        scales = engine.kv_cache.scales[:num] if engine.kv_cache.scales else None
        return DraftProposer(model, engine.kv_cache.device_caches[:num], scales, engine.sampler,
                             engine.kv_cache.block_size, backend, engine.device)
    draft = load_draft(spec_config.model, engine)
    cache = KVCache(draft.config.num_hidden_layers, draft.config.num_key_value_heads,
                    draft.config.head_dim, engine.kv_cache.num_blocks,
                    engine.kv_cache.block_size, draft_dtype(draft), engine.device,
                    engine.kv_cache.num_host_blocks, backend)
    return DraftProposer(draft.model, cache.device_caches, None, engine.sampler,
                         cache.block_size, backend, engine.device, own_cache=cache)


def draft_dtype(draft: LoadedModel) -> torch.dtype:
    """The dtype of the draft model's weights (its own KV cache stores that)."""
    return next(draft.model.parameters()).dtype


def load_draft(path: Optional[str], engine: Any) -> LoadedModel:
    """The model at `path` loaded as the engine loads its target (dtype, device,
    quantization); ValueError naming `speculative_config.model` when it cannot be loaded or
    its vocabulary size differs from the target's."""
    try:
        draft = load_model(path, engine.dtype, engine.device, engine.config.quantization)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"speculative_config['model']: expected a model the engine can load, "
                         f"got {path!r} ({type(e).__name__}: {e})") from e
    target_vocab = engine.loaded.config.vocab_size
    if draft.config.vocab_size != target_vocab:
        raise ValueError(f"speculative_config['model']: expected a draft sharing the target's "
                         f"tokenizer (vocabulary of {target_vocab} tokens), got {path!r} with a "
                         f"vocabulary of {draft.config.vocab_size} tokens")
    return draft


def first_layers(model: DecoderForCausalLM, num_layers: int) -> DecoderForCausalLM:
    """The target's first `num_layers` layers with its embeddings, final norm and LM head, as a
    model of its own: a shallow copy sharing every parameter (nothing is copied). ValueError
    unless `num_layers` is in [1, num_hidden_layers)."""
    total = len(model.layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) \
            or not 1 <= num_layers < total:
        raise ValueError(f"speculative_config['draft_layers']: expected an int in [1, {total}) "
                         f"(the target has {total} layers), got {num_layers!r}")
    view = copy.copy(model)
    view._modules = dict(model._modules)  # the copy's own table: the target keeps its layers
    view._modules["layers"] = nn.ModuleList(list(model.layers)[:num_layers])
    view.windows = sliding_windows(view.layers)
    return view


@dataclass
class _Row:
    """One proposing sequence as the draft runs it (what `build_inputs` reads of a `Sequence`):
    its id, its tokens, then its proposals so far, and how many of them the draft's cache
    holds."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class _Cached:
    """What the draft's own cache holds for one sequence: the tokens it computed, in order
    from position 0, and the block table they were written under."""

    token_ids: list[int]
    block_table: list[int]


class DraftProposer:
    """Proposes tokens by running a draft model over paged KV caches (the module docstring).

    `model` runs on `kv_caches` (one `(key, value)` pair per draft layer, with `scales` for an
    8-bit cache) whose blocks are the target's block ids. `own_cache` is the draft's own
    `KVCache` (a separate draft model), or None when `kv_caches` are the target's first layers
    (self-speculation). `sampler` processes the draft's logits as the target's are.
    """

    def __init__(self, model: DecoderForCausalLM,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 scales: Optional[list["LayerKVScales"]], sampler: Sampler, block_size: int,
                 backend: str = "auto", device: torch.device | str = "cpu",
                 own_cache: Optional[KVCache] = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.scales = scales
        self.sampler = sampler
        self.block_size = block_size
        self.backend = backend
        self.device = torch.device(device)
        self.own_cache = own_cache
        self._cached: dict[int, _Cached] = {}

    # ------------------------------------------------------------------ contract
    def move_blocks(self, out: "SchedulerOutput") -> None:
        """Swap out, swap in, then copy-on-write copies on the draft's own cache (the target's
        runner moves the target's cache, which a self-speculating draft shares)."""
        if self.own_cache is not None:
            self.own_cache.move_blocks(out.swap_out, out.swap_in, out.block_copies)

    def forget(self, seq_id: int) -> None:
        """Drops what the draft's cache holds for `seq_id` (it catches up when it comes back)."""
        self._cached.pop(seq_id, None)

    def num_cached_tokens(self, seq_id: int) -> int:
        """How many leading tokens of `seq_id` the draft's own cache holds (0 if unknown)."""
        cached = self._cached.get(seq_id)
        return 0 if cached is None else len(cached.token_ids)

    @torch.inference_mode()
    def propose(self, seqs: list["Sequence"], num_tokens: list[int],
                block_tables: list[list[int]]) -> list[Proposal]:
        """Up to `num_tokens[i]` draft tokens continuing `seqs[i]` (see the module docstring);
        `block_tables[i]` has slots up to position `seqs[i].num_tokens - 1 + num_tokens[i]`."""
        if not len(seqs) == len(num_tokens) == len(block_tables):
            raise ValueError(f"seqs, num_tokens, block_tables: expected one entry each per "
                             f"sequence, got {len(seqs)}, {len(num_tokens)}, {len(block_tables)}")
        proposals = [Proposal([]) for _ in seqs]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        if not active:
            return proposals
        rows = [_Row(seqs[i].seq_id, list(seqs[i].token_ids),
                     self._start(seqs[i], block_tables[i]))
                for i in active]
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        live = list(range(len(active)))
        while live:
            logits = self._forward([rows[j] for j in live],
                                   [block_tables[active[j]] for j in live])
            tokens, rows_probs = self._choose(logits, [seqs[active[j]] for j in live],
                                              [rows[j] for j in live])
            for j, token, p in zip(live, tokens, rows_probs):
                i = active[j]
                rows[j].num_computed_tokens = rows[j].num_tokens
                rows[j].token_ids.append(token)
                proposals[i].token_ids.append(token)
                if p is not None:
                    probs[i].append(p)
            live = [j for j in live if len(proposals[active[j]].token_ids) < num_tokens[active[j]]]
        for j, i in enumerate(active):
            if probs[i]:
                proposals[i].probs = torch.stack(probs[i])
            self._remember(seqs[i], rows[j], block_tables[i])
        return proposals

    # ------------------------------------------------------------------- helpers
    def _start(self, seq: "Sequence", table: list[int]) -> int:
        """The first position the draft must compute for `seq`: the target's first uncomputed
        token when the draft shares its cache, else the end of what the draft's own cache still
        holds validly (tokens unchanged, blocks unchanged, within the target's computed ones)."""
        if self.own_cache is None:
            return seq.num_computed_tokens
        cached = self._cached.get(seq.seq_id)
        if cached is None:
            return 0
        limit = min(len(cached.token_ids), seq.num_computed_tokens)
        valid = limit
        if cached.token_ids[:limit] != seq.token_ids[:limit]:  # rare: compare one by one
            valid = next(i for i in range(limit) if cached.token_ids[i] != seq.token_ids[i])
        for b, (old, new) in enumerate(zip(cached.block_table, table)):
            if b * self.block_size >= valid:
                break
            if old != new:
                return b * self.block_size
        return valid

    def _remember(self, seq: "Sequence", row: _Row, table: list[int]) -> None:
        if self.own_cache is not None:
            self._cached[seq.seq_id] = _Cached(row.token_ids[:row.num_computed_tokens],
                                               list(table))

    def _forward(self, rows: list[_Row], tables: list[list[int]]) -> torch.Tensor:
        """float32 logits `[len(rows), vocab]` at each row's last token, after computing the
        rows' uncomputed tokens into the draft's cache."""
        scheduled = [(cast("Sequence", r), r.num_tokens - r.num_computed_tokens) for r in rows]
        inputs = build_inputs(scheduled, tables, self.block_size, self.backend, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                            self.scales)
        return self.model.compute_logits(hidden[inputs.logits_indices]).float()

    def _choose(self, logits: torch.Tensor, seqs: list["Sequence"], rows: list[_Row]
                ) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        """One token per row: the argmax of the processed logits for greedy requests (no
        probabilities), else a draw from the request's sampling distribution with its
        generator (and that distribution)."""
        states = [_draft_state(seq, row) for seq, row in zip(seqs, rows)]
        x = self.sampler.processed_logits(logits, states)
        tokens = argmax(x).tolist()
        out_probs: list[Optional[torch.Tensor]] = [None] * len(seqs)
        random = [j for j, s in enumerate(states) if not s.params.greedy]
        if random:
            probs = sampling_probs(x[random], [states[j].params for j in random])
            drawn = draw(probs, [states[j].generator for j in random]).tolist()
            for r, j in enumerate(random):
                tokens[j] = drawn[r]
                out_probs[j] = probs[r]
        return tokens, out_probs


def _draft_state(seq: "Sequence", row: _Row) -> SamplingState:
    """The sequence's sampling state with its proposals so far counted as output (for the
    penalties and min_tokens) and without its grammar (the draft does not advance it)."""
    state = seq.sampling_state
    output = row.token_ids[seq.num_prompt_tokens:]
    return SamplingState(params=state.params, prompt_token_ids=state.prompt_token_ids,
                         output_token_ids=output, generator=state.generator,
                         eos_token_ids=state.eos_token_ids)
