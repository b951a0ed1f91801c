"""``DecodeSession``: flashcore's own decode loop over a patched HF model, one CUDA-graph replay per token.

``model.generate`` re-enters Python, builds masks and position ids, and (compiled) checks guards on every step.
A session instead owns its :class:`FlashCoreCache` and a few static device buffers (the last token, its RoPE
position, its cache position); the decode step reads and updates only those, so after one eager warm-up step
it is captured once as a CUDA graph and every later token is one ``graph.replay()``. Greedy selection (or
Gumbel-max sampling) happens inside the graph and feeds the next step directly: the only host sync per token is
the caller reading the sampled ids, if it wants them. The step's cos and sin are rows of a table the model's rotary
module computed once (``rotary_table.py``), and one launch ends it: the pick, every buffer's update and the next
step's inputs, its token's embedding row and its cos and sin rows (``step_end.py``). A prefill of a prompt shape the
session has prefilled before replays a CUDA graph as well (``capture_prefill``).

With ``compile=True`` the captured step is a ``torch.compile``d forward (inductor fuses the norms, RoPE and
elementwise ops around the GEMMs; flashcore's op stays one opaque call in it). At batch 1 most of an eager step
is small-kernel latency, not weight streaming. Inductor rounds intermediates where eager does
(``emulate_precision_casts``), but its fused norms sum in another order, so bf16 tokens can still leave eager's at
a near-tie (``benchmarks/NOTES.md``, entries 8 and 32). ``fuse_projections=True`` runs each layer's q/k/v and
gate/up projections as one GEMM each (on the H100, cuBLAS gives bitwise the same outputs as the separate GEMMs, and
the 2 MB k/v GEMVs stop being latency-bound). ``layer_kernels=True`` runs the norms, RoPE and SiLU-and-mul on
flashcore's kernels: inductor then has nothing left to fuse that changes bits, so a compiled session keeps eager's
tokens, and a plain replayed one launches about 24 fewer kernels per layer and is as fast (H100, B1: 0.991 ms per
step replayed, 0.998 ms compiled, ``bench_generate`` at bb401a0; entry 84).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from flashcore.backends import captured_graph, kernels_as_captured
from flashcore.integrations.cache import FlashCoreCache
from flashcore.integrations.llama import (
    CACHE_ARGUMENT_NAME,
    apply_flashcore_to_llama,
    flashcore_options,
    model_layer_devices,
    model_tp_size,
)
from flashcore.integrations.prompt_lookup import propose_from_history
from flashcore.integrations.rotary_table import RotaryRows, rotary_table_for, rotary_table_installed
from flashcore.integrations.step_end import append_history, chunked_argmax, next_step_inputs, pick_and_advance

MAX_DRAFT_TOKENS = 16  # per speculative step
MAX_DRAFT_BACKOFF = 64  # plain steps after drafts keep failing, at most, before speculating again
# speculative_step's n-gram sizes: a draft needs an earlier occurrence of the row's last 2 or 3 tokens. A 1-token match
# drafted on 6 of 64 steps of an open-ended SmolLM2 answer and never held; from 2, 3 verify steps, and on an
# input-grounded answer fewer verify steps for the same accepted drafts (benchmarks/NOTES.md, entry 42).
DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 2
# Captured prefills: a prompt shape is captured the second time the session prefills it, and the session holds the
# graphs of its MAX_PREFILL_GRAPHS most recent captured shapes (each holds its activations' memory, which grows with
# B x S), remembering up to MAX_PREFILL_SHAPES_SEEN shapes prefilled once.
MAX_PREFILL_GRAPHS = 2
MAX_PREFILL_SHAPES_SEEN = 8
_WARM = object()  # a step key whose eager warm-up ran: the next call captures it


class DecodeSession:
    """A batch of B sequences whose KV cache and decode step live on the device.

    Args:
        model: a LLaMA-family ``*ForCausalLM``; it is patched with ``apply_flashcore_to_llama`` if it is not (with
            its defaults, or the options already applied, and the two below where given).
        max_cache_len: tokens per row the session's cache can hold (prompt, every turn and every answer).
        batch_size: B.
        use_cuda_graph: capture the decode step as a CUDA graph (default: when the model is on one CUDA device; a
            model that ``device_map`` spread over several runs eager steps).
        temperature: 0 for greedy; otherwise Gumbel-max sampling at this temperature, inside the graph.
        compile: run the decode step through ``torch.compile`` (compiled on the first decode step, then captured).
        fuse_projections: ``apply_flashcore_to_llama``'s option of that name, set on the model (in place): one GEMM
            each for q/k/v and gate/up. None (default) keeps what the model has (off if it is not patched).
        layer_kernels: ``apply_flashcore_to_llama``'s option of that name, set on the model (in place): every
            RMSNorm, the RoPE and the SiLU-and-mul on flashcore's kernels, so that eager, replayed and compiled
            steps compute the same bits. None (default) keeps what the model has (off if it is not patched).
        capture_prefill: replay a prefill of a prompt shape seen before from a CUDA graph (prompts without
            ``attention_mask``): the second prefill of a ``[B, S]`` shape captures it, later ones replay it, with the
            eager prefill's bits. It takes the host's Python out of the prefill (at 16 x 512 tokens on the H100 the GPU
            waits on it for about 1.4 ms of 29; NOTES.md, entry 87), at the cost of a graph and its activations'
            memory per shape kept (``MAX_PREFILL_GRAPHS``). Default: with ``use_cuda_graph``.

    Usage::

        session = DecodeSession(model, max_cache_len=1024)
        token = session.prefill(input_ids)          # [B] ids of the first new token
        for _ in range(255):
            token = session.decode_step()           # [B], a view of the session's buffer
        ids = session.text()                        # each row's prompt and the 256 tokens picked
    """

    def __init__(
        self,
        model,
        *,
        max_cache_len: int,
        batch_size: int = 1,
        use_cuda_graph: bool | None = None,
        temperature: float = 0.0,
        compile: bool = False,
        fuse_projections: bool | None = None,
        layer_kernels: bool | None = None,
        capture_prefill: bool | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        options = flashcore_options(model) or {}
        if fuse_projections is not None:
            options["fuse_projections"] = fuse_projections
        if layer_kernels is not None:
            options["layer_kernels"] = layer_kernels
        self.model = apply_flashcore_to_llama(model, **options)  # first: it refuses an unsupported model
        # The session's buffers live with the input embeddings; under device_map each layer's cache lives with its
        # layer, and the logits come back from the last device.
        device = model.get_input_embeddings().weight.device
        layer_devices = model_layer_devices(model)
        one_device = all(layer_device == device for layer_device in layer_devices)
        self.use_cuda_graph = device.type == "cuda" and one_device if use_cuda_graph is None else use_cuda_graph
        if self.use_cuda_graph and not one_device:
            raise ValueError(
                f"use_cuda_graph=True needs the model on one device, but device_map spread its layers over "
                f"{sorted({str(d) for d in layer_devices})}: one CUDA graph captures one device's work. Leave "
                f"use_cuda_graph None (eager steps) for such a model"
            )
        if compile and not one_device:
            raise ValueError(
                f"compile=True needs the model on one device, but device_map spread its layers over "
                f"{sorted({str(d) for d in layer_devices})}: accelerate's hooks between devices break the compiled "
                f"graph. Leave compile False for such a model"
            )
        if self.use_cuda_graph and device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs the model on CUDA, it is on {device}")
        if capture_prefill and not self.use_cuda_graph:
            raise ValueError(
                "capture_prefill=True needs CUDA graphs, but this DecodeSession runs eager steps (use_cuda_graph is "
                "False: the model is not on one CUDA device, or it was passed so); leave capture_prefill None"
            )
        self.capture_prefill = self.use_cuda_graph if capture_prefill is None else capture_prefill
        self.temperature = temperature
        self.cache = FlashCoreCache(
            model.config,
            max_cache_len,
            max_batch_size=batch_size,
            device=layer_devices,
            dtype=model.dtype,
            tp_size=model_tp_size(model),
        )
        if self.use_cuda_graph:
            # The session counts every replay's tokens from the start, so a capture keeps the cache's host-side
            # bound on the rows' lengths: prefills then check capacity without a host read.
            self.cache.count_replayed_tokens(0)
        # cos and sin of every position a step can reach (a verify step's drafts run past the last kept token), from
        # the model's rotary module once: each step gathers its rows (rotary_table.py). Under device_map the rotary
        # module's device may not be the positions'; it keeps HF's module.
        num_positions = max_cache_len + MAX_DRAFT_TOKENS + 1
        self._rotary_table = rotary_table_for(model, num_positions) if one_device else None
        self.token = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Each row's text so far (its prompt's real tokens, then every selected token), for prompt lookup's drafts.
        # Room for what speculative_step writes past the cache's last slot before it checks the drafts.
        self._history = torch.zeros(batch_size, max_cache_len + 1 + MAX_DRAFT_TOKENS, dtype=torch.long, device=device)
        self._history_len = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Whether the text ends with a selected token that is not in the cache yet (self.token): from prefill on,
        # until reset. A turn's prefill takes it off the text first: the turn feeds it (or drops it) itself.
        self._token_pending = False
        self._pick_tickets = torch.zeros(batch_size, dtype=torch.int32, device=device)  # pick_and_advance's scratch
        # A decode step's inputs, written by the step before it (its end launch, step_end.pick_and_advance): the
        # token's embedding row and the position's cos and sin rows, so that the step starts with its first
        # projection (NOTES.md, entry 61). Where the embedding is a plain nn.Embedding on one device and the session
        # has a rotary table; None otherwise (the step embeds and gathers itself). _next_inputs_ready: whether they
        # hold self.token's (a prefill or a verify step leaves them stale, and the next step writes them first).
        self._next_inputs = _next_inputs_buffers(model, self._rotary_table, batch_size, model_tp_size(model))
        self._rotary_rows = RotaryRows(self._next_inputs[3]) if self._next_inputs is not None else None
        self._next_inputs_ready = False
        # RoPE position of the next token per row (left padding shifts rows), and its cache position (the same
        # for every row: pads occupy positions too, as in generate).
        self._position = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self._cache_position = torch.zeros(1, dtype=torch.long, device=device)
        # Captured steps by key ("decode", or a speculative step's kind and settings): _WARM after the eager warm-up
        # run, then (graph, outputs). See _run_step.
        self._graphs: dict[tuple, object] = {}
        # Prefills by (B, S): their graphs and static inputs, least recently used first, and the shapes seen once.
        self._prefill_graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._prefill_shapes_seen: OrderedDict[tuple, None] = OrderedDict()
        # fullgraph: a graph break would put Python between kernels that the capture cannot replay. The default
        # mode, because the session captures the CUDA graph itself. The whole step, its bookkeeping too: inductor
        # fuses the position and text updates, ten small eager kernels otherwise (NOTES.md, entry 56).
        self._compiled = compile
        self._step = (
            torch.compile(self._step_eager, fullgraph=True, dynamic=False, options=_inductor_options(device))
            if compile
            else self._step_eager
        )
        self._draft_backoff = 0  # plain steps speculative_step takes before it drafts again
        self._failed_verifies = 0  # verify steps in a row that kept no draft
        # The drafts for the next speculative step, proposed at the end of the step before it (inside its graph), and
        # the settings they were proposed for (None: stale, after prefill, decode_step or reset).
        self._drafts = torch.zeros(batch_size, MAX_DRAFT_TOKENS, dtype=torch.long, device=device)
        self._drafts_for: tuple[int, int, int] | None = None  # (num_draft, max_ngram, min_ngram)
        self._any_draft = False  # whether some row has a draft in self._drafts, as the last step's host read said

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Runs the new tokens ``[B, S]`` (left-padded if ``attention_mask`` says so); returns the next ids [B].

        May be called again later to append a turn; the cache keeps everything before it. With
        ``capture_prefill``, a prompt shape seen before replays a CUDA graph.
        """
        if attention_mask is None and self.capture_prefill:
            self._prefill_captured(input_ids)
        else:
            self._prefill_device_work(input_ids, attention_mask, drop_pending_token=self._token_pending)
        self._token_pending = True
        self._next_inputs_ready = False
        self._drafts_for = None
        return self.token

    def _prefill_device_work(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, drop_pending_token: bool
    ) -> None:
        """A prefill's forward and its device-side bookkeeping: the positions, the picked token and the text (what
        a captured prefill replays). ``drop_pending_token``: take the last picked token off the text first, since
        this turn feeds it (or drops it) itself."""
        batch, length = input_ids.shape
        if attention_mask is None:
            positions = self._position + torch.arange(length, device=input_ids.device)
        else:
            real = attention_mask.to(torch.long)
            positions = self._position + (real.cumsum(dim=1) - 1).clamp(min=0)
        cache_position = self._cache_position + torch.arange(length, device=input_ids.device)
        with rotary_table_installed(self.model, self._rotary_table):
            logits = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions,
                cache_position=cache_position,
                **{CACHE_ARGUMENT_NAME: self.cache},
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        self._position.copy_(positions[:, -1:] + 1)
        self._cache_position.add_(length)
        self.token.copy_(self._select(logits))
        real = input_ids if attention_mask is None else _real_tokens_first(input_ids, attention_mask)
        counts = torch.full_like(self._history_len, length) if attention_mask is None else attention_mask.sum(dim=1)
        if drop_pending_token:
            self._history_len.sub_(1)
        self._append_history(real, counts)
        self._append_history(self.token[:, None], 1)  # after each row's own real tokens, not after the pads

    def _prefill_captured(self, input_ids: torch.Tensor) -> None:
        """A prefill without a mask under ``capture_prefill``: eager the first time its shape comes (which also
        compiles its kernels), captured the second, replayed from then on."""
        key = tuple(input_ids.shape)
        entry = self._prefill_graphs.get(key)
        if entry is None and key not in self._prefill_shapes_seen:
            self._prefill_shapes_seen[key] = None
            if len(self._prefill_shapes_seen) > MAX_PREFILL_SHAPES_SEEN:
                self._prefill_shapes_seen.popitem(last=False)
            # kernels_as_captured compiles the kernels the capture will launch
            with kernels_as_captured():
                self._prefill_device_work(input_ids, None, drop_pending_token=self._token_pending)
            return
        # A replay runs no Python in the cache: the capacity check and the count of its tokens come first, and a
        # prompt that would overflow a row is refused before anything is written.
        self.cache.reserve_replayed_tokens(input_ids.shape[1])
        if self._token_pending:
            self._history_len.sub_(1)
        if entry is None:
            static_ids = input_ids.clone()
            with captured_graph() as graph:
                self._prefill_device_work(static_ids, None, drop_pending_token=False)
            entry = self._prefill_graphs[key] = (graph, static_ids)
            if len(self._prefill_graphs) > MAX_PREFILL_GRAPHS:
                self._prefill_graphs.popitem(last=False)
        self._prefill_graphs.move_to_end(key)
        graph, static_ids = entry
        static_ids.copy_(input_ids)
        graph.replay()

    @torch.inference_mode()
    def decode_step(self) -> torch.Tensor:
        """Appends ``self.token`` and selects the next one; returns ``self.token`` (overwritten by the next step)."""
        self._run_step(("decode",), self._step)
        self._drafts_for = None
        return self.token

    @torch.inference_mode()
    def speculative_step(
        self, num_draft: int, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy step that may emit up to ``num_draft + 1`` tokens per row: prompt lookup drafts ``num_draft``
        tokens from each row's own text (:func:`~flashcore.integrations.prompt_lookup.propose_from_history`, with its
        ``max_ngram`` and ``min_ngram``), one forward verifies them with ``self.token`` (``S_q = num_draft + 1``), and
        each row keeps its drafts up to the first one the model would not have picked, then the model's own next token.
        The rejected drafts are rolled back in every layer (``FlashCoreCache.rollback_rows``), on the device.

        Speculation stands aside where it cannot pay: a step where no row found a draft is a plain decode step, and
        after a verify step that kept no draft the next ``1, 2, 4, ...`` (up to ``MAX_DRAFT_BACKOFF``) steps are plain
        ones, the pause doubling with each failure in a row and ending at the first accepted draft.

        A verify step, and a plain step that may be followed by one, also proposes the next step's drafts, so that both
        decisions come from one host read per step: whether every draft failed and whether any row has a next draft,
        read together after the step (the caller's read of the tokens then waits for nothing). The other plain steps of
        a pause are ``decode_step``'s step, with no drafts and no host read. Like ``decode_step``, each kind of step
        runs eagerly once and is then captured as a CUDA graph (per setting of ``num_draft``, ``max_ngram`` and
        ``min_ngram``) and replayed; the first speculative step after ``prefill``, ``decode_step`` or a change of
        settings proposes its drafts eagerly first (one more host read).

        Returns ``(tokens [B, num_draft + 1], counts [B])`` (``[B, 1]`` for a plain step), on the device and overwritten
        by later steps (read or clone them first): row b emitted ``tokens[b, :counts[b]]``, the last of which is the new
        ``self.token``. The tokens are those ``decode_step`` would have given one at a time, up to floating-point ties
        (the verify step attends over several new tokens at once). The cache needs room for ``num_draft`` tokens past
        the last one kept. Greedy sessions only.
        """
        if self.temperature != 0:
            raise NotImplementedError("speculative_step is greedy: build the session with temperature=0")
        if not 1 <= num_draft <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft must be in [1, {MAX_DRAFT_TOKENS}], got {num_draft}")
        settings = (num_draft, max_ngram, min_ngram)
        if self._drafts_for != settings:
            self._any_draft = bool(self._propose(*settings).any())
            self._drafts_for = settings
        if self._draft_backoff > 1:  # paused, and not the pause's last step: decode_step's step, no host read
            self._draft_backoff -= 1
            self._run_step(("decode",), self._step)  # self._drafts goes stale: the pause's last step proposes anew
            return self.token[:, None], torch.ones_like(self.token)
        if self._draft_backoff == 1 or not self._any_draft:  # a plain step that proposes the next step's drafts
            self._draft_backoff = 0
            tokens, counts, flags = self._run_step(("plain", *settings), lambda: self._plain_then_propose(*settings))
        else:
            tokens, counts, flags = self._run_step(("verify", *settings), lambda: self._verify_then_propose(*settings))
        any_draft, all_failed = flags.tolist()  # the step's one host read
        self._any_draft = bool(any_draft)
        if tokens.shape[1] > 1:
            if all_failed:
                self._failed_verifies += 1
                self._draft_backoff = min(2 ** (self._failed_verifies - 1), MAX_DRAFT_BACKOFF)
            else:
                self._failed_verifies = 0
        return tokens, counts

    def text(self) -> list[torch.Tensor]:
        """Each row's token ids so far, a 1-D tensor per row on the device: the tokens in its cache (every turn's real
        tokens, pads dropped, and the selected tokens fed back), then the last selected token, ``self.token``. After
        ``prefill(prompt)`` and n decode steps that is the prompt and the n + 1 tokens picked. Views of the session's
        buffer, overwritten by later steps; one host read of the lengths. A row whose text outgrew the buffer
        (``max_cache_len`` + 17 tokens) keeps its last slot overwritten."""
        lengths = self._history_len.tolist()
        return [self._history[row, :length] for row, length in enumerate(lengths)]

    @property
    def captured_steps(self) -> list[tuple]:
        """The steps that replay a CUDA graph, by key: ``("decode",)``, a speculative step's ``("verify", k,
        max_ngram, min_ngram)`` and ``("plain", k, max_ngram, min_ngram)``, and a prefill's ``("prefill", B, S)``
        (least recently used first)."""
        decode = [key for key, entry in self._graphs.items() if entry is not _WARM]
        return decode + [("prefill", *shape) for shape in self._prefill_graphs]

    def _propose(self, num_draft: int, max_ngram: int, min_ngram: int) -> torch.Tensor:
        """Writes each row's next drafts into ``self._drafts``; returns which rows found one ``[B]``."""
        drafts, has_draft = propose_from_history(self._history, self._history_len, num_draft, max_ngram, min_ngram)
        self._drafts[:, :num_draft].copy_(drafts)
        return has_draft

    def _plain_then_propose(self, *settings: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step, then the next drafts: ``(tokens [B, 1], counts [B], flags [2])``, flags being (any row has a
        next draft, 0)."""
        self._step()
        has_draft = self._propose(*settings)
        flags = torch.stack([has_draft.any().long(), torch.zeros_like(has_draft[0], dtype=torch.long)])
        return self.token[:, None].clone(), torch.ones_like(self.token), flags

    def _verify_then_propose(self, *settings: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The verify step of ``self._drafts``, then the next drafts: ``(tokens [B, num_draft + 1], counts [B],
        flags [2])``, flags being (any row has a next draft, no row kept a draft). Device work only."""
        batch, num_draft = self.token.shape[0], settings[0]
        drafts = self._drafts[:, :num_draft]
        steps = torch.arange(num_draft + 1, device=self.token.device)
        logits = self.model(
            input_ids=torch.cat([self.token[:, None], drafts], dim=1),
            position_ids=self._position + steps,
            cache_position=self._cache_position + steps,
            **{CACHE_ARGUMENT_NAME: self.cache},
            use_cache=True,
        ).logits
        picks = self._select(logits.reshape(batch * (num_draft + 1), -1)).view(batch, num_draft + 1)
        # Drafts kept: the leading ones that equal the model's pick at the position before them.
        kept = (drafts == picks[:, :num_draft]).long().cumprod(dim=1).sum(dim=1)  # [B]
        counts = kept + 1
        self.cache.rollback_rows((num_draft - kept).to(torch.int32), check=False)
        self.token.copy_(picks.gather(1, kept[:, None]).squeeze(1))
        self._position.add_(counts[:, None])
        self._cache_position.add_(counts.max())
        self._append_history(picks, counts)
        has_draft = self._propose(*settings)
        flags = torch.stack([has_draft.any().long(), (kept == 0).all().long()])
        return picks, counts, flags

    def _run_step(self, key: tuple, step):
        """``step()``'s outputs: run eagerly on its key's first call (warming up the kernels the capture will run,
        autotuning and allocations), captured as a CUDA graph on the second and replayed from then on (the outputs
        are then the graph's own tensors, overwritten by each replay). Always eager without ``use_cuda_graph``.

        A step that runs ``self._step`` (every key but a verify step's) reads the inputs the step before wrote, and
        writes the next ones; they are written here first where nothing wrote them."""
        reads_next_inputs = self._next_inputs is not None and key[0] != "verify"
        if reads_next_inputs and not self._next_inputs_ready:
            next_step_inputs(self.token, self._position, *self._next_inputs)
        rotary = self._rotary_rows if reads_next_inputs else self._rotary_table
        outputs = self._run_graph(key, step, rotary)
        self._next_inputs_ready = reads_next_inputs
        return outputs

    def _run_graph(self, key: tuple, step, rotary):
        """:meth:`_run_step`'s eager warm-up, capture and replay, with ``rotary`` as the model's rotary module."""
        entry = self._graphs.get(key)
        if not self.use_cuda_graph:
            with rotary_table_installed(self.model, rotary):
                return step()
        if entry is None:
            self._graphs[key] = _WARM
            if self._compiled and key[0] != "verify":
                # A compiled step already traced (a speculative plain step after the decode step's warm-up) runs no
                # Python in the cache either; where it traces, the cache forgets its bound anyway.
                self.cache.count_replayed_tokens(_tokens_appended(key))
            # kernels_as_captured compiles the kernels the capture will replay
            with kernels_as_captured(), rotary_table_installed(self.model, rotary):
                return step()
        if entry is _WARM:
            with captured_graph() as graph, rotary_table_installed(self.model, rotary):
                outputs = step()
            self._graphs[key] = entry = (graph, outputs)
        graph, outputs = entry
        self.cache.count_replayed_tokens(_tokens_appended(key))
        graph.replay()
        return outputs

    def reset(self) -> None:
        """Forgets every token; the captured graph stays valid (it reads the same buffers)."""
        self.cache.reset()
        self._position.zero_()
        self._cache_position.zero_()
        self._history_len.zero_()
        self._token_pending = False
        self._next_inputs_ready = False
        self._draft_backoff = self._failed_verifies = 0
        self._drafts_for = None

    def _step_eager(self) -> None:
        """One decode step on the session's buffers: the next token, the positions, the text (``self._step``
        runs it, compiled with ``compile=True``). After the forward, one launch (``step_end.pick_and_advance``), which
        also writes the next step's inputs where the session keeps them."""
        if self._next_inputs is None:
            logits = self._next_logits(input_ids=self.token[:, None])
        else:
            logits = self._next_logits(inputs_embeds=self._next_inputs[1])
        pick_and_advance(
            self._scores(logits).to(self.token.device), self._pick_tickets, self.token, self._position,
            self._cache_position, self._history, self._history_len, *(self._next_inputs or ()),
        )  # fmt: skip

    def _append_history(self, tokens: torch.Tensor, counts: torch.Tensor | int) -> None:
        """Appends each row's first ``counts[b]`` of ``tokens [B, n]`` to its text (``step_end.append_history``)."""
        append_history(self._history, self._history_len, tokens, counts)

    def _next_logits(self, **inputs: torch.Tensor) -> torch.Tensor:
        """The logits of a decode step's one token per row, given as ``input_ids`` or ``inputs_embeds``."""
        return self.model(
            **inputs,
            position_ids=self._position,
            cache_position=self._cache_position,
            **{CACHE_ARGUMENT_NAME: self.cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """What the pick takes the largest of: the logits (greedy), or for Gumbel-max sampling ``logits / T`` plus
        Gumbel noise (its argmax samples ``softmax(logits / T)``, with no host sync)."""
        if self.temperature == 0:
            return logits
        noise = -torch.log(-torch.log(torch.rand_like(logits, dtype=torch.float32).clamp_(min=1e-20)))
        return logits.float() / self.temperature + noise

    def _select(self, logits: torch.Tensor) -> torch.Tensor:
        """The ids picked from ``logits``, on the session's device (under device_map the logits come from the
        last layer's)."""
        return chunked_argmax(self._scores(logits)).to(self.token.device)


def _tokens_appended(key: tuple) -> int:
    """The most tokens a row gains in a step of this key: one in a decode step (and a speculative plain one), the
    drafts and the token before them in a verify step."""
    return 1 if key[0] != "verify" else key[1] + 1


def _next_inputs_buffers(model, rotary_table, batch_size: int, tp_size: int) -> tuple[torch.Tensor, ...] | None:
    """``(embedding weight [V, H], next_embeds [B, 1, H], rotary table [P, 2, D], next_rotary [B, 1, 2, D])``, the
    session's next-step inputs and what they are gathered from; None where the step must embed its tokens itself: a
    model without a rotary table (``rotary_table_for``), split over devices or ranks, or whose input embedding is not
    a plain ``nn.Embedding``."""
    embedding = model.get_input_embeddings()
    if rotary_table is None or tp_size != 1 or type(embedding) is not torch.nn.Embedding or embedding.max_norm:
        return None
    weight, table = embedding.weight, rotary_table.table
    if weight.stride(1) != 1:
        return None
    next_embeds = torch.zeros(batch_size, 1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    next_rotary = torch.zeros(batch_size, 1, *table.shape[1:], dtype=table.dtype, device=table.device)
    return weight, next_embeds, table, next_rotary


def _real_tokens_first(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's real tokens moved to the front, in order (a left-padded row's pads go to the back)."""
    order = torch.argsort(1 - attention_mask.to(torch.long), dim=1, stable=True)
    return input_ids.gather(1, order)


def _inductor_options(device: torch.device) -> dict:
    """Inductor's options for the compiled step.

    - ``emulate_precision_casts``: inductor rounds intermediates to the dtype where eager PyTorch does. Without it,
      it fuses a layer's two residual adds into one kernel that skips the bf16 rounding of the first sum
      (``benchmarks/NOTES.md``, entry 32), and bf16 tokens leave eager's.
    - PDL for inductor's Triton kernels on sm_90+, where this torch has the switch: each kernel launches while the
      one before it drains, as flashcore's own kernels do. H100, fused session, B1: -1.6% per decode step, tokens
      unchanged (entry 29).
    """
    import torch._inductor.config as inductor_config

    options = {"emulate_precision_casts": True}
    has_switch = hasattr(inductor_config.triton, "enable_pdl")
    if device.type == "cuda" and has_switch and torch.cuda.get_device_capability(device) >= (9, 0):
        options["triton.enable_pdl"] = True
    return options
